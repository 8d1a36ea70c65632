"""The elementwise family's launchers against numpy, on the emulator and (marked gpu)
a real GPU: kernels/cuda/strided.py's shape merging (pure Python), kernels/cuda/broadcast.py
(add/subtract/multiply/divide with numpy broadcasting both ways, their gradients, sums
down to any shape accumulated in double), kernels/cuda/elementwise.py (add along an
axis, its grad, the sum of n tensors) and kernels/cuda/mean.py."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng
from references import unbroadcast

from minigraph.kernels.cuda import broadcast, strided

BROADCASTS = [((4, 3, 5), (3, 1)), ((2, 1, 4), (3, 1)), ((7,), (7,)), ((6, 5), (5,)),
              ((5, 1, 3, 1, 2), (4, 3, 6, 2)), ((3,), ()), ((2, 3), (1, 1)), ((1, 9), (4, 1)),
              ((2, 3, 4), (2, 1, 4)), ((8, 1), (8, 33)), ((1, 1, 37), (2, 3, 37))]


# ---- strided shapes (pure Python) --------------------------------------------------------


def test_collapse_merges_what_every_operand_steps_across():
    shape = (4, 3, 5)
    dims, (xs, ys) = strided.collapse(shape, strided.broadcast_strides(shape, shape),
                                      strided.broadcast_strides(shape, (3, 1)))
    assert dims == (4, 3, 5) and xs == (15, 5, 1) and ys == (0, 1, 0)
    dims, (xs, ys) = strided.collapse((2, 3, 4, 5), (60, 20, 5, 1), (0, 0, 5, 1))
    assert dims == (6, 20) and xs == (20, 1) and ys == (0, 1)
    assert strided.collapse((1, 1), (1, 1))[0] == ()
    assert strided.channel_view_of((6, 20), (0, 1)) == (6, 20, 1)
    assert strided.channel_view_of((2, 3, 4), (1, 0, 1)) is None
    assert strided.broadcast_shape("add", (2, 1, 4), (3, 1)) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(4,\) do not broadcast"):
        strided.broadcast_shape("add", (2, 3), (4,))
    with pytest.raises(ValueError, match="7 dims after merging contiguous ones"):
        strided.padded("transpose", (2,) * 7, (1,) * 7)


# ---- add, multiply and their gradients ---------------------------------------------------


@pytest.mark.parametrize("x_shape,y_shape", BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_broadcast_add_multiply_and_grads(device, force_splits, x_shape, y_shape, dtype):
    r = rng(3)
    x, y = r.normal(size=x_shape).astype(dtype), r.normal(size=y_shape).astype(dtype)
    dx_, dy_ = device.put(x), device.put(y)
    np.testing.assert_array_equal(device.get(broadcast.add(dx_, dy_)), x + y)
    np.testing.assert_array_equal(device.get(broadcast.add(dy_, dx_)), y + x)
    np.testing.assert_array_equal(device.get(broadcast.multiply(dx_, dy_)), x * y)
    d = r.normal(size=np.broadcast_shapes(x_shape, y_shape)).astype(dtype)
    gx, gy = broadcast.add_grad(x_shape, y_shape, device.put(d))
    assert rel_err(device.get(gx), unbroadcast(d.astype(np.float64), x_shape)) < TOL[dtype]
    assert rel_err(device.get(gy), unbroadcast(d.astype(np.float64), y_shape)) < TOL[dtype]
    mx, my = broadcast.multiply_grad(dx_, dy_, device.put(d))
    assert device.get(mx).shape == x_shape and device.get(my).shape == y_shape
    assert rel_err(device.get(mx), unbroadcast((d * y).astype(np.float64), x_shape)) < TOL[dtype]
    assert rel_err(device.get(my), unbroadcast((d * x).astype(np.float64), y_shape)) < TOL[dtype]
    only_dy = broadcast.multiply_grad(dx_, dy_, device.put(d), need_dx=False)
    assert only_dy[0] is None and only_dy[1] is not None


@pytest.mark.parametrize("x_shape,y_shape", BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_broadcast_subtract_divide_and_grads(device, force_splits, x_shape, y_shape, dtype):
    r = rng(5)
    x = r.normal(size=x_shape).astype(dtype)
    y = r.uniform(0.5, 2.0, size=y_shape).astype(dtype) * np.where(r.random(y_shape) < 0.5, -1, 1)
    y = y.astype(dtype)
    dx_, dy_ = device.put(x), device.put(y)
    np.testing.assert_array_equal(device.get(broadcast.subtract(dx_, dy_)), x - y)
    np.testing.assert_array_equal(device.get(broadcast.subtract(dy_, dx_)), y - x)
    np.testing.assert_array_equal(device.get(broadcast.divide(dx_, dy_)), x / y)
    d = r.normal(size=np.broadcast_shapes(x_shape, y_shape)).astype(dtype)
    d64, x64, y64 = (a.astype(np.float64) for a in (d, x, y))
    sx, sy = broadcast.subtract_grad(x_shape, y_shape, device.put(d))
    assert device.get(sx).shape == x_shape and device.get(sy).shape == y_shape
    assert rel_err(device.get(sx), unbroadcast(d64, x_shape)) < TOL[dtype]
    assert rel_err(device.get(sy), -unbroadcast(d64, y_shape)) < TOL[dtype]
    qx, qy = broadcast.divide_grad(dx_, dy_, device.put(d))
    assert device.get(qx).shape == x_shape and device.get(qy).shape == y_shape
    assert rel_err(device.get(qx), unbroadcast(d64 / y64, x_shape)) < TOL[dtype]
    assert rel_err(device.get(qy), unbroadcast(-d64 * x64 / y64 ** 2, y_shape)) < TOL[dtype]
    assert broadcast.divide_grad(dx_, dy_, device.put(d), need_dy=False)[1] is None
    assert broadcast.subtract_grad(x_shape, y_shape, device.put(d), need_dx=False)[0] is None


def test_subtract_and_divide_ops_match_the_cpu(device_place):
    """Through the Executor (ops/binary.py declares no examples for them yet)."""
    from op_harness import assert_close, r, run_op

    import minigraph as mg

    cases = [({"x": r(4, 1, 5), "y": r(3, 1, seed=1)}, "both-ways"),
             ({"x": r(2, 3, 4, dtype=np.float64), "y": r(3, 1, dtype=np.float64, seed=2)},
              "bias"),
             ({"x": r(3, 7), "y": r(3, 7, seed=3)}, "same"),
             ({"x": r(5, dtype=np.float64), "y": np.array(1.5)}, "scalar")]
    for op_type in ("subtract", "divide"):
        for inputs, name in cases:
            grads = (("x", "y"), ("x",), ("y",))
            want, want_g = run_op(mg.CPUPlace(), op_type, inputs, {}, grads)
            got, got_g = run_op(device_place, op_type, inputs, {}, grads)
            assert_close(got["out"], want["out"], f"{op_type}-{name}: out")
            for wanted in grads:
                assert set(got_g[wanted]) == set(want_g[wanted])
                for v in want_g[wanted]:
                    assert_close(got_g[wanted][v], want_g[wanted][v], f"{op_type}-{name}: d{v}")


@pytest.mark.parametrize("d_shape,shape", [((5, 7, 3), (5, 1, 3)), ((4, 6), (1, 1)),
                                           ((3, 4, 5, 6), (3, 1, 5, 1)), ((2, 3), (2, 3)),
                                           ((9, 300), (9, 1)), ((300, 9), (9,)),
                                           ((0, 4), (1, 4)), ((3, 1), (1, 1))], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_reduce_to_any_pattern(device, force_splits, d_shape, shape, offset):
    d = rng(4).normal(size=d_shape)
    got = device.get(broadcast.reduce_to(device.put(d, offset), shape))
    assert got.shape == shape
    assert rel_err(got, unbroadcast(d, shape)) < 1e-12


def test_float32_sums_are_accumulated_in_double(device):
    d = np.full((3, 100001), 0.1, np.float32)
    d[:, 0] = 1e6
    got = device.get(broadcast.reduce_to(device.put(d), (3, 1)))
    np.testing.assert_allclose(got, d.astype(np.float64).sum(axis=1, keepdims=True), rtol=1e-7)
    got = device.get(broadcast.reduce_to(device.put(d.reshape(3, 1, 100001)), (3, 1, 1)))
    assert got.shape == (3, 1, 1)


def test_broadcast_errors(device):
    x32 = device.put(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(2,\) do not broadcast"):
        broadcast.add(x32, device.put(np.ones(2, np.float32)))
    with pytest.raises(ValueError, match="multiply: x and y must have one dtype"):
        broadcast.multiply(x32, device.put(np.ones(3, np.float64)))
    with pytest.raises(ValueError, match=r"shape \(4,\) does not broadcast to \(2, 3\)"):
        broadcast.reduce_to(x32, (4,))


# ---- elementwise add along an axis, sum, mean ----------------------------------------------


@pytest.mark.parametrize("x_shape,y_shape,axis", [((4, 3, 5, 6), (3,), 1), ((7, 9), (9,), -1),
                                                  ((2, 3, 4), (2, 3, 4), -1),
                                                  ((2, 3, 4, 5), (3, 4), 1),
                                                  ((6, 5), (6,), 0), ((33, 8), (), -1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_add_and_grad(device, force_splits, x_shape, y_shape, axis, dtype):
    from minigraph.kernels.cuda import elementwise

    r = rng(2)
    x, y = r.normal(size=x_shape).astype(dtype), r.normal(size=y_shape).astype(dtype)
    start = len(x_shape) - len(y_shape) if axis == -1 else axis
    yb = y.reshape(y_shape + (1,) * (len(x_shape) - start - len(y_shape)))
    out = elementwise.add(device.put(x), device.put(y), axis)
    np.testing.assert_allclose(device.get(out), x + yb, rtol=TOL[dtype])
    d = r.normal(size=x_shape).astype(dtype)
    dx, dy = elementwise.add_grad(device.put(d), y_shape, axis)
    np.testing.assert_array_equal(device.get(dx), d)
    axes = tuple(range(start)) + tuple(range(start + len(y_shape), len(x_shape)))
    assert rel_err(device.get(dy), d.astype(np.float64).sum(axes).reshape(y_shape)) < TOL[dtype]


@pytest.mark.parametrize("count", [1, 3, 11])
def test_sum_of_n_tensors(device, count):
    from minigraph.kernels.cuda import elementwise

    xs = [rng(i).normal(size=(5, 13)).astype(np.float32) for i in range(count)]
    out = elementwise.sum_n([device.put(x) for x in xs])
    np.testing.assert_allclose(device.get(out), np.sum(xs, axis=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_and_grad(device, dtype):
    from minigraph.kernels.cuda import mean

    x = (1e3 + rng(6).normal(size=(37, 211))).astype(dtype)
    out = mean.mean(device.put(x))
    assert abs(float(device.get(out)) - x.astype(np.float64).mean()) < 1e-3 * (
        dtype == np.float32 or 1e-9)
    dx = mean.mean_grad((3, 5), device.put(np.array(6.0, dtype)))
    np.testing.assert_allclose(device.get(dx), np.full((3, 5), 6.0 / 15), rtol=TOL[dtype])
