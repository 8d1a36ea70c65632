"""relu, sigmoid, tanh, gelu, leaky_relu."""
import math
import warnings

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg
from minigraph.schema import get_schema


def relu_reference(x):
    return {"out": np.where(x > 0, x, 0.0)}


def away_from_zero(shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.1, 2.0, shape)


def test_relu_forward_and_grad():
    helper_test_op("relu", {"x": away_from_zero((3, 4, 5))}, {}, relu_reference,
                   grad_wrt=("x",))


def test_relu_keeps_float32():
    got = helper_test_op("relu", {"x": away_from_zero((7,)).astype(np.float32)}, {},
                         relu_reference)
    assert got["out"].dtype == np.float32


def test_relu_rejects_int_input():
    scope = mg.Scope()
    x = scope.new_var("x")
    x.set(np.arange(3))
    with pytest.raises(mg.OpError, match="relu: input 'x' must be a float tensor"):
        mg.Operator("relu", x=x, out=scope.new_var("out"))


# ---- sigmoid, tanh, gelu, leaky_relu ---------------------------------------------------

erf_ref = np.vectorize(math.erf, otypes=[float])
erfc_ref = np.vectorize(math.erfc, otypes=[float])


def sigmoid_reference(x):
    return {"out": np.exp(-np.logaddexp(0.0, -x))}


def tanh_reference(x):
    return {"out": np.vectorize(math.tanh, otypes=[float])(x)}


def gelu_reference(x):
    return {"out": 0.5 * x * (1.0 + erf_ref(x / math.sqrt(2.0)))}


def leaky_relu_reference(x, alpha=0.01):
    return {"out": np.where(x > 0, x, alpha * x)}


CASES = [("sigmoid", sigmoid_reference, {}), ("tanh", tanh_reference, {}),
         ("gelu", gelu_reference, {}), ("leaky_relu", leaky_relu_reference, {}),
         ("leaky_relu", leaky_relu_reference, {"alpha": 0.2}),
         ("leaky_relu", leaky_relu_reference, {"alpha": -0.5})]


@pytest.mark.parametrize("op_type, reference, attrs", CASES)
def test_activation_forward_and_grad(op_type, reference, attrs):
    x = away_from_zero((3, 4, 5), seed=3) * 2.0
    helper_test_op(op_type, {"x": x}, attrs, reference, grad_wrt=("x",))


@pytest.mark.parametrize("op_type, reference, attrs", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_activation_keeps_dtype(op_type, reference, attrs, dtype):
    x = away_from_zero((6, 7), seed=4).astype(dtype)
    got = helper_test_op(op_type, {"x": x}, attrs, reference)
    assert got["out"].dtype == dtype


def run_op(op_type, x, **attrs):
    scope = mg.Scope()
    xv, out = scope.new_var("x"), scope.new_var("out")
    xv.set(x)
    mg.Executor().run([mg.Operator(op_type, x=xv, out=out, **attrs)], scope)
    return out.get()


def test_sigmoid_is_stable_for_huge_inputs():
    x = np.array([-1e308, -1000.0, -745.0, -40.0, 0.0, 40.0, 1000.0, 1e308, -np.inf, np.inf])
    x32 = np.clip(x, -3e38, 3e38).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_op("sigmoid", x)
        out32 = run_op("sigmoid", x32)
    np.testing.assert_allclose(out, sigmoid_reference(x)["out"], rtol=1e-15, atol=0)
    assert out[4] == 0.5 and out[-1] == 1.0 and out[-2] == 0.0
    np.testing.assert_allclose(out32, out.astype("float32"), rtol=1e-6)
    assert np.isfinite(out32).all()


def test_tanh_saturates():
    out = run_op("tanh", np.array([-1e308, -50.0, 0.0, 50.0, 1e308]))
    np.testing.assert_array_equal(out, [-1.0, -1.0, 0.0, 1.0, 1.0])


def test_gelu_tails_and_zero_are_accurate():
    x = np.concatenate([-np.geomspace(1e-300, 37.0, 400), [0.0], np.geomspace(1e-300, 40.0, 400)])
    out = run_op("gelu", x)
    want = 0.5 * x * erfc_ref(-x / math.sqrt(2.0))       # no cancellation in the left tail
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=0)
    assert run_op("gelu", np.array([0.0]))[0] == 0.0
    assert run_op("gelu", np.array([-1e308, 1e308])).tolist() == [-0.0, 1e308]


def test_gelu_grad_by_formula_including_tails():
    x = np.concatenate([np.linspace(-45, 45, 901), [0.0, 1e-300, -1e-300, 1e300, -1e300]])
    d = np.random.default_rng(5).standard_normal(x.shape)
    scope = mg.Scope()
    xv, dv, dx = scope.new_var("x"), scope.new_var("dout"), scope.new_var("dx")
    xv.set(x)
    dv.set(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mg.Executor().run([mg.Operator("gelu_grad", x=xv, dout=dv, dx=dx)], scope)
    phi = np.exp(-0.5 * np.minimum(np.abs(x), 100.0) ** 2) / math.sqrt(2 * math.pi)
    want = d * (0.5 * erfc_ref(-x / math.sqrt(2.0)) + x * phi)
    np.testing.assert_allclose(dx.get(), want, rtol=1e-13, atol=1e-300)


def test_grad_ops_keep_what_they_need():
    assert get_schema("sigmoid").grad.grad_type == "sigmoid_grad"
    assert [s.name for s in get_schema("sigmoid_grad").inputs] == ["out", "dout"]
    assert [s.name for s in get_schema("tanh_grad").inputs] == ["out", "dout"]
    assert [s.name for s in get_schema("gelu_grad").inputs] == ["x", "dout"]
    assert [s.name for s in get_schema("leaky_relu_grad").inputs] == ["x", "dout"]
    assert get_schema("leaky_relu_grad").attr("alpha").default == 0.01


def test_leaky_relu_grad_uses_alpha():
    x = np.array([-2.0, -0.5, 0.5, 3.0])
    scope = mg.Scope()
    xv, dv, dx = scope.new_var("x"), scope.new_var("dout"), scope.new_var("dx")
    xv.set(x)
    dv.set(np.ones(4))
    mg.Executor().run([mg.Operator("leaky_relu_grad", x=xv, dout=dv, dx=dx, alpha=0.3)], scope)
    np.testing.assert_allclose(dx.get(), [0.3, 0.3, 1.0, 1.0], rtol=1e-15)


@pytest.mark.parametrize("op_type", ["sigmoid", "tanh", "gelu", "leaky_relu"])
def test_rejects_int_input(op_type):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare((3,), np.dtype("int64"))
    with pytest.raises(mg.OpError, match=f"{op_type}: input 'x' must be a float tensor"):
        mg.Operator(op_type, x=x, out=scope.new_var("out"))


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), "0.1", True])
def test_leaky_relu_rejects_bad_alpha(alpha):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare((3,), np.dtype("float32"))
    with pytest.raises(mg.OpError, match="leaky_relu: attribute 'alpha' must be"):
        mg.Operator("leaky_relu", x=x, out=scope.new_var("out"), alpha=alpha)


@pytest.mark.parametrize("op_type, keep", [("sigmoid_grad", "out"), ("gelu_grad", "x")])
def test_grad_checks_dout_shape(op_type, keep):
    scope = mg.Scope()
    k, d = scope.new_var(keep), scope.new_var("dout")
    k.declare((-1, 3), np.dtype("float32"))
    d.declare((2, 4), np.dtype("float32"))
    with pytest.raises(mg.OpError, match=rf"{op_type}: input 'dout' must have shape \(-1, 3\)"):
        mg.Operator(op_type, **{keep: k}, dout=d, dx=scope.new_var("dx"))


def test_unknown_dims_flow_through():
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.declare((-1, 5), np.dtype("float32"))
    mg.Operator("gelu", x=x, out=out)
    assert out.shape == (-1, 5) and out.dtype == np.float32
