"""kernels/cuda/norm.py against float64 numpy references, on the emulator and (marked gpu)
a real GPU: layer_norm and group_norm (instance_norm: groups = C), forward and grads,
float32 and float64, with and without scale and bias; odd row lengths (1, 7, 33,
1000+), a batch of one, rows split over several blocks, offset data (mean 1e4, std
1), unaligned data, unbound outputs not computed, deterministic grads, empty arrays
and bad arguments."""
from __future__ import annotations

import math

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng

EPS = 1e-5
# dx cancels (g - mean(g) - xhat mean(g xhat)): float32 loses a few digits more
GRAD_TOL = {np.float32: 2e-5, np.float64: 1e-11}


def ln_reference(x, scale, bias, begin, eps=EPS):
    """(y, mean, variance) of layer_norm in float64."""
    rows = math.prod(x.shape[:begin])
    x2 = x.astype(np.float64).reshape(rows, -1)
    mean = x2.mean(axis=1)
    var = ((x2 - mean[:, None]) ** 2).mean(axis=1)
    y = (x2 - mean[:, None]) / np.sqrt(var[:, None] + eps)
    y = y * (1.0 if scale is None else scale.astype(np.float64))
    y = y + (0.0 if bias is None else bias.astype(np.float64))
    return y.reshape(x.shape), mean.reshape(x.shape[:begin]), var.reshape(x.shape[:begin])


def ln_grad_reference(x, scale, mean, var, dy, begin, eps=EPS):
    """(dx, dscale, dbias) of layer_norm in float64 from the given statistics."""
    rows = math.prod(x.shape[:begin])
    x2, dy2 = x.astype(np.float64).reshape(rows, -1), dy.astype(np.float64).reshape(rows, -1)
    mean = mean.astype(np.float64).reshape(rows, 1)
    inv = 1.0 / np.sqrt(var.astype(np.float64).reshape(rows, 1) + eps)
    xhat = (x2 - mean) * inv
    g = dy2 * (1.0 if scale is None else scale.astype(np.float64))
    dx = inv * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    return dx.reshape(x.shape), (dy2 * xhat).sum(axis=0), dy2.sum(axis=0)


def gn_reference(x, scale, bias, groups, eps=EPS):
    """(y, mean, variance) of group_norm in float64."""
    n, c = x.shape[:2]
    xg = x.astype(np.float64).reshape(n, groups, -1)
    mean = xg.mean(axis=2)
    var = ((xg - mean[..., None]) ** 2).mean(axis=2)
    y = ((xg - mean[..., None]) / np.sqrt(var[..., None] + eps)).reshape(n, c, -1)
    if scale is not None:
        y = y * scale.astype(np.float64)[None, :, None]
    if bias is not None:
        y = y + bias.astype(np.float64)[None, :, None]
    return y.reshape(x.shape), mean, var


def gn_grad_reference(x, scale, mean, var, dy, groups, eps=EPS):
    """(dx, dscale, dbias) of group_norm in float64 from the given statistics."""
    n, c = x.shape[:2]
    x3, dy3 = x.astype(np.float64).reshape(n, c, -1), dy.astype(np.float64).reshape(n, c, -1)
    per_channel = np.repeat(np.arange(groups), c // groups)
    mean_c = mean.astype(np.float64)[:, per_channel, None]
    inv_c = 1.0 / np.sqrt(var.astype(np.float64)[:, per_channel, None] + eps)
    xhat = (x3 - mean_c) * inv_c
    g = dy3 * (1.0 if scale is None else scale.astype(np.float64)[None, :, None])

    def group_mean(a):
        m = a.reshape(n, groups, -1).mean(axis=2)
        return m[:, per_channel, None]

    dx = inv_c * (g - group_mean(g) - xhat * group_mean(g * xhat))
    return dx.reshape(x.shape), (dy3 * xhat).sum(axis=(0, 2)), dy3.sum(axis=(0, 2))


def affine(size, dtype, which, seed=1):
    r = rng(seed)
    scale = r.uniform(0.5, 1.5, size).astype(dtype) if which in ("both", "scale") else None
    bias = r.normal(0, 1, size).astype(dtype) if which in ("both", "bias") else None
    return scale, bias


def put(device, a, offset=0):
    return None if a is None else device.put(a, offset)


def check_all(device, got, want, tols):
    for g, w, tol in zip(got, want, tols, strict=True):
        assert g is not None
        assert rel_err(device.get(g), w) < tol


def run_layer_norm(device, shape, begin, dtype, which, offset=0, data=None):
    """Forward and grad of layer_norm against the references; returns the grads."""
    from minigraph.kernels.cuda import norm

    r = rng(3)
    x = data if data is not None else r.normal(0.5, 2.0, shape).astype(dtype)
    length = math.prod(shape[begin:])
    scale, bias = affine(length, dtype, which)
    y, mean, var = norm.layer_norm(put(device, x, offset), put(device, scale, offset),
                                   put(device, bias, offset), begin, EPS)
    want = ln_reference(x, scale, bias, begin)
    assert device.get(mean).shape == shape[:begin] and device.get(mean).dtype == dtype
    check_all(device, (y, mean, var), want, (TOL[dtype],) * 3)
    dy = r.normal(0, 1, shape).astype(dtype)
    m, v = device.get(mean), device.get(var)
    grads = norm.layer_norm_grad(put(device, x, offset), put(device, scale, offset), mean, var,
                                 put(device, dy, offset), begin, EPS)
    # rows of one value: dx is 0, up to rounding times invstd = eps ** -0.5 (absolute)
    check_all(device, grads, ln_grad_reference(x, scale, m, v, dy, begin),
              (GRAD_TOL[dtype] if length > 1 else 1e-3, TOL[dtype], TOL[dtype]))
    return [device.get(g) for g in grads]


def run_group_norm(device, shape, groups, dtype, which, offset=0, data=None):
    from minigraph.kernels.cuda import norm

    r = rng(4)
    x = data if data is not None else r.normal(-1.0, 3.0, shape).astype(dtype)
    scale, bias = affine(shape[1], dtype, which)
    y, mean, var = norm.group_norm(put(device, x, offset), put(device, scale, offset),
                                   put(device, bias, offset), groups, EPS)
    assert device.get(mean).shape == (shape[0], groups)
    check_all(device, (y, mean, var), gn_reference(x, scale, bias, groups), (TOL[dtype],) * 3)
    dy = r.normal(0, 1, shape).astype(dtype)
    m, v = device.get(mean), device.get(var)
    grads = norm.group_norm_grad(put(device, x, offset), put(device, scale, offset), mean, var,
                                 put(device, dy, offset), groups, EPS)
    check_all(device, grads, gn_grad_reference(x, scale, m, v, dy, groups),
              (GRAD_TOL[dtype], TOL[dtype], TOL[dtype]))
    return [device.get(g) for g in grads]


LN_CASES = [((6, 33), 1), ((5, 1), 1), ((4, 7), 1), ((1, 1031), 1), ((3, 2000), 1),
            ((2, 3, 4, 5), 2), ((2, 3, 4, 5), 3), ((37, 8), 1), ((3, 1, 12), 1)]


@pytest.mark.parametrize("shape,begin", LN_CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_forward_and_grads(device, shape, begin, dtype):
    run_layer_norm(device, shape, begin, dtype, "both")


@pytest.mark.parametrize("which", ["none", "scale", "bias"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_without_scale_or_bias(device, which, dtype):
    run_layer_norm(device, (5, 12), 1, dtype, which)


@pytest.mark.parametrize("shape,begin", [((3, 2100), 1), ((2, 4099), 1), ((300, 8), 1),
                                         ((2000, 5), 1), ((2, 3, 700), 1)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_layer_norm_rows_and_columns_split_over_blocks(device, force_splits, shape, begin, dtype,
                                                       offset):
    run_layer_norm(device, shape, begin, dtype, "both", offset)


GN_CASES = [((3, 6, 5, 4), 2), ((2, 4, 9), 1), ((2, 4, 3, 3), 4), ((1, 8, 7), 4),
            ((2, 6), 2), ((2, 3, 33), 3), ((1, 2, 1031), 1), ((2, 4, 2, 2, 3), 2)]


@pytest.mark.parametrize("shape,groups", GN_CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_group_norm_forward_and_grads(device, shape, groups, dtype):
    run_group_norm(device, shape, groups, dtype, "both")


@pytest.mark.parametrize("which", ["none", "scale", "bias"])
def test_group_norm_without_scale_or_bias(device, which):
    run_group_norm(device, (2, 6, 4, 3), 3, np.float32, which)


@pytest.mark.parametrize("shape,groups", [((2, 4, 1100), 2), ((1, 3, 2048), 3), ((1, 2, 4100), 1),
                                          ((3, 8, 16), 8)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_group_norm_rows_split_over_blocks(device, force_splits, shape, groups, dtype, offset):
    run_group_norm(device, shape, groups, dtype, "both", offset)


@pytest.mark.parametrize("op,shape,arg", [("layer_norm", (4, 1000), 1),
                                          ("layer_norm", (2, 8195), 1),
                                          ("group_norm", (2, 6, 17, 13), 3),
                                          ("group_norm", (3, 4, 50), 4)], ids=str)
def test_offset_data_keeps_its_variance(device, force_splits, op, shape, arg):
    """|mean| / std = 1e4 in float32: the variance to float32 rounding (well inside the
    1e-3 relative that E[x^2] - E[x]^2 would miss by far), y to 1e-5 absolute (the
    rounding of the mean to float32, 5e-4 here, is folded back in)."""
    from minigraph.kernels.cuda import norm

    x = (1e4 + rng(5).standard_normal(shape)).astype(np.float32)
    if op == "layer_norm":
        y, mean, var = norm.layer_norm(device.put(x), None, None, arg)
        want = ln_reference(x, None, None, arg)
    else:
        y, mean, var = norm.group_norm(device.put(x), None, None, arg)
        want = gn_reference(x, None, None, arg)
    assert np.max(np.abs(device.get(var) / want[2] - 1)) < 1e-6
    assert np.max(np.abs(device.get(mean) / want[1] - 1)) < 1e-6
    assert np.max(np.abs(device.get(y) - want[0])) < 1e-5
    dy = rng(6).standard_normal(shape).astype(np.float32)
    if op == "layer_norm":
        got = norm.layer_norm_grad(device.put(x), None, mean, var, device.put(dy), arg)
        ref = ln_grad_reference(x, None, device.get(mean), device.get(var), dy, arg)
    else:
        got = norm.group_norm_grad(device.put(x), None, mean, var, device.put(dy), arg)
        ref = gn_grad_reference(x, None, device.get(mean), device.get(var), dy, arg)
    for g, w in zip(got, ref, strict=True):
        assert rel_err(device.get(g), w) < 1e-5


def test_few_very_long_rows(device):
    """layer_norm on (2, 1 << 20): each row split over many blocks."""
    run_layer_norm(device, (2, 1 << 20), 1, np.float32, "both")


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False),
                                  (False, False, True), (False, True, True),
                                  (True, True, False), (False, False, False)], ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
def test_unbound_grad_outputs_are_not_computed(device, op, need):
    from minigraph.kernels.cuda import norm

    shape = (3, 4, 10)
    r = rng(8)
    x, dy = r.normal(size=shape).astype(np.float64), r.normal(size=shape).astype(np.float64)
    size, arg = (40, 1) if op == "layer_norm" else (4, 2)
    scale = r.uniform(0.5, 1.5, size)
    fwd, grad = getattr(norm, op), getattr(norm, op + "_grad")
    ref_grad = ln_grad_reference if op == "layer_norm" else gn_grad_reference
    _, mean, var = fwd(device.put(x), device.put(scale), None, arg)
    got = grad(device.put(x), device.put(scale), mean, var, device.put(dy), arg,
               need_dx=need[0], need_dscale=need[1], need_dbias=need[2])
    want = ref_grad(x, scale, device.get(mean), device.get(var), dy, arg)
    for wanted, g, w in zip(need, got, want, strict=True):
        if wanted:
            assert rel_err(device.get(g), w) < 1e-11
        else:
            assert g is None


def test_grads_are_deterministic(device, force_splits):
    """Blocks run in a different order each launch (on the emulator): the sums do not
    depend on it."""
    first = run_layer_norm(device, (2, 4099), 1, np.float32, "both")
    again = run_layer_norm(device, (2, 4099), 1, np.float32, "both")
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    first = run_group_norm(device, (1, 2, 4100), 1, np.float32, "both")
    again = run_group_norm(device, (1, 2, 4100), 1, np.float32, "both")
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_empty_arrays(device):
    from minigraph.kernels.cuda import norm

    y, mean, var = norm.layer_norm(device.put(np.zeros((0, 5), np.float32)))
    assert device.get(y).shape == (0, 5) and device.get(mean).shape == (0,)
    x = device.put(np.zeros((0, 4, 3), np.float32))
    y, mean, var = norm.group_norm(x, None, None, 2)
    assert device.get(mean).shape == (0, 2)
    dx, dscale, dbias = norm.group_norm_grad(x, device.put(np.ones(4, np.float32)), mean, var, x,
                                             2)
    assert device.get(dx).shape == (0, 4, 3)
    np.testing.assert_array_equal(device.get(dscale), 0)
    np.testing.assert_array_equal(device.get(dbias), 0)


def test_bad_arguments(device):
    from minigraph.kernels.cuda import norm

    x = device.put(np.ones((2, 6, 3), np.float32))
    with pytest.raises(ValueError, match=r"begin_norm_axis 3 must be in \[1, 3\)"):
        norm.layer_norm(x, None, None, 3)
    with pytest.raises(ValueError, match=r"layer_norm: scale must be float32 of shape \(18,\)"):
        norm.layer_norm(x, device.put(np.ones(6, np.float32)))
    with pytest.raises(ValueError, match="groups 4 must divide the 6 channels"):
        norm.group_norm(x, None, None, 4)
    with pytest.raises(ValueError, match=r"group_norm: bias must be float32 of shape \(6,\)"):
        norm.group_norm(x, None, device.put(np.ones(6, np.float64)), 2)
    _, mean, var = norm.group_norm(x, None, None, 2)
    with pytest.raises(ValueError, match=r"group_norm_grad: dy must be float32 of shape"):
        norm.group_norm_grad(x, None, mean, var, device.put(np.ones((2, 6), np.float32)), 2)
    with pytest.raises(ValueError, match=r"group_norm_grad: mean must be float32 of shape \(2, 3\)"):
        norm.group_norm_grad(x, None, var, mean, x, 3)


# ---- channels last (norm_nhwc.py) ----------------------------------------------------------

def to_nchw(a):
    return np.ascontiguousarray(np.moveaxis(a, -1, 1))


def run_group_norm_nhwc(device, shape, groups, dtype, which, offset=0.0):
    """group_norm_nhwc and its grad against the NCHW references of the transposed data."""
    from minigraph.kernels.cuda import norm_nhwc

    r = rng(9)
    x = (r.normal(offset, 2.0, shape)).astype(dtype)
    scale, bias = affine(shape[-1], dtype, which)
    y, mean, var = norm_nhwc.group_norm_nhwc(device.put(x), put(device, scale),
                                             put(device, bias), groups, EPS)
    want = gn_reference(to_nchw(x), scale, bias, groups)
    check_all(device, (y, mean, var), (np.moveaxis(want[0], 1, -1), want[1], want[2]),
              (TOL[dtype] * (10 if offset else 1),) * 3)
    dy = r.normal(0, 1, shape).astype(dtype)
    m, v = device.get(mean), device.get(var)
    grads = norm_nhwc.group_norm_nhwc_grad(device.put(x), put(device, scale), mean, var,
                                           device.put(dy), groups, EPS)
    ref = gn_grad_reference(to_nchw(x), scale, m, v, to_nchw(dy), groups)
    check_all(device, grads, (np.moveaxis(ref[0], 1, -1), ref[1], ref[2]),
              (GRAD_TOL[dtype] * (100 if offset else 1), TOL[dtype] * (10 if offset else 1),
               TOL[dtype]))
    return [device.get(g) for g in grads]


NHWC_CASES = [((3, 5, 4, 6), 2), ((2, 9, 4), 4), ((2, 3, 3, 70), 7), ((1, 40, 8), 8),
              ((4, 6), 2), ((2, 2, 3, 2, 6), 1), ((3, 1, 1, 33), 3)]


@pytest.mark.parametrize("shape,groups", NHWC_CASES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_group_norm_channels_last(device, shape, groups, dtype):
    run_group_norm_nhwc(device, shape, groups, dtype, "both")


@pytest.mark.parametrize("which", ["none", "scale", "bias"])
def test_group_norm_channels_last_without_scale_or_bias(device, which):
    run_group_norm_nhwc(device, (2, 5, 3, 6), 3, np.float32, which)


def test_group_norm_channels_last_offset_data_and_determinism(device):
    first = run_group_norm_nhwc(device, (2, 17, 13, 6), 3, np.float32, "both", offset=1e4)
    again = run_group_norm_nhwc(device, (2, 17, 13, 6), 3, np.float32, "both", offset=1e4)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_group_norm_channels_last_empty_and_bad_arguments(device):
    from minigraph.kernels.cuda import norm_nhwc

    x = device.put(np.zeros((0, 3, 4), np.float32))
    y, mean, var = norm_nhwc.group_norm_nhwc(x, None, None, 2)
    assert device.get(y).shape == (0, 3, 4) and device.get(mean).shape == (0, 2)
    dx, dscale, dbias = norm_nhwc.group_norm_nhwc_grad(x, None, mean, var, x, 2)
    assert device.get(dx).shape == (0, 3, 4)
    np.testing.assert_array_equal(device.get(dscale), 0)
    with pytest.raises(ValueError, match="groups 3 must divide the 4 channels"):
        norm_nhwc.group_norm_nhwc(device.put(np.ones((2, 3, 4), np.float32)), None, None, 3)


def estimates_reference(mean, var, spatial, est_mean, est_var, counter, momentum, first):
    """Instance norm's new estimates in float64 (references.blend_estimates)."""
    from references import blend_estimates

    return blend_estimates(est_mean, est_var, mean.astype(np.float64).mean(axis=0),
                           (var.astype(np.float64) * spatial / (spatial - 1)).mean(axis=0),
                           counter, momentum, first)


@pytest.mark.parametrize("counter,momentum,first", [(0, 0.9, True), (0, 0.3, False),
                                                    (5, None, True), (None, 0.6, True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_instance_norm_estimates(device, counter, momentum, first, dtype):
    from minigraph.kernels.cuda import batch_norm, norm_nhwc

    r = rng(10)
    mean = r.normal(size=(4, 5)).astype(dtype)
    var = r.uniform(0.1, 2, (4, 5)).astype(dtype)
    est_mean, est_var = r.normal(size=5).astype(dtype), r.uniform(0.5, 1.5, 5).astype(dtype)
    em, ev = device.put(est_mean), device.put(est_var)
    cnt = None if counter is None else device.put(np.array(counter, np.int64))
    guard = batch_norm.Guard()
    norm_nhwc.update_estimates(device.put(mean), device.put(var), 7, em, ev, cnt, momentum,
                               guard, first)
    want = estimates_reference(mean, var, 7, est_mean, est_var, counter, momentum, first)
    assert rel_err(device.get(em), want[0]) < TOL[dtype]
    assert rel_err(device.get(ev), want[1]) < TOL[dtype]
    if counter is not None:
        assert int(device.get(cnt)) == counter + 1
    assert guard.rejected() == 0


def test_instance_norm_estimates_reject_a_non_finite_batch(device):
    from minigraph.kernels.cuda import batch_norm, norm_nhwc

    mean = np.ones((2, 3), np.float32)
    mean[1, 2] = np.inf
    em, ev = device.put(np.zeros(3, np.float32)), device.put(np.ones(3, np.float32))
    cnt = device.put(np.array(2, np.int64))
    guard = batch_norm.Guard()
    norm_nhwc.update_estimates(device.put(mean), device.put(np.ones((2, 3), np.float32)), 4,
                               em, ev, cnt, 0.9, guard)
    assert guard.rejected() == 1
    np.testing.assert_array_equal(device.get(em), 0)
    assert int(device.get(cnt)) == 2
    norm_nhwc.update_estimates(device.put(np.zeros((0, 3), np.float32)),
                               device.put(np.zeros((0, 3), np.float32)), 4, em, ev, cnt, 0.9,
                               guard)                       # an empty batch: nothing at all
    assert int(device.get(cnt)) == 2 and guard.rejected() == 0
