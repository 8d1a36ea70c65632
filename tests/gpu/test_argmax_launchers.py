"""kernels/cuda/argmax.py against numpy, on the emulator and (marked gpu) a real GPU:
argmax takes the first maximum (NaN wins, as numpy), accuracy as float32, bad
labels flagged on the device and raised once, an empty batch's NaN."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import rng


@pytest.mark.parametrize("shape,axis", [((5, 10), -1), ((3, 700), 1), ((4, 7, 5), 1),
                                        ((2, 3, 4), 0), ((6,), 0), ((3, 1), 1)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_argmax_takes_the_first_maximum(device, shape, axis, dtype):
    from minigraph.kernels.cuda import argmax

    x = rng(11).integers(0, 4, size=shape).astype(dtype)      # many ties
    got = device.get(argmax.argmax(device.put(x), axis))
    np.testing.assert_array_equal(got, np.argmax(x, axis))
    assert got.dtype == np.int64
    x = rng(12).normal(size=shape).astype(dtype)
    x.flat[::5] = np.nan
    np.testing.assert_array_equal(device.get(argmax.argmax(device.put(x), axis)),
                                  np.argmax(x, axis))


@pytest.mark.parametrize("rows,classes", [(7, 3), (50, 10), (1, 1), (3, 500)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accuracy(device, rows, classes, dtype):
    from minigraph.kernels.cuda import argmax

    logits = rng(13).integers(0, 3, size=(rows, classes)).astype(dtype)
    label = rng(14).integers(0, classes, rows).astype(np.int64)
    status = argmax.LabelStatus()
    got = device.get(argmax.accuracy(device.put(logits), device.put(label), status))
    assert got.dtype == np.float32 and got.shape == ()
    assert got == np.float32((np.argmax(logits, 1) == label).mean())
    status.check()


def test_accuracy_flags_bad_labels_and_empty_batches(device):
    from minigraph.kernels.cuda import argmax

    status = argmax.LabelStatus()
    logits = np.eye(4, dtype=np.float32)
    got = device.get(argmax.accuracy(device.put(logits), device.put(np.array([0, 1, 7, -1])),
                                     status))
    assert got == np.float32(0.5)
    with pytest.raises(ValueError, match=r"accuracy: input 'label' had 2 value\(s\) outside "
                                         r"\[0, K\), e.g. at row [23]"):
        status.check()
    status.check()                                   # reported once
    empty = argmax.accuracy(device.put(np.zeros((0, 4), np.float32)),
                            device.put(np.zeros(0, np.int64)), status)
    assert np.isnan(device.get(empty))
