"""The elementwise math ops (ops/math.py): each against a float64 reference written
with Python's math module, each gradient against finite differences, the domain
edges (nan, inf, clip's ends) as numpy and torch give them, and the build-time
checks."""
import math

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def elementwise(fn):
    """A reference applying the scalar function fn(value, **attrs) to every element."""
    def reference(x, **attrs):
        flat = [fn(float(v), **attrs) for v in x.reshape(-1)]
        return {"out": np.array(flat, np.float64).reshape(x.shape)}
    return reference


def _pow(v, factor):
    return v ** factor


REFERENCES = {
    "exp": (elementwise(lambda v: math.exp(v)), {}, False),
    "log": (elementwise(lambda v: math.log(v)), {}, True),
    "sqrt": (elementwise(lambda v: math.sqrt(v)), {}, True),
    "square": (elementwise(lambda v: v * v), {}, False),
    "abs": (elementwise(lambda v: math.fabs(v)), {}, False),
    "pow": (elementwise(_pow), {"factor": 2.5}, True),
    "scale": (elementwise(lambda v, scale, bias: v * scale + bias),
              {"scale": -1.5, "bias": 0.25}, False),
    "clip": (elementwise(lambda v, min, max: min if v < min else max if v > max else v),
             {"min": -0.5, "max": 1.25}, False),
}


def sample(shape, positive, dtype=np.float64):
    x = rng.standard_normal(shape) * 2
    if positive:
        x = np.abs(x) + 0.2
    return x.astype(dtype)


@pytest.mark.parametrize("op_type", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_forward_and_grad(op_type, dtype):
    reference, attrs, positive = REFERENCES[op_type]
    x = sample((3, 7), positive, dtype)
    if op_type in ("abs", "clip"):                  # keep finite differences off the kinks
        x = np.where(np.abs(np.abs(x) - 0.5) < 0.05, x + 0.2, x)
        x = np.where(np.abs(x) < 0.05, 0.3, x)
        x = np.where(np.abs(x - 1.25) < 0.05, 1.5, x).astype(dtype)
    helper_test_op(op_type, {"x": x}, attrs, reference,
                   grad_wrt=("x",) if dtype == np.float64 else ())


@pytest.mark.parametrize("op_type", sorted(REFERENCES))
def test_scalars_and_empty_tensors(op_type):
    reference, attrs, positive = REFERENCES[op_type]
    for shape in ((), (0, 3)):
        helper_test_op(op_type, {"x": sample(shape, positive)}, attrs, reference)


def run(op_type, x, **attrs):
    scope = mg.Scope()
    vx, out = scope.new_var("x"), scope.new_var("out")
    vx.set(x)
    (got,) = mg.Executor().run([mg.Operator(op_type, x=vx, out=out, **attrs)], scope,
                               fetch=[out])
    return got


def run_grad(op_type, keep, value, dout, **attrs):
    scope = mg.Scope()
    vd, dx = scope.new_var("dout"), scope.new_var("dx")
    vd.set(dout)
    bound = {}
    if keep:
        bound[keep] = scope.new_var(keep)
        bound[keep].set(value)
    op = mg.Operator(op_type + "_grad", dout=vd, dx=dx, **bound, **attrs)
    (got,) = mg.Executor().run([op], scope, fetch=[dx])
    return got


def test_out_of_domain_values_are_nan_and_inf_as_in_numpy():
    x = np.array([-1.0, 0.0, 4.0])
    got = run("log", x)
    assert np.isnan(got[0]) and got[1] == -np.inf and got[2] == pytest.approx(math.log(4))
    assert np.isnan(run("sqrt", x)[0])
    assert run("exp", np.array([1000.0]))[0] == np.inf
    assert np.isnan(run("pow", np.array([-2.0]), factor=0.5)[0])


def test_clip_gradient_passes_at_both_ends_as_torch_clamp():
    x = np.array([-2.0, -1.0, 0.0, 2.0, 3.0])
    got = run_grad("clip", "x", x, np.ones(5), min=-1.0, max=2.0)
    np.testing.assert_array_equal(got, [0, 1, 1, 1, 0])
    np.testing.assert_array_equal(run("clip", x, min=-1.0), [-1, -1, 0, 2, 3])


def test_abs_gradient_is_zero_at_zero():
    np.testing.assert_array_equal(run_grad("abs", "x", np.array([-3.0, 0.0, 2.0]),
                                           np.ones(3)), [-1, 0, 1])


def test_grads_keep_dout_dtype():
    x = sample((4,), True, np.float32)
    for op_type, keep in (("log", "x"), ("exp", "out"), ("sqrt", "out")):
        assert run_grad(op_type, keep, x, np.ones(4, np.float32)).dtype == np.float32
    assert run_grad("scale", None, None, np.ones(4, np.float32), scale=2.0).dtype == np.float32


@pytest.mark.parametrize("op_type, attrs, message", [
    ("clip", {"min": 2.0, "max": 1.0}, "clip: attribute 'min' \\(2.0\\) must be <= attribute "
                                       "'max' \\(1.0\\)"),
    ("clip", {"min": float("nan")}, "clip: attribute 'min' must be a number or \\+-inf"),
    ("pow", {"factor": float("inf")}, "pow: attribute 'factor' must be a finite number"),
    ("scale", {"bias": float("nan")}, "scale: attribute 'bias' must be a finite number"),
])
def test_bad_attributes_name_the_op_and_the_attribute(op_type, attrs, message):
    scope = mg.Scope()
    with pytest.raises(mg.OpError, match=message):
        mg.Operator(op_type, x=scope.new_var("x"), out=scope.new_var("out"), **attrs)


@pytest.mark.parametrize("op_type", ["exp", "log", "clip", "scale"])
def test_integer_input_is_refused(op_type):
    with pytest.raises(mg.OpError, match=f"{op_type}: input 'x' must be a float tensor"):
        run(op_type, np.arange(3))
