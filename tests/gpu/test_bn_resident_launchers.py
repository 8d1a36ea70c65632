"""kernels/cuda/bn_resident.py (NCHW with small planes: each channel group resident in
shared memory, one launch per pass) against the float64 references and the split
kernels, on the emulator and (marked gpu) a real GPU: odd planes (7x7, 13x13, and 1x1
through the rows kernels), float32 and float64, ranks 3 to 5, unaligned data, shared
memory past 48 KiB (the function attribute, which the emulator and the fake PyCUDA
hold it to), the next group double-buffered, the ReLU output and mask, dx written over
dy, and the plan itself on an H200-sized device."""
from __future__ import annotations

import numpy as np
import pytest
from kernel_emulator import EmulatorError
from launcher_harness import TOL, rel_err, rng
from references import batch_norm_grad, batch_stats, bn_estimates, bn_normalize

from minigraph.kernels.cuda import bn_resident, launch

H200 = launch.DeviceInfo("h200", (9, 0), sm_count=132)
TINY = launch.DeviceInfo("emulated", (9, 0), sm_count=2)


def params(channels, dtype, seed=1):
    r = rng(seed)
    return [r.uniform(0.5, 1.5, channels).astype(dtype), r.normal(0, 1, channels).astype(dtype),
            r.normal(0, 1, channels).astype(dtype), r.uniform(0.5, 2, channels).astype(dtype)]


def used_kernels(device):
    """Names of the kernels the emulator launched so far (empty on a real GPU)."""
    from minigraph import device as dev

    kernels = getattr(dev.backend(), "_kernels", {})
    return {name for (_, name), k in kernels.items() if k._launch.launches}


def train_and_backward(device, shape, dtype, relu=False, offset=0, steps=2, in_place=False):
    """forward_train (the estimates and counter over `steps`), then backward, against the
    references; returns the names of the kernels the emulator ran."""
    from minigraph.kernels.cuda import batch_norm
    from minigraph.kernels.cuda import batch_norm_grad as grads

    channels = shape[1]
    scale, bias, mean0, var0 = params(channels, dtype)
    d = [device.put(a, offset) for a in (scale, bias, mean0, var0)]
    counter = device.put(np.array(0, np.int64))
    est, tol, eps = (mean0.astype(np.float64), var0.astype(np.float64)), TOL[dtype], 1e-5
    for step in range(steps):
        x = rng(step).normal(0.5, 2.0, shape).astype(dtype)
        y, bm, bv = batch_norm.forward_train(device.put(x, offset), *d, counter, 0.9, eps,
                                             relu=relu)
        mean, var, n = batch_stats(x, "NCHW")
        want = bn_normalize(x, scale, bias, mean, var, eps, "NCHW")
        want = np.maximum(want, 0) if relu else want
        assert rel_err(device.get(y), want) < tol
        assert rel_err(device.get(bm), mean) < tol and rel_err(device.get(bv), var) < 10 * tol
        est = bn_estimates(*est, mean, var, n, step, 0.9)
        assert rel_err(device.get(d[2]), est[0]) < tol
        assert rel_err(device.get(d[3]), est[1]) < 10 * tol
        assert int(device.get(counter)) == step + 1
    y_host = device.get(y)
    dy = rng(9).normal(0, 1, shape).astype(dtype)
    dy_dev = device.put(dy, offset)
    dx, dscale, dbias = grads.backward(device.put(x, offset), dy_dev, d[0], bm, bv, eps,
                                       relu_out=device.put(y_host, offset) if relu else None)
    masked = np.where(y_host > 0, dy, 0).astype(dtype) if relu else dy
    want = batch_norm_grad(x, masked, scale, device.get(bm), device.get(bv), eps, "NCHW", False)
    for got, ref in zip((dx, dscale, dbias), want, strict=True):
        assert rel_err(device.get(got), ref) < tol * (100 if dtype == np.float32 else 1)
    return used_kernels(device)


@pytest.mark.parametrize("shape", [(6, 5, 7, 7), (4, 3, 13, 13), (5, 4, 9), (2, 3, 2, 3, 5)],
                         ids=["7x7", "13x13", "rank3", "rank5"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [False, True], ids=["bn", "bn_relu"])
def test_one_launch_per_pass_matches_the_references(device, shape, dtype, relu):
    used = train_and_backward(device, shape, dtype, relu)
    if device.emulated:
        sfx = "f32_w4" if dtype == np.float32 else "f64_w2"
        assert {f"bn_resident_train_{sfx}", f"bn_resident_grad_{sfx}"} <= used
        assert not any(k.startswith(("bn_stats", "bn_normalize", "bn_grad_planar"))
                       for k in used), used


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unaligned_data_takes_single_value_copies(device, dtype):
    used = train_and_backward(device, (3, 4, 5, 5), dtype, relu=True, offset=1)
    if device.emulated:
        assert f"bn_resident_train_{'f32' if dtype == np.float32 else 'f64'}_w1" in used


def test_more_than_48_kib_of_shared_memory_with_the_attribute(device):
    """(64, 8, 7, 7) float32: a group of four channels takes 68 KiB; the launch raises
    the kernel's limit first (and the emulator holds a kernel to 48 KiB without it)."""
    p = bn_resident.plan(64, 8, 49, 4, True, TINY, 1)
    assert p.shared > 48 * 1024 and p.channels == 4
    train_and_backward(device, (64, 8, 7, 7), np.float32)


def test_without_the_attribute_the_emulator_refuses_the_launch(device, monkeypatch):
    if not device.emulated:
        pytest.skip("the emulator's own check")
    from minigraph.kernels.cuda import batch_norm, loader

    monkeypatch.setattr(loader.Kernel, "allow_shared", lambda self, nbytes: None)
    x = rng(0).normal(size=(64, 8, 7, 7)).astype(np.float32)
    d = [device.put(a) for a in params(8, np.float32)]
    with pytest.raises(EmulatorError, match="dynamic shared memory"):
        batch_norm.forward_train(device.put(x), *d, None, 0.9, 1e-5)


def test_the_next_group_is_double_buffered_when_there_are_more_groups_than_ctas(device):
    """128 x 32 channels of 7x7 over two CTAs (float32: groups of 4, 221 KB of shared
    memory): each CTA loads its next group while it works on the current one; every
    channel's statistics, estimates and gradients come out right. The float64 backward
    with the ReLU mask (x, dy and y: 150 KB a channel) has room for one buffer only and
    loads each next group after the current one."""
    for itemsize, planes in ((4, 1), (4, 3), (8, 1), (8, 2)):
        p = bn_resident.plan(128, 32, 49, itemsize, True, TINY, planes)
        assert p.buffers == 2 and p.groups > p.ctas, (itemsize, planes)
    p = bn_resident.plan(128, 32, 49, 8, True, TINY, 3)
    assert p.buffers == 1 and p.groups > p.ctas
    train_and_backward(device, (128, 32, 7, 7), np.float32, relu=True, steps=1)
    train_and_backward(device, (128, 32, 7, 7), np.float64, steps=1)
    train_and_backward(device, (128, 32, 7, 7), np.float64, relu=True, steps=1)


def test_dx_may_be_written_over_dy(device, monkeypatch):
    """dx into dy's own array: a group's dy is resident before its dx is stored, and
    groups do not overlap. Six channels are too few for the resident kernels on a
    large GPU: the plan is made for this device with that limit lifted."""
    from minigraph.kernels.cuda import loader

    shape, eps = (8, 6, 7, 7), 1e-5
    x = rng(1).normal(size=shape).astype(np.float32)
    dy = rng(2).normal(size=shape).astype(np.float32)
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3))
    scale = np.linspace(0.5, 1.5, 6).astype(np.float32)
    want = batch_norm_grad(x, dy, scale, mean, var, eps, "NCHW", False)
    xd, dyd, sd, md, vd = (device.put(a) for a in (x, dy, scale, mean, var))
    dscale, dbias = device.put(np.zeros(6, np.float32)), device.put(np.zeros(6, np.float32))
    ptr = loader.ptr
    monkeypatch.setattr(bn_resident, "MIN_CHANNEL_SHARE", 0)
    p = bn_resident.plan(8, 6, 49, 4, True, loader.device(), 2)
    assert p is not None
    bn_resident.grad(p, xd, (ptr(xd), ptr(dyd), 0, ptr(dyd)), 8, 6, 49,
                     (ptr(sd), ptr(md), ptr(vd), ptr(dscale), ptr(dbias)), eps, False)
    for got, ref in zip((dyd, dscale, dbias), want, strict=True):
        assert rel_err(device.get(got), ref) < 1e-3


def test_resident_and_split_kernels_agree(device, monkeypatch):
    """The same batch through the resident kernels and through the split ones."""
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(bn_resident, "ENABLED", enabled)
        from minigraph.kernels.cuda import batch_norm

        x = rng(4).normal(3, 2, (12, 5, 13, 13)).astype(np.float32)
        d = [device.put(a) for a in params(5, np.float32)]
        y, bm, bv = batch_norm.forward_train(device.put(x), *d, None, 0.9, 1e-5, relu=True)
        results.append([device.get(a) for a in (y, bm, bv, d[2], d[3])])
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-6


def test_a_non_finite_channel_commits_no_estimate(device):
    """The last CTA commits: a NaN in one channel of one group leaves every estimate and
    the counter as they were, and the Guard reports it."""
    from minigraph.kernels.cuda import batch_norm

    x = rng(0).normal(size=(8, 32, 7, 7)).astype(np.float32)
    x[3, 17, 2, 2] = np.nan
    d = [device.put(a) for a in params(32, np.float32)]
    counter = device.put(np.array(4, np.int64))
    before = [device.get(a) for a in (d[2], d[3], counter)]
    guard = batch_norm.Guard()
    batch_norm.forward_train(device.put(x), *d, counter, 0.9, 1e-5, guard=guard)
    for got, want in zip((d[2], d[3], counter), before, strict=True):
        np.testing.assert_array_equal(device.get(got), want)
    assert guard.rejected() == 1


# ---- the plan ------------------------------------------------------------------------------

def test_the_plan_on_an_h200():
    """Small planes take one group per multiprocessor (256x512x7x7: four channels, 128
    CTAs, past 48 KiB); thousands of channels double-buffer; large planes, a batch
    whose channel does not fit, one value per plane and too few channels do not apply."""
    p = bn_resident.plan(256, 512, 49, 4, True, H200, 1)
    assert (p.channels, p.groups, p.ctas, p.buffers) == (4, 128, 128, 1)
    assert 48 * 1024 < p.shared <= H200.shared_per_block_optin
    p = bn_resident.plan(128, 2048, 49, 4, True, H200, 1)
    assert p.buffers == 2 and p.ctas == 132 and p.groups > p.ctas
    assert p.shared <= H200.shared_per_block_optin
    grad = bn_resident.plan(256, 512, 49, 4, True, H200, 3)
    assert grad is not None and grad.planes == 3 and grad.channels < 4
    assert bn_resident.plan(64, 256, 196, 8, True, H200, 1).width == 2       # float64
    assert bn_resident.plan(32, 256, 3136, 4, True, H200, 1) is None         # 56x56
    assert bn_resident.plan(1024, 4096, 1, 4, True, H200, 1) is None         # rows
    assert bn_resident.plan(256, 16, 49, 4, True, H200, 1) is None           # 16 channels
    assert bn_resident.plan(64, 200, 49, 4, False, H200, 1).width == 1


def test_the_layout_bytes_are_what_the_kernel_carves():
    """part (2 doubles a thread), coefficients, the channel table (when a group's
    columns fit the threads), the buffers."""
    assert bn_resident.row_stride(4, 49, 4) == 200 and bn_resident.row_stride(1, 49, 1) == 49
    got = bn_resident.shared_bytes(256, 4, 49, 4, 4, 1024, 1, 1)
    assert got == 2 * 1024 * 8 + 4 * 4 * 4 + 400 + 256 * 200 * 4
    assert bn_resident.shared_bytes(2, 1, 2000, 4, 4, 1024, 2, 2) == \
        2 * 1024 * 8 + 16 + 2 * 2 * 2 * 2004 * 4        # columns past the threads: no table


@pytest.mark.parametrize("threads", [64, 1024])
@pytest.mark.parametrize("shape", [(3, 5, 13, 13), (2, 3, 40, 40), (5, 7, 2)])
def test_columns_past_the_threads_and_one_channel_a_group(device, monkeypatch, threads, shape):
    """With a plane larger than the CTA's threads a group is one channel and each thread
    sums several columns (no channel table); with a small plane a thread owns one column
    and reads rows in steps."""
    monkeypatch.setattr(bn_resident, "THREADS", threads)
    train_and_backward(device, shape, np.float32, relu=True, steps=1)


def test_the_attribute_goes_through_pycuda(monkeypatch):
    """On PyCUDA (the fake, which models the driver's rule): the launcher sets the
    kernel's MAX_DYNAMIC_SHARED_SIZE_BYTES before a launch past 48 KiB; without it the
    launch is refused."""
    from kernel_emulator.fake_memory import FakeDriverError
    from kernel_emulator.fake_pycuda import FakeCuda

    import minigraph as mg
    from minigraph.kernels.cuda import backend, batch_norm

    x = rng(0).normal(size=(64, 8, 7, 7)).astype(np.float32)
    with FakeCuda(sm_count=2).install() as cuda:
        place = mg.GPUPlace(0)
        with place.activate():
            d = [place.to_device(a) for a in params(8, np.float32)]
            y, _, _ = batch_norm.forward_train(place.to_device(x), *d, None, 0.9, 1e-5)
            mean, var, _ = batch_stats(x, "NCHW")
            assert rel_err(y.get(), bn_normalize(x, *params(8, np.float32)[:2], mean, var, 1e-5,
                                                 "NCHW")) < 1e-5
        assert cuda.counts["set_attribute"] >= 1
    original = backend.PyCudaBackend.kernel

    def without_attribute(self, module, name, fmt):
        k = original(self, module, name, fmt)
        k._allow_shared = lambda nbytes: None
        return k

    monkeypatch.setattr(backend.PyCudaBackend, "kernel", without_attribute)
    with FakeCuda(sm_count=2).install():
        place = mg.GPUPlace(0)
        with place.activate():
            d = [place.to_device(a) for a in params(8, np.float32)]
            with pytest.raises(FakeDriverError, match="dynamic shared memory"):
                batch_norm.forward_train(place.to_device(x), *d, None, 0.9, 1e-5)
