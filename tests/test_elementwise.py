"""elementwise_add (PaddlePaddle broadcasting) and sum."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def add_reference(x, y, axis=-1):
    start = x.ndim - y.ndim if axis == -1 else axis
    out = x.copy()
    for idx in np.ndindex(x.shape):
        out[idx] += y[idx[start:start + y.ndim]]
    return {"out": out}


@pytest.mark.parametrize("x_shape, y_shape, axis", [
    ((2, 3, 4, 5), (3,), 1),             # per-channel bias, NCHW
    ((4, 6), (6,), -1),                  # fc bias
    ((2, 3, 4), (3, 4), -1),
    ((2, 3, 4), (2, 3), 0),
    ((2, 3, 4), (3,), 1),
    ((3, 4), (3, 4), -1),
    ((3, 4), (), -1),
])
def test_add_forward_and_grads(x_shape, y_shape, axis):
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    helper_test_op("elementwise_add", {"x": x, "y": y}, {"axis": axis}, add_reference,
                   grad_wrt=("x", "y"))


def test_add_keeps_float32():
    x, y = rng.standard_normal((2, 3)).astype("float32"), rng.standard_normal(3).astype("float32")
    assert helper_test_op("elementwise_add", {"x": x, "y": y}, {}, add_reference)["out"].dtype \
        == np.float32


def build_add(x_shape, y_shape, axis=-1, y_dtype="float64"):
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.set(np.zeros(x_shape))
    y.set(np.zeros(y_shape, dtype=y_dtype))
    return mg.Operator("elementwise_add", x=x, y=y, out=scope.new_var("out"), axis=axis)


@pytest.mark.parametrize("x_shape, y_shape, axis, match", [
    ((2, 3), (4,), -1, r"elementwise_add: input 'y' must have shape \(3,\) .*got \(4,\)"),
    ((2, 3, 4, 5), (4,), 1, r"input 'y' must have shape \(3,\) \(dims 1\.\.1 of input 'x'"),
    ((2, 3), (3,), 2, r"input 'y' of rank 1 cannot start at axis=2 .* in \[0, 1\]"),
    ((3,), (2, 3), -1, r"input 'y' must not have more dims than input 'x'"),
])
def test_add_bad_shapes(x_shape, y_shape, axis, match):
    with pytest.raises(mg.OpError, match=match):
        build_add(x_shape, y_shape, axis)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 7, 4096, 9000])
def test_add_bias_gradient_is_the_float64_sum_rounded_once(dtype, rows):
    """dy over the leading axes is summed in float64 and rounded once: the bits a
    checkpoint of an earlier version resumes with (guarantees.md)."""
    from minigraph.kernels.cpu import elementwise

    d = rng.standard_normal((rows, 5)).astype(dtype) + 3.0     # sums far from 0
    op = mg.Operator("elementwise_add_grad", y=mg.Variable("y"), dout=mg.Variable("dout"),
                     dx=mg.Variable("dx"), dy=mg.Variable("dy"), axis=-1)
    x3 = d.reshape(1, rows, 5)
    out = elementwise.elementwise_add_grad_cpu(op, {"y": np.zeros(5, dtype), "dout": x3},
                                               None)
    assert out["dy"].dtype == dtype and out["dx"] is x3
    want = d.astype(np.float64).sum(axis=0).astype(dtype)
    np.testing.assert_allclose(out["dy"], want, rtol=1e-15 if dtype == np.float64 else 1e-7)


@pytest.mark.parametrize("native_on", ["1", "0"])
def test_add_bias_gradient_keeps_numpys_bits_natively_or_not(native_on, monkeypatch):
    """In float32 the native sum over rows (rows_native.py) gives np.add.reduce's bits;
    with MINIGRAPH_NATIVE=0 numpy sums."""
    from minigraph.kernels.cpu import elementwise, native, rows_native

    monkeypatch.setenv("MINIGRAPH_NATIVE", native_on)
    calls = []
    real = rows_native.sum_rows
    monkeypatch.setattr(rows_native, "sum_rows", lambda a: calls.append(a.shape) or real(a))
    d = (rng.standard_normal((16, 64, 129)) * 1e4).astype(np.float32)
    op = mg.Operator("elementwise_add_grad", y=mg.Variable("y"), dout=mg.Variable("dout"),
                     dx=mg.Variable("dx"), dy=mg.Variable("dy"), axis=-1)
    out = elementwise.elementwise_add_grad_cpu(op, {"y": np.zeros(129, np.float32), "dout": d},
                                               None)
    want = np.add.reduce(d.reshape(-1, 129), axis=0, dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(out["dy"].view(np.int32), want.view(np.int32))
    assert calls == [(1024, 129)]
    if native_on == "1" and native.library("rows_native") is not None:
        assert real(d.reshape(-1, 129)) is not None


def test_add_bad_dtype_and_axis():
    with pytest.raises(mg.OpError, match="input 'y' has dtype float32 but input 'x' has float64"):
        build_add((2, 3), (3,), y_dtype="float32")
    with pytest.raises(mg.OpError, match="attribute 'axis' must be -1"):
        build_add((2, 3), (3,), axis=-2)


def test_add_unknown_batch_dim_is_fine():
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare((-1, 3, 4, 4), "float32")
    y.declare((3,), "float32")
    mg.Operator("elementwise_add", x=x, y=y, out=scope.new_var("out"), axis=1)
    with pytest.raises(mg.OpError, match=r"input 'y' must have shape \(3,\)"):
        y2 = scope.new_var("y2")
        y2.declare((5,), "float32")
        mg.Operator("elementwise_add", x=x, y=y2, out=scope.new_var("out2"), axis=1)


def sum_reference(x):
    return {"out": np.sum(x, axis=0)}


def test_sum_forward_and_grads():
    xs = [rng.standard_normal((2, 3)) for _ in range(3)]
    helper_test_op("sum", {"x": xs}, {}, sum_reference, grad_wrt=("x",))


def test_sum_of_one():
    helper_test_op("sum", {"x": [rng.standard_normal(4)]}, {}, sum_reference, grad_wrt=("x",))


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)])
@pytest.mark.parametrize("count", [2, 4])
def test_sum_is_a_new_array_added_in_order(shape, count):
    """The kernel's output shares no memory with its inputs (0-d included) and adds
    them left to right, as float32 rounding shows."""
    from minigraph.kernels.cpu.elementwise import sum_cpu
    xs = [rng.standard_normal(shape).astype(np.float32) * 10.0 ** (3 * i) for i in range(count)]
    out = sum_cpu(None, {"x": xs}, None)["out"]
    want = xs[0].copy()
    for x in xs[1:]:
        want = (want + x).astype(np.float32)
    assert isinstance(out, np.ndarray) and out.shape == shape and out.dtype == np.float32
    assert not any(np.shares_memory(out, x) for x in xs)
    np.testing.assert_array_equal(out, want)


def test_sum_bad_shapes():
    scope = mg.Scope()
    a, b = scope.new_var("a"), scope.new_var("b")
    a.set(np.zeros((2, 3)))
    b.set(np.zeros((3, 2)))
    with pytest.raises(mg.OpError, match=r"sum: input 'x\[1\]' must have shape \(2, 3\)"):
        mg.Operator("sum", x=[a, b], out=scope.new_var("out"))
