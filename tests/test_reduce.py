"""reduce_sum, reduce_mean, reduce_max: against float64 references written as loops over
the kept positions, gradients against finite differences, ties, keepdim, negative
axes, and the checks that name the op and the attribute."""
import math

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def loop_reduce(fn):
    """A reference: fn(the list of values on the reduced axes) for every kept position,
    one Python call per output value."""
    def reference(x, axis=None, keepdim=False):
        rank = x.ndim
        axes = list(range(rank)) if axis is None else sorted({a % rank for a in axis})
        kept = [d for d in range(rank) if d not in axes]
        rows = np.transpose(x, kept + axes).reshape(
            [x.shape[d] for d in kept] + [math.prod(x.shape[d] for d in axes)])
        flat = rows.reshape(-1, rows.shape[-1])
        out = np.array([fn([float(v) for v in row]) for row in flat]).reshape(rows.shape[:-1])
        if keepdim:
            out = out.reshape([1 if d in axes else x.shape[d] for d in range(rank)])
        return {"out": out}
    return reference


REFERENCES = {"reduce_sum": loop_reduce(math.fsum),
              "reduce_mean": loop_reduce(lambda v: math.fsum(v) / len(v)),
              "reduce_max": loop_reduce(max)}
CASES = [((3, 4, 5), None, False), ((3, 4, 5), (1,), False), ((3, 4, 5), (0, 2), True),
         ((3, 4, 5), (-1,), False), ((2, 3), (0, 1), False), ((6,), (0,), True),
         ((2, 1, 3), (1,), False)]


@pytest.mark.parametrize("op_type", sorted(REFERENCES))
@pytest.mark.parametrize("shape, axis, keepdim", CASES)
def test_forward_and_grad(op_type, shape, axis, keepdim):
    x = rng.standard_normal(shape)
    helper_test_op(op_type, {"x": x}, {"axis": axis, "keepdim": keepdim}, REFERENCES[op_type],
                   grad_wrt=("x",))


@pytest.mark.parametrize("op_type", sorted(REFERENCES))
def test_float32_keeps_its_dtype_and_sums_in_float64(op_type):
    x = (rng.standard_normal((4, 1000)) + 1000).astype(np.float32)
    got = helper_test_op(op_type, {"x": x}, {"axis": (1,), "keepdim": False},
                         REFERENCES[op_type])
    assert got["out"].dtype == np.float32


def run(op_type, x, fetch_grad=True, **attrs):
    scope = mg.Scope()
    vx, out, d, dx = (scope.new_var(n) for n in ("x", "out", "dout", "dx"))
    vx.set(x)
    ops = [mg.Operator(op_type, x=vx, out=out, **attrs)]
    mg.Executor().run(ops, scope)
    d.set(np.ones_like(out.get()))
    extra = {"out": out} if op_type == "reduce_max" else {}
    mg.Executor().run([mg.Operator(op_type + "_grad", x=vx, dout=d, dx=dx, **extra, **attrs)],
                      scope)
    return out.get(), dx.get()


def test_reduce_max_ties_share_the_gradient_as_torch_amax():
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    out, dx = run("reduce_max", x, axis=(1,))
    np.testing.assert_array_equal(out, [3.0, 2.0])
    np.testing.assert_array_equal(dx, [[0, 0.5, 0.5, 0], [0.25] * 4])


def test_reduce_mean_of_nothing_is_nan_and_sum_is_zero():
    x = np.zeros((0, 3))
    assert np.isnan(run("reduce_mean", x, axis=(0,))[0]).all()
    np.testing.assert_array_equal(run("reduce_sum", x, axis=(0,))[0], [0, 0, 0])


def build(op_type, shape, **attrs):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare(shape, np.dtype("float32"))
    return mg.Operator(op_type, x=x, out=scope.new_var("out"), **attrs)


@pytest.mark.parametrize("attrs, message", [
    ({"axis": (2,)}, "reduce_sum: input 'x' of rank 2 has no axis 2"),
    ({"axis": (0, -2)}, "reduce_sum: input 'x' of rank 2: attribute 'axis' \\(0, -2\\) "
                        "names one axis twice"),
    ({"axis": ()}, "reduce_sum: attribute 'axis' must be None \\(every axis\\) or a "
                   "non-empty tuple of distinct ints"),
])
def test_bad_axes_name_the_attribute(attrs, message):
    with pytest.raises(mg.OpError, match=message):
        build("reduce_sum", (3, 4), **attrs)


def test_reduce_max_over_an_empty_axis_is_an_error():
    with pytest.raises(mg.OpError, match="reduce_max: input 'x' of shape \\(0, 4\\) has no "
                                         "values"):
        build("reduce_max", (0, 4), axis=(0,))


def test_shapes_are_inferred_at_build_time():
    assert build("reduce_mean", (-1, 4, 5), axis=(1,)).outputs["out"].shape == (-1, 5)
    assert build("reduce_sum", (2, 3), keepdim=True).outputs["out"].shape == (1, 1)
    assert build("reduce_max", (2, 3)).outputs["out"].shape == ()
