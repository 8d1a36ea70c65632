"""kernels/cuda/dropout.py on the emulator and (marked gpu) a real GPU: the masks are the
float64 reference's Philox masks bit for bit (so the CPU's), the step counter
advances on the device at every training call, dropout_grad, the argument checks."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import rng
from references import dropout_keep


def dropout_ref(x, p, seed, step):
    """(out, mask) of dropout in x's dtype: x * (keep * 1 / (1 - p)), keep as uint8."""
    keep = dropout_keep(x.size, p, seed, step).reshape(x.shape)
    factor = x.dtype.type(1.0 / (1.0 - p))
    return x * (keep.astype(x.dtype) * factor), keep.astype(np.uint8)


@pytest.mark.parametrize("shape", [(1,), (7,), (4, 9), (3, 5, 17), (2, 64)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_dropout_masks_are_the_cpus_bit_for_bit(device, shape, dtype, offset):
    from minigraph.kernels.cuda import dropout

    x = rng(7).normal(size=shape).astype(dtype)
    step = device.put(np.array(5, np.int64))
    for k, (p, seed) in enumerate([(0.5, 123), (0.1, 2**32 - 1), (0.9, 0), (0.0, 7)]):
        out, mask = dropout.dropout(device.put(x, offset), step, p, seed)
        want, want_mask = dropout_ref(x, p, seed, 5 + k)
        np.testing.assert_array_equal(device.get(mask), want_mask)
        np.testing.assert_array_equal(device.get(out), want)
        assert int(device.get(step)) == 6 + k
    d = rng(8).normal(size=shape).astype(dtype)
    dx = dropout.dropout_grad(mask, device.put(d, offset), 0.0)
    np.testing.assert_array_equal(device.get(dx), d)
    _, mask = dropout.dropout(device.put(x), step, 0.3, 9)
    dx = dropout.dropout_grad(mask, device.put(d), 0.3)
    np.testing.assert_array_equal(device.get(dx), d * (device.get(mask).astype(dtype)
                                                       * dtype(1.0 / 0.7)))


def test_dropout_keeps_about_1_minus_p_and_steps_change_masks(device):
    from minigraph.kernels.cuda import dropout

    x = np.ones(40001, np.float32)
    step = device.put(np.array(0, np.int64))
    first = device.get(dropout.dropout(device.put(x), step, 0.25, 1)[1])
    second = device.get(dropout.dropout(device.put(x), step, 0.25, 1)[1])
    assert abs(first.mean() - 0.75) < 0.01 and not np.array_equal(first, second)
    out, mask = dropout.dropout(device.put(x), step, 0.25, 1, want_mask=False)
    assert mask is None and int(device.get(step)) == 3
    out, _ = dropout.dropout(device.put(np.ones(0, np.float32)), step, 0.5, 1)
    assert int(device.get(step)) == 4                     # counts every training call
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.0"):
        dropout.dropout(device.put(x), step, 1.0, 1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
        dropout.dropout(device.put(x), step, 0.5, 2**32)
