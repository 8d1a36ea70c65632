"""kernels/cuda/batch_norm.py against the float64 references, on the emulator and (marked
gpu) a real GPU: training with the estimates and counter updated on the device
(first batch, momentum, cumulative average, no counter), channels split over many
blocks and merged in the last, offset and unaligned data, non-finite batches
that commit nothing, inference, the backward in both modes, empty arrays."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng
from references import (
    batch_norm_grad,
    batch_stats,
    bn_estimates,
    bn_normalize,
    reduce_axes,
)

BN_SHAPES = [("NCHW", (4, 3, 5, 7)), ("NCHW", (8, 4, 8, 8)), ("NCHW", (5, 1, 1, 1)),
             ("NCHW", (6, 3)), ("NCHW", (2, 3, 4, 5, 3)), ("NHWC", (4, 5, 6, 8)),
             ("NHWC", (3, 7, 7, 3)), ("NHWC", (37, 1))]


def bn_params(channels, dtype, seed=1):
    r = rng(seed)
    return [r.uniform(0.5, 1.5, channels).astype(dtype), r.normal(0, 1, channels).astype(dtype),
            r.normal(0, 1, channels).astype(dtype), r.uniform(0.5, 2, channels).astype(dtype)]


def run_bn_training(device, layout, shape, dtype, momentum, steps, offset=0, counter=True,
                    data=None):
    from minigraph.kernels.cuda import batch_norm

    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias, est_mean, est_var = bn_params(channels, dtype)
    d_scale, d_bias, d_mean, d_var = (device.put(a, offset)
                                      for a in (scale, bias, est_mean, est_var))
    d_counter = device.put(np.array(0, np.int64)) if counter else None
    est = (est_mean.astype(np.float64), est_var.astype(np.float64))
    eps = 1e-5
    guard = batch_norm.Guard()
    for step in range(steps):
        x = data(step) if data else rng(step).normal(0.5, 2.0, shape).astype(dtype)
        y, bm, bv = batch_norm.forward_train(device.put(x, offset), d_scale, d_bias, d_mean, d_var,
                                             d_counter, momentum, eps, layout, guard=guard)
        mean, var, n = batch_stats(x, layout)
        tol = TOL[dtype]
        assert rel_err(device.get(bm), mean) < tol
        assert rel_err(device.get(bv), var) < tol * 10
        assert rel_err(device.get(y), bn_normalize(x, scale, bias, mean, var, eps, layout)) < tol
        est = bn_estimates(*est, mean, var, n, step if counter else None, momentum)
        assert rel_err(device.get(d_mean), est[0]) < tol
        assert rel_err(device.get(d_var), est[1]) < tol * 10
        if counter:
            assert int(device.get(d_counter)) == step + 1
    assert guard.rejected() == 0
    return device


@pytest.mark.parametrize("layout,shape", BN_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bn_forward_train_updates_estimates_on_the_device(device, layout, shape, dtype):
    run_bn_training(device, layout, shape, dtype, momentum=0.9, steps=2)


@pytest.mark.parametrize("layout,shape", [("NCHW", (8, 2, 16, 16)), ("NCHW", (9, 3, 5, 7)),
                                          ("NHWC", (40, 9, 8)), ("NHWC", (300, 3))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_bn_split_channels_merge_in_the_last_block(device, force_splits, layout, shape, dtype,
                                                   offset):
    run_bn_training(device, layout, shape, dtype, momentum=0.8, steps=2, offset=offset)


def test_bn_cumulative_average_and_no_counter(device):
    run_bn_training(device, "NCHW", (4, 3, 6, 6), np.float32, momentum=None, steps=3)
    run_bn_training(device, "NHWC", (4, 6, 6, 4), np.float64, momentum=0.5, steps=2, counter=False)


@pytest.mark.parametrize("layout,shape", [("NCHW", (16, 2, 17, 13)), ("NHWC", (64, 9, 4)),
                                          ("NCHW", (4000, 1))])
def test_bn_offset_data_keeps_its_variance(device, force_splits, layout, shape):
    from minigraph.kernels.cuda import batch_norm

    x = (1e4 + rng(3).standard_normal(shape)).astype(np.float32)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias, est_mean, est_var = (device.put(a) for a in bn_params(channels, np.float32))
    y, bm, bv = batch_norm.forward_train(device.put(x), scale, bias, est_mean, est_var, None, 0.9,
                                         1e-5, layout)
    axes = reduce_axes(x.ndim, layout)
    var = x.astype(np.float64).var(axes)
    assert np.max(np.abs(device.get(bv) / var - 1)) < 1e-3
    mean = x.astype(np.float64).mean(axes)
    ref = bn_normalize(x, *bn_params(channels, np.float32)[:2], mean, var, 1e-5, layout)
    assert np.max(np.abs(device.get(y) - ref)) < 1e-3


def test_bn_non_finite_batch_commits_nothing(device):
    from minigraph.kernels.cuda import batch_norm

    shape, channels = (4, 3, 5, 5), 3
    params = bn_params(channels, np.float32)
    scale, bias, est_mean, est_var = (device.put(a) for a in params)
    counter = device.put(np.array(0, np.int64))
    guard = batch_norm.Guard()
    good = rng(0).normal(0, 1, shape).astype(np.float32)
    batch_norm.forward_train(device.put(good), scale, bias, est_mean, est_var, counter, 0.9, 1e-5,
                             guard=guard)
    before = [device.get(a) for a in (est_mean, est_var, counter)]
    bad = good.copy()
    bad[1, 2, 3, 4] = np.nan
    y, bm, bv = batch_norm.forward_train(device.put(bad), scale, bias, est_mean, est_var, counter,
                                         0.9, 1e-5, guard=guard)
    bad[0, 0, 0, 0] = np.inf
    batch_norm.forward_train(device.put(bad), scale, bias, est_mean, est_var, counter, 0.9, 1e-5,
                             guard=guard)
    for want, got in zip(before, (est_mean, est_var, counter), strict=True):
        np.testing.assert_array_equal(device.get(got), want)
    assert np.isnan(device.get(bm)[2])
    with pytest.raises(FloatingPointError, match=r"batch_norm: 2 training batch\(es\)"):
        guard.check()
    guard.check()                                     # reported once
    batch_norm.forward_train(device.put(good), scale, bias, est_mean, est_var, counter, 0.9, 1e-5,
                             guard=guard)
    assert int(device.get(counter)) == 2 and guard.rejected() == 0


def test_bn_training_needs_two_values_per_channel(device):
    from minigraph.kernels.cuda import batch_norm

    params = [device.put(a) for a in bn_params(3, np.float32)]
    with pytest.raises(ValueError, match="more than one value per channel"):
        batch_norm.forward_train(device.put(np.ones((1, 3), np.float32)), *params, None, 0.9, 1e-5)
    with pytest.raises(ValueError, match=r"'scale' must be float32 of shape \(4,\)"):
        batch_norm.forward_train(device.put(np.ones((2, 4), np.float32)), *params, None, 0.9, 1e-5)


@pytest.mark.parametrize("layout,shape", BN_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bn_forward_infer(device, layout, shape, dtype):
    from minigraph.kernels.cuda import batch_norm

    x = rng(5).normal(1, 3, shape).astype(dtype)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    params = bn_params(channels, dtype)
    y = batch_norm.forward_infer(device.put(x), *(device.put(a) for a in params), 1e-3, layout)
    assert rel_err(device.get(y), bn_normalize(x, *params, 1e-3, layout)) < TOL[dtype]


@pytest.mark.parametrize("layout,shape", BN_SHAPES + [("NCHW", (8, 2, 16, 16))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("use_global", [False, True], ids=["batch", "global"])
def test_bn_backward(device, force_splits, layout, shape, dtype, use_global):
    from minigraph.kernels.cuda import batch_norm_grad as launchers

    r = rng(7)
    x = r.normal(2, 3, shape).astype(dtype)
    dy = r.normal(0, 1, shape).astype(dtype)
    axes = reduce_axes(x.ndim, layout)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale = r.uniform(0.5, 2, channels).astype(dtype)
    if use_global:
        mean, var = r.normal(0, 1, channels).astype(dtype), r.uniform(1, 2, channels).astype(dtype)
    else:
        mean, var = x.astype(np.float64).mean(axes).astype(dtype), \
            x.astype(np.float64).var(axes).astype(dtype)
    dx, dscale, dbias = launchers.backward(device.put(x), device.put(dy), device.put(scale),
                                           device.put(mean), device.put(var), 1e-5, layout,
                                           use_global)
    want = batch_norm_grad(x, dy, scale, mean, var, 1e-5, layout, use_global)
    tol = TOL[dtype] * (100 if dtype == np.float32 else 1)    # dx cancels: sums of ~n terms
    for got, ref in zip((dx, dscale, dbias), want, strict=True):
        assert rel_err(device.get(got), ref) < tol


def test_empty_arrays_launch_nothing(device):
    from minigraph.kernels.cuda import activation, batch_norm, elementwise

    empty = device.put(np.zeros((0, 3), np.float32))
    assert device.get(activation.relu(empty)).shape == (0, 3)
    assert device.get(elementwise.copy(empty)).shape == (0, 3)
    params = [device.put(a) for a in bn_params(3, np.float32)]
    assert device.get(batch_norm.forward_infer(empty, *params, 1e-5)).shape == (0, 3)


def test_bn_backward_skips_unwanted_outputs(device):
    from minigraph.kernels.cuda import batch_norm_grad as launchers

    x = rng(1).normal(size=(4, 3, 4, 4)).astype(np.float32)
    args = [device.put(a) for a in (x, x, np.ones(3, np.float32), np.zeros(3, np.float32),
                                    np.ones(3, np.float32))]
    dx, dscale, dbias = launchers.backward(*args, 1e-5, need_dx=False, need_dscale=False)
    assert dx is None and dscale is None and dbias is not None


# ---- pre-flight review findings 4 and 5 ---------------------------------------------------

@pytest.mark.parametrize("dtype,channels", [(np.float32, 8), (np.float64, 4)])
def test_bn_backward_with_an_unaligned_mean(device, dtype, channels):
    """x and dy aligned (16-byte packs across channels), mean a slice 1 element off
    an aligned start: the channel-rows reductions (single device and sync) read it
    by element. A 16-byte load of it would kill the context on a GPU, and fails
    the emulator's alignment check."""
    from minigraph.kernels.cuda import batch_norm_grad as launchers
    from minigraph.kernels.cuda import batch_norm_sync

    r = rng(8)
    shape = (24, channels)
    x, dy = r.normal(2, 3, shape).astype(dtype), r.normal(0, 1, shape).astype(dtype)
    scale = r.uniform(0.5, 2, channels).astype(dtype)
    mean, var = x.mean(0).astype(dtype), x.var(0).astype(dtype)
    args = [device.put(a) for a in (x, dy, scale)]
    dmean, dvar = device.put(mean, offset=1), device.put(var, offset=1)
    dx, dscale, dbias = launchers.backward(*args, dmean, dvar, 1e-5, "NHWC")
    want = batch_norm_grad(x, dy, scale, mean, var, 1e-5, "NHWC", False)
    tol = TOL[dtype] * (100 if dtype == np.float32 else 1)
    for got, ref in zip((dx, dscale, dbias), want, strict=True):
        assert rel_err(device.get(got), ref) < tol
    sums = device.get(batch_norm_sync.backward_sums(args[0], args[1], dmean, "NHWC"))
    np.testing.assert_allclose(sums[1:channels + 1], dy.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sums[channels + 1:], (dy * (x - mean)).sum(0), rtol=1e-5,
                               atol=1e-4)


def test_merge_stats_merges_channels_past_one_wave_of_threads(device):
    """bn_merge_stats is one thread per channel without a loop: its grid must cover
    every channel, also beyond the threads one wave of the device holds."""
    from minigraph.distributed.comm import merge_rows
    from minigraph.kernels.cuda import batch_norm_sync, launch, loader
    from minigraph.kernels.cuda.launch import KernelResources

    with device.place.activate():
        dev = loader.device()
    threads = launch.block_threads(dev)
    wave = dev.sm_count * launch.blocks_per_sm(dev, threads, KernelResources()) * threads
    channels = wave + 3 * threads + 5
    r = rng(9)
    rows = np.zeros((3, 2 * channels + 1))
    rows[:, 0] = (5, 0, 7)                                    # a rank without rows too
    rows[:, 1:channels + 1] = r.normal(0, 1, (3, channels))
    rows[:, channels + 1:] = r.uniform(0, 2, (3, channels))
    rows[1, 1:] = 0
    got = device.get(batch_norm_sync.merge_stats(device.put(rows)))
    want = merge_rows(rows)
    assert np.isfinite(got).all(), "channels past the first wave were never merged"
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
