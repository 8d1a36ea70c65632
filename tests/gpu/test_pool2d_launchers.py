"""kernels/pool2d.py against the float64 references, on the emulator and (marked gpu)
a real GPU: max and avg (padding left out of the divisor), strides other than the
window, non-square windows, global pooling, the grad to each window's first
maximum, and the checks on dout."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import rel_err, rng
from references import pool2d as pool2d_ref
from references import pool2d_grad as pool2d_grad_ref


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("k,s,p", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 1), (1, 1)),
                                   ((3, 2), (1, 1), (2, 1))])
def test_pool2d_and_grad(device, kind, k, s, p):
    from minigraph.kernels.cuda import pool2d

    x = rng(12).normal(size=(2, 3, 7, 6))
    want = pool2d_ref(x, kind, k, s, p)
    out = pool2d.pool2d(device.put(x), kind, k, s, p)
    assert rel_err(device.get(out), want) < 1e-12
    d = rng(13).normal(size=want.shape)
    dx = pool2d.pool2d_grad(device.put(x), device.put(d), kind, k, s, p)
    assert rel_err(device.get(dx), pool2d_grad_ref(x, d, kind, k, s, p)) < 1e-12


def test_global_pooling_and_first_max(device):
    from minigraph.kernels.cuda import pool2d

    x = rng(14).normal(size=(2, 3, 5, 4)).astype(np.float32)
    np.testing.assert_allclose(device.get(pool2d.pool2d(device.put(x), "avg", global_pooling=True)),
                               x.mean(axis=(2, 3), keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(
        device.get(pool2d.pool2d(device.put(x), "max", global_pooling=True)),
        x.max(axis=(2, 3), keepdims=True))
    ties = np.ones((1, 1, 4, 4), np.float32)
    dx = pool2d.pool2d_grad(device.put(ties), device.put(np.ones((1, 1, 2, 2), np.float32)), "max",
                            3, 2, 1)
    want = np.zeros((4, 4), np.float32)
    want[0, 0] = want[0, 1] = want[1, 0] = want[1, 1] = 1    # each window's first real element
    np.testing.assert_array_equal(device.get(dx)[0, 0], want)
    with pytest.raises(ValueError, match=r"dout must be float32 of shape \(1, 1, 4, 4\)"):
        pool2d.pool2d_grad(device.put(ties), device.put(np.ones((1, 1, 2, 2), np.float32)), "max",
                           3, 1, 1)


def test_max_pool_grad_scans_each_window_once(device):
    """Pre-flight review finding 8: the max gradient finds each window's first
    maximum once, then gathers. Rescanning every covering window per input element
    made global max pooling O((H W)^2) per plane: 256x256 took ~25 s on the
    emulator (and seconds to minutes on a GPU from 56x56 up); now well under 1 s."""
    import time

    from minigraph.kernels.cuda import pool2d

    x = rng(15).normal(size=(1, 2, 256, 256)).astype(np.float32)
    x[0, 1] = 0.5                                               # all ties: the first wins
    d = np.array([2.0, 3.0], np.float32).reshape(1, 2, 1, 1)
    pool2d.pool2d_grad(device.put(x[:, :, :8, :8]), device.put(d), "max", global_pooling=True)
    start = time.perf_counter()
    dx = device.get(pool2d.pool2d_grad(device.put(x), device.put(d), "max",
                                       global_pooling=True))
    elapsed = time.perf_counter() - start
    want = np.zeros_like(x)
    want[0, 0].flat[np.argmax(x[0, 0])] = 2.0
    want[0, 1, 0, 0] = 3.0
    np.testing.assert_array_equal(dx, want)
    assert elapsed < 5.0, f"{elapsed:.1f} s: the gradient rescans windows"


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("k,s,p", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 1), (1, 1)),
                                   ((3, 2), (1, 1), (2, 1))])
def test_pool2d_nhwc_and_grad(device, kind, k, s, p):
    """Channels last: the kernels see N images of H x W pixels of C channels."""
    from minigraph.kernels.cuda import pool2d

    x = rng(18).normal(size=(2, 7, 6, 3))
    want = pool2d_ref(x, kind, k, s, p, data_layout="NHWC")
    out = pool2d.pool2d(device.put(x), kind, k, s, p, data_layout="NHWC")
    assert out.shape == want.shape and rel_err(device.get(out), want) < 1e-12
    d = rng(19).normal(size=want.shape)
    dx = pool2d.pool2d_grad(device.put(x), device.put(d), kind, k, s, p, data_layout="NHWC")
    assert rel_err(device.get(dx), pool2d_grad_ref(x, d, kind, k, s, p,
                                                   data_layout="NHWC")) < 1e-12


def test_global_pooling_nhwc(device):
    from minigraph.kernels.cuda import pool2d

    x = rng(20).normal(size=(2, 5, 4, 3)).astype(np.float32)
    got = pool2d.pool2d(device.put(x), "avg", global_pooling=True, data_layout="NHWC")
    np.testing.assert_allclose(device.get(got), x.mean(axis=(1, 2), keepdims=True), rtol=1e-6)
    got = pool2d.pool2d(device.put(x), "max", global_pooling=True, data_layout="NHWC")
    np.testing.assert_array_equal(device.get(got), x.max(axis=(1, 2), keepdims=True))
    d = np.arange(6, dtype=np.float32).reshape(2, 1, 1, 3) + 1
    dx = device.get(pool2d.pool2d_grad(device.put(x), device.put(d), "max", global_pooling=True,
                                       data_layout="NHWC"))
    flat = x.reshape(2, 20, 3)
    want = np.zeros_like(flat)
    np.put_along_axis(want, flat.argmax(axis=1)[:, None], d.reshape(2, 1, 3), axis=1)
    np.testing.assert_array_equal(dx, want.reshape(x.shape))
