"""softmax along an axis (float64 inside), and its grad."""
import warnings

import numpy as np
import pytest
from helpers import helper_test_op
from references import softmax

import minigraph as mg

rng = np.random.default_rng(6)


def softmax_reference(x, axis=-1):
    """references.softmax, called as helper_test_op calls a reference."""
    return {"out": softmax(x, axis)}


@pytest.mark.parametrize("shape, axis", [((3, 5), -1), ((3, 5), 0), ((3, 5), 1),
                                         ((2, 3, 4), 1), ((2, 3, 4), -3), ((7,), 0),
                                         ((4, 1), -1)])
def test_softmax_forward_and_grad(shape, axis):
    helper_test_op("softmax", {"x": rng.standard_normal(shape) * 3}, {"axis": axis},
                   softmax_reference, grad_wrt=("x",))


def test_softmax_default_axis_float32_float16():
    for dtype in ("float32", "float16"):
        x = rng.standard_normal((4, 6)).astype(dtype)
        got = helper_test_op("softmax", {"x": x}, {}, softmax_reference)
        assert got["out"].dtype == dtype


def test_softmax_huge_logits():
    x = np.array([[1e308, 1e308, -1e308], [1000.0, 0.0, -1000.0], [-1e4, -1e4 + 1, -1e4]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = helper_test_op("softmax", {"x": x}, {"axis": 1})
    np.testing.assert_allclose(got["out"], softmax_reference(x, 1)["out"], rtol=1e-15, atol=0)
    assert got["out"][0].tolist() == [0.5, 0.5, 0.0]
    np.testing.assert_allclose(got["out"].sum(axis=1), 1.0)
    x32 = np.array([[3e38, 0.0], [88.0, 89.0]], dtype="float32")
    got32 = helper_test_op("softmax", {"x": x32}, {}, softmax_reference)
    assert np.isfinite(got32["out"]).all()


def test_softmax_grad_by_formula():
    out = softmax_reference(rng.standard_normal((3, 4)), axis=0)["out"]
    d = rng.standard_normal((3, 4))
    scope = mg.Scope()
    o, dv, dx = scope.new_var("out"), scope.new_var("dout"), scope.new_var("dx")
    o.set(out)
    dv.set(d)
    mg.Executor().run([mg.Operator("softmax_grad", out=o, dout=dv, dx=dx, axis=0)], scope)
    want = np.empty_like(out)
    for j in range(4):
        jac = np.diag(out[:, j]) - np.outer(out[:, j], out[:, j])
        want[:, j] = jac @ d[:, j]
    np.testing.assert_allclose(dx.get(), want, rtol=1e-12, atol=1e-15)


def declared(shape, dtype="float32"):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare(shape, np.dtype(dtype))
    return scope, x


def test_unknown_dims_flow_through():
    scope, x = declared((-1, 10))
    out = scope.new_var("out")
    mg.Operator("softmax", x=x, out=out)
    assert out.shape == (-1, 10)


@pytest.mark.parametrize("shape, dtype, axis, match", [
    ((3, 4), "float32", 2, r"softmax: attribute 'axis' must be in \[-2, 2\) for input 'x' of "
                           r"rank 2, got 2"),
    ((3, 4), "float32", -3, r"softmax: attribute 'axis' must be in \[-2, 2\)"),
    ((), "float32", -1, r"softmax: input 'x' must have rank >= 1"),
    ((3, 4), "int64", -1, r"softmax: input 'x' must be a float tensor"),
])
def test_bad_inputs(shape, dtype, axis, match):
    scope, x = declared(shape, dtype)
    with pytest.raises(mg.OpError, match=match):
        mg.Operator("softmax", x=x, out=scope.new_var("out"), axis=axis)


def test_grad_checks_dout_shape():
    scope = mg.Scope()
    o, d = scope.new_var("out"), scope.new_var("dout")
    o.declare((2, 3), np.dtype("float64"))
    d.declare((3, 2), np.dtype("float64"))
    with pytest.raises(mg.OpError, match=r"softmax_grad: input 'dout' must have shape \(2, 3\)"):
        mg.Operator("softmax_grad", out=o, dout=d, dx=scope.new_var("dx"))
