"""kernels/cuda/bn_rows.py and batch_norm.cu's rows reductions ((rows, C) tensors: NHWC,
rank 2, NCHW with 1x1 planes) against the float64 references, on the emulator and
(marked gpu) a real GPU: channel groups split over many blocks and finished from
channel-contiguous partials, the elementwise passes with each thread's coefficients in
registers, the ReLU output, its mask (bits from the reduction, or y itself when the
widths differ), and the plan on an H200-sized device."""
from __future__ import annotations

import math

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng
from references import batch_norm_grad, batch_stats, bn_normalize

from minigraph.kernels.cuda import bn_resident, bn_rows, launch

H200 = launch.DeviceInfo("h200", (9, 0), sm_count=132)
ROWS = [("NHWC", (4, 5, 6, 8)), ("NHWC", (3, 7, 7, 3)), ("NHWC", (37, 1)), ("NCHW", (6, 12)),
        ("NCHW", (9, 8, 1, 1)), ("NHWC", (2, 3, 4, 5, 16)), ("NHWC", (300, 36))]


def params(channels, dtype):
    r = rng(1)
    return [r.uniform(0.5, 1.5, channels).astype(dtype), r.normal(0, 1, channels).astype(dtype),
            r.normal(0, 1, channels).astype(dtype), r.uniform(0.5, 2, channels).astype(dtype)]


@pytest.mark.parametrize("layout,shape", ROWS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [False, True], ids=["bn", "bn_relu"])
def test_rows_passes_match_the_references(device, force_splits, layout, shape, dtype, relu):
    from minigraph.kernels.cuda import batch_norm
    from minigraph.kernels.cuda import batch_norm_grad as grads

    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias, em, ev = params(channels, dtype)
    d = [device.put(a) for a in (scale, bias, em, ev)]
    x = rng(3).normal(1, 2, shape).astype(dtype)
    y, bm, bv = batch_norm.forward_train(device.put(x), *d, None, 0.9, 1e-5, layout, relu=relu)
    mean, var, _ = batch_stats(x, layout)
    want = bn_normalize(x, scale, bias, mean, var, 1e-5, layout)
    tol = TOL[dtype]
    assert rel_err(device.get(y), np.maximum(want, 0) if relu else want) < tol
    got = batch_norm.forward_infer(device.put(x), *d, 1e-5, layout, relu=relu)
    want = bn_normalize(x, scale, bias, device.get(d[2]), device.get(d[3]), 1e-5, layout)
    assert rel_err(device.get(got), np.maximum(want, 0) if relu else want) < tol
    y_host, dy = device.get(y), rng(4).normal(0, 1, shape).astype(dtype)
    for use_global in (False, True):
        dx, ds, db = grads.backward(device.put(x), device.put(dy), d[0], bm, bv, 1e-5, layout,
                                    use_global, relu_out=device.put(y_host) if relu else None)
        masked = np.where(y_host > 0, dy, 0).astype(dtype) if relu else dy
        want = batch_norm_grad(x, masked, scale, device.get(bm), device.get(bv), 1e-5, layout,
                               use_global)
        for a, b in zip((dx, ds, db), want, strict=True):
            assert rel_err(device.get(a), b) < tol * (100 if dtype == np.float32 else 1)


@pytest.mark.parametrize("layout,shape", [("NHWC", (6, 5, 16)), ("NCHW", (5, 4, 6, 8))])
def test_a_mask_read_at_another_width(device, monkeypatch, layout, shape):
    """y one value off an aligned start: the reduction reads single values and stores a
    mask bit per value, dx reads 16-byte packs (shift 0 of the mask's index)."""
    from minigraph.kernels.cuda import batch_norm_grad as grads

    monkeypatch.setattr(bn_resident, "ENABLED", False)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    x = rng(5).normal(size=shape).astype(np.float32)
    dy = rng(6).normal(size=shape).astype(np.float32)
    y = rng(7).normal(size=shape).astype(np.float32)
    scale = np.linspace(0.5, 1.5, channels).astype(np.float32)
    mean, var, _ = batch_stats(x, layout)
    args = [device.put(a) for a in (x, dy, scale, mean.astype(np.float32),
                                    var.astype(np.float32))]
    dx, ds, db = grads.backward(*args, 1e-5, layout, relu_out=device.put(y, offset=1))
    want = batch_norm_grad(x, np.where(y > 0, dy, 0), scale, mean.astype(np.float32),
                           var.astype(np.float32), 1e-5, layout, False)
    for a, b in zip((dx, ds, db), want, strict=True):
        assert rel_err(device.get(a), b) < 1e-3


def test_offset_rows_keep_their_variance(device, force_splits):
    """1e4 + N(0, 1) in float32 over many splits: the finish merges the splits' means
    and M2 in two passes in double (no cancellation)."""
    from minigraph.kernels.cuda import batch_norm

    x = (1e4 + rng(3).standard_normal((2000, 24))).astype(np.float32)
    d = [device.put(a) for a in params(24, np.float32)]
    _, _, bv = batch_norm.forward_train(device.put(x), *d, None, 0.9, 1e-5, "NHWC")
    want = x.astype(np.float64).var(0)
    assert np.max(np.abs(device.get(bv) / want - 1)) < 1e-3


# ---- the plans ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows,channels,itemsize", [(100352, 256, 4), (50176, 128, 4),
                                                    (1024, 4096, 4), (4096, 64, 8),
                                                    (256, 3, 4)])
def test_the_reduction_plan_keeps_the_finish_short(rows, channels, itemsize):
    """32x56x56x256 used to run 2 groups x ~250 splits, each group's last block merging
    them serially: now TX narrows until each finishing thread reads at most FINISH_LOADS
    partials (or a warp row is ROW_BYTES)."""
    plan = bn_rows.reduce_plan(rows, channels, itemsize, True, H200)
    tx, ty, _ = plan.block
    assert plan.kind == "rows" and tx * ty == launch.ROW_THREADS
    loads = math.ceil(plan.splits / (ty // plan.width))
    assert loads <= bn_rows.FINISH_LOADS or tx * plan.width * itemsize <= bn_rows.ROW_BYTES
    assert plan.groups == math.ceil(channels // plan.width / tx)
    assert plan.chunk * plan.splits >= rows > plan.chunk * (plan.splits - 1)
