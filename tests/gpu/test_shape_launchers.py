"""kernels/cuda/shape_ops.py against numpy, on the emulator and (marked gpu) a real GPU:
copies and reshapes of any 1-8 byte dtype (aligned and offset), concat and its
slices, transpose and back."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import rng

from minigraph.kernels.cuda import shape_ops


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.float16,
                                   np.int32, np.bool_])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_copy_and_reshape_any_dtype(device, dtype, offset):
    x = (rng(5).normal(size=(5, 7)) * 100).astype(dtype)
    np.testing.assert_array_equal(device.get(shape_ops.copy(device.put(x, offset))), x)
    np.testing.assert_array_equal(device.get(shape_ops.reshape(device.put(x, offset), (7, 5))),
                                  x.reshape(7, 5))
    with pytest.raises(ValueError, match=r"reshape: cannot reshape \(5, 7\) \(35 values\)"):
        shape_ops.reshape(device.put(x), (6, 6))


@pytest.mark.parametrize("shapes,axis", [([(2, 3, 4), (2, 5, 4)], 1), ([(3, 4), (3, 4), (3, 8)], -1),
                                         ([(1, 4), (6, 4), (2, 4)], 0), ([(7,)], 0),
                                         ([(2, 0, 3), (2, 2, 3)], 1), ([(2, 2, 5), (2, 3, 5)], -2)],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_concat_and_its_slices(device, shapes, axis, dtype):
    xs = [(rng(i).normal(size=s) * 10).astype(dtype) for i, s in enumerate(shapes)]
    want = np.concatenate(xs, axis)
    out = shape_ops.concat([device.put(x) for x in xs], axis)
    np.testing.assert_array_equal(device.get(out), want)
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(device.get(shape_ops.concat_slice(out, shapes, axis, i)), x)


def test_concat_packs_and_offsets(device):
    xs = [rng(i).normal(size=(3, 8)).astype(np.float32) for i in range(3)]
    for offset in (0, 1, 2):
        out = shape_ops.concat([device.put(x, offset) for x in xs], 1)
        np.testing.assert_array_equal(device.get(out), np.concatenate(xs, 1))
    with pytest.raises(ValueError, match=r"concat: input 1 has shape \(3, 7\), input 0 has "
                                         r"\(3, 8\); they must agree on every dim but axis 0"):
        shape_ops.concat([device.put(xs[0]), device.put(np.ones((3, 7), np.float32))], 0)
    with pytest.raises(ValueError, match="axis 2 is out of range for rank 2"):
        shape_ops.concat([device.put(xs[0])], 2)


@pytest.mark.parametrize("shape,perm", [((3, 4), (1, 0)), ((2, 3, 4), (2, 0, 1)),
                                        ((2, 3, 4, 5), (0, 2, 1, 3)), ((5, 1, 7), (2, 1, 0)),
                                        ((2, 3, 4), (0, 1, 2)), ((2, 2, 2, 2, 2, 2), (5, 3, 1, 4, 2, 0))],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8])
def test_transpose_and_back(device, shape, perm, dtype):
    x = (rng(6).normal(size=shape) * 50).astype(dtype)
    out = shape_ops.transpose(device.put(x), perm)
    np.testing.assert_array_equal(device.get(out), x.transpose(perm))
    back = shape_ops.transpose(out, tuple(np.argsort(perm)))
    np.testing.assert_array_equal(device.get(back), x)


def test_transpose_checks_the_permutation(device):
    with pytest.raises(ValueError, match=r"perm \(0, 0\) is not a permutation"):
        shape_ops.transpose(device.put(np.ones((2, 3))), (0, 0))
