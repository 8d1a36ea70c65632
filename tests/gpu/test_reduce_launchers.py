"""kernels/cuda/reduce.py against numpy, on the emulator and (marked gpu) a real GPU:
reduce sum / mean / max over any set of axes (the rows, cols and channel_sum paths,
keepdim, scalars, empty tensors), sums in double, NaN and tied maxima, the
gradients, and the launcher's checks; its plans (pure Python)."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng

from minigraph.kernels.cuda import reduce as red

CASES = [((3, 4, 5), None), ((3, 7, 2), (1,)), ((4, 3, 6), (0, -1)), ((5, 33), (-1,)),
         ((40, 3), (0,)), ((2, 3, 4, 5), (1, 3)), ((2, 3, 4, 5), (0, 2)), ((6,), (0,)),
         ((3, 1, 4), (1,)), ((1, 70, 1), (1,)), ((2, 3), (0, 1)), ((37, 2, 3), (0, 2)),
         ((70, 3, 5), (1, 2)), ((3, 600), (0,))]
NUMPY = {"sum": np.sum, "mean": np.mean}


def numpy_reduce(x, kind, axis, keepdim):
    axes = tuple(range(x.ndim)) if axis is None else tuple(a % x.ndim for a in axis)
    if kind == "max":
        return np.asarray(np.max(x, axis=axes, keepdims=keepdim))
    return np.asarray(NUMPY[kind](x, axis=axes, keepdims=keepdim, dtype=np.float64))


def test_plans_pick_the_layout_by_the_innermost_dim():
    p = red.plan((4, 3, 6), (0, 2))
    assert p.layout == "rows" and p.count == 24 and p.kn == (3,) and p.rn == (4, 6)
    assert p.keep == (1, 3, 1) and p.view == (4, 3, 6)
    p = red.plan((2, 3, 4, 5), (0, 2))
    assert p.layout == "cols" and p.kn == (3, 5) and p.rn == (2, 4) and p.view is None
    p = red.plan((2, 3, 4, 5), (2, 3))
    assert p.layout == "rows" and p.kn == (6,) and p.rn == (20,) and p.view == (1, 6, 20)
    assert red.plan((3, 1, 4), (1,)).layout == "copy"
    assert red.plan((), ()).layout == "copy"
    assert red.normalize_axes(3, (-1, 0)) == (0, 2) and red.normalize_axes(2, None) == (0, 1)
    with pytest.raises(ValueError, match="no axis 3"):
        red.normalize_axes(3, (3,))
    with pytest.raises(ValueError, match="named twice"):
        red.normalize_axes(3, (1, -2))


@pytest.mark.parametrize("shape,axis", CASES, ids=str)
@pytest.mark.parametrize("keepdim", [False, True], ids=["drop", "keep"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reductions_and_grads_match_numpy(device, force_splits, shape, axis, keepdim, dtype):
    r = rng(1)
    x = r.normal(size=shape).astype(dtype)
    xd = device.put(x)
    for kind in ("sum", "mean", "max"):
        got = device.get(red.reduce(xd, kind, axis, keepdim))
        want = numpy_reduce(x, kind, axis, keepdim)
        assert got.shape == want.shape and got.dtype == dtype, kind
        assert rel_err(got, want) < TOL[dtype], kind
    axes = red.normalize_axes(len(shape), axis)
    count = int(np.prod([shape[a] for a in axes]))
    d = r.normal(size=numpy_reduce(x, "sum", axis, keepdim).shape).astype(dtype)
    dk = d.reshape(red.plan(shape, axes).keep).astype(np.float64)
    got = device.get(red.reduce_grad(shape, device.put(d), "sum", axis, keepdim))
    np.testing.assert_array_equal(got, np.broadcast_to(dk, shape).astype(dtype))
    got = device.get(red.reduce_grad(shape, device.put(d), "mean", axis, keepdim))
    np.testing.assert_array_equal(got, np.broadcast_to(dk / count, shape).astype(dtype))
    out = red.reduce(xd, "max", axis, keepdim)
    got = device.get(red.reduce_max_grad(xd, out, device.put(d), axis, keepdim))
    hit = x == device.get(out).reshape(dk.shape)
    np.testing.assert_array_equal(got, (hit * dk).astype(dtype))


@pytest.mark.parametrize("axis", [(0,), (1,), None], ids=str)
def test_ties_share_the_gradient_and_nan_wins_the_maximum(device, axis):
    x = np.array([[1.0, 3.0, 3.0, -2.0], [np.nan, 0.0, 5.0, 0.0], [3.0, 3.0, 3.0, 5.0]])
    d = np.asarray(np.ones(numpy_reduce(x, "max", axis, False).shape) * 6.0)
    out = red.reduce(device.put(x), "max", axis)
    np.testing.assert_array_equal(device.get(out), numpy_reduce(x, "max", axis, False))
    got = device.get(red.reduce_max_grad(device.put(x), out, device.put(d), axis))
    best = numpy_reduce(x, "max", axis, True)
    hit = x == best
    ties = hit.sum(axis=red.normalize_axes(2, axis), keepdims=True)
    np.testing.assert_array_equal(got, hit * (6.0 / np.maximum(ties, 1)))
    if axis == (0,):
        np.testing.assert_array_equal(got[:, 0], [0, 0, 0])      # the NaN column: no hit
        np.testing.assert_array_equal(got[:, 1], [3, 0, 3])


def test_sums_are_accumulated_in_double(device):
    x = np.full((3, 100001), 0.1, np.float32)
    x[:, 0] = 1e6
    want = x.astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(device.get(red.reduce(device.put(x), "sum", (1,))), want,
                               rtol=1e-7)
    xt = np.ascontiguousarray(np.broadcast_to(x[:, :, None], (3, 100001, 2)))
    got = device.get(red.reduce(device.put(xt), "sum", (0, 1)))   # the rows kernel
    np.testing.assert_allclose(got, [want.sum()] * 2, rtol=1e-7)


def test_scalars_empties_and_checks(device):
    s = device.put(np.array(2.5))
    for kind in ("sum", "mean", "max"):
        got = device.get(red.reduce(s, kind))
        assert got.shape == () and got == 2.5
    assert device.get(red.reduce_grad((), device.put(np.array(4.0)), "mean")) == 4.0
    empty = device.put(np.zeros((0, 3), np.float32))
    np.testing.assert_array_equal(device.get(red.reduce(empty, "sum", (0,))), np.zeros(3))
    assert np.isnan(device.get(red.reduce(empty, "mean", (0,)))).all()
    assert device.get(red.reduce(empty, "max", (1,))).shape == (0,)
    with pytest.raises(ValueError, match="no values along the reduced axes"):
        red.reduce(empty, "max", (0,))
    with pytest.raises(ValueError, match="kind must be"):
        red.reduce(s, "min")
    x = device.put(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"reduce_sum: out must be float64 of shape \(2,\)"):
        red.reduce(x, "sum", (1,), out=device.put(np.ones(3)))
    with pytest.raises(ValueError, match=r"reduce_mean_grad: dout must be float64 of shape"):
        red.reduce_grad((2, 3), device.put(np.ones(3)), "mean", (1,))
