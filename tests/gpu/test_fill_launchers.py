"""kernels/cuda/fill.py on the emulator and (marked gpu) a real GPU: constants of every
dtype, uniform values that are Philox4x32-10 words (checked against the float64
references' Philox), seeded and independent of the device, gaussian moments."""
from __future__ import annotations

import kernel_emulator
import numpy as np
import pytest
from references import philox4x32

from minigraph import device as mg_device


@pytest.mark.parametrize("dtype,value", [(np.float32, 2.5), (np.float64, -1e300),
                                         (np.int64, 2**40 + 3), (np.int32, -7), (np.uint8, 200),
                                         (np.bool_, 1), (np.float16, 0.1)])
def test_fill_constant(device, dtype, value):
    from minigraph.kernels.cuda import fill

    out = fill.full((3, 37), value, dtype)
    np.testing.assert_array_equal(device.get(out), np.full((3, 37), value, dtype))


def test_uniform_is_philox_and_seeded(device):
    from minigraph.kernels.cuda import fill

    seed = 0x1234567890
    got = device.get(fill.uniform_random((10,), np.float32, 0.0, 1.0, seed))
    words = [w for i in range(3) for w in philox4x32([i, 0, 0, 0], [seed & 0xFFFFFFFF,
                                                                    seed >> 32])]
    np.testing.assert_array_equal(got, (np.array(words[:10]) >> 8) / 2.0**24)
    big = device.get(fill.uniform_random((20001,), np.float64, -2.0, 3.0, 7))
    assert big.min() >= -2 and big.max() < 3 and abs(big.mean() - 0.5) < 0.05
    again = device.get(fill.uniform_random((20001,), np.float64, -2.0, 3.0, 7))
    np.testing.assert_array_equal(big, again)
    other = device.get(fill.uniform_random((20001,), np.float64, -2.0, 3.0, 8))
    assert not np.array_equal(big, other)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gaussian_moments(device, dtype):
    from minigraph.kernels.cuda import fill

    g = device.get(fill.gaussian_random((40001,), dtype, 1.5, 2.0, 3))
    assert g.dtype == dtype and np.isfinite(g).all()
    assert abs(g.mean() - 1.5) < 0.05 and abs(g.std() - 2.0) < 0.05


def test_random_values_do_not_depend_on_the_device(device):
    from minigraph.kernels.cuda import fill

    if not device.emulated:
        pytest.skip("needs two emulated devices")

    first = device.get(fill.uniform_random((999,), np.float32, 0, 1, 42))
    mg_device.use_backend(kernel_emulator.EmuBackend(sm_count=7))
    np.testing.assert_array_equal(device.get(fill.uniform_random((999,), np.float32, 0, 1, 42)),
                                  first)
