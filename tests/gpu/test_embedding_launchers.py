"""kernels/cuda/embedding.py against numpy, on the emulator and (marked gpu) a real GPU:
the gather and the table's gradient (repeated ids summed in double, the padding
row 0), empty ids, and ids outside the table flagged on the device and raised once
(by the launcher's IdStatus, and by the Executor as an error naming 'ids')."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng

import minigraph as mg
from minigraph.kernels.cuda import embedding as emb


@pytest.mark.parametrize("ids_shape,rows,dim", [((3, 4), 7, 5), ((50,), 3, 33), ((2, 3, 2), 1, 1),
                                                ((), 4, 6)], ids=str)
@pytest.mark.parametrize("padding", [-1, 0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gather_and_scatter_add(device, ids_shape, rows, dim, padding, dtype):
    r = rng(3)
    ids = r.integers(0, rows, ids_shape).astype(np.int64)
    w = r.normal(size=(rows, dim)).astype(dtype)
    status = emb.IdStatus()
    out = device.get(emb.embedding(device.put(ids), device.put(w), status))
    np.testing.assert_array_equal(out, w[ids])
    d = r.normal(size=ids_shape + (dim,)).astype(dtype)
    want = np.zeros((rows, dim))
    np.add.at(want, ids.reshape(-1), d.reshape(-1, dim).astype(np.float64))
    if padding >= 0:
        want[padding] = 0
    dw = device.get(emb.embedding_grad(device.put(ids), (rows, dim), device.put(d), padding,
                                       status))
    assert dw.dtype == dtype and dw.shape == (rows, dim)
    assert rel_err(dw, want) < TOL[dtype]
    status.check()


def test_float32_gradients_add_in_double(device):
    ids = np.zeros(100001, np.int64)
    d = np.full((100001, 2), 0.1, np.float32)
    d[0] = 1e6
    dw = device.get(emb.embedding_grad(device.put(ids), (2, 2), device.put(d)))
    np.testing.assert_allclose(dw[0], d.astype(np.float64).sum(axis=0), rtol=1e-7)
    np.testing.assert_array_equal(dw[1], [0, 0])


def test_empty_ids_and_unused_rows(device):
    ids = np.zeros((0, 2), np.int64)
    w = np.ones((3, 4), np.float32)
    assert device.get(emb.embedding(device.put(ids), device.put(w))).shape == (0, 2, 4)
    dw = emb.embedding_grad(device.put(ids), (3, 4), device.put(np.zeros((0, 2, 4), np.float32)))
    np.testing.assert_array_equal(device.get(dw), np.zeros((3, 4)))


def test_bad_ids_are_flagged_not_hidden(device):
    status = emb.IdStatus()
    ids = device.put(np.array([[0, 5], [-1, 2]], np.int64))
    out = device.get(emb.embedding(ids, device.put(np.ones((3, 2), np.float32)), status))
    assert np.isnan(out[0, 1]).all() and np.isnan(out[1, 0]).all()
    assert np.isfinite(out[[0, 1], [0, 1]]).all()
    with pytest.raises(mg.OpError, match=r"embedding: input 'ids' had 2 value\(s\) outside "
                                         r"\[0, 3\) for a table of 3 rows, e.g. at flat "
                                         r"position [12]"):
        status.check()
    status.check()                                       # reported once
    dw = emb.embedding_grad(ids, (3, 2), device.put(np.ones((2, 2, 2))), status=status)
    np.testing.assert_array_equal(device.get(dw), [[1, 1], [0, 0], [1, 1]])
    with pytest.raises(mg.OpError, match="2 value"):
        status.check("embedding_grad")


def test_a_step_with_bad_ids_raises_naming_ids(device_place):
    scope = mg.Scope()
    ids, w, out = scope.new_var("ids"), scope.new_var("w"), scope.new_var("out")
    w.set(device_place.to_device(np.ones((4, 3), np.float32)))
    op = mg.Operator("embedding", ids=ids, w=w, out=out)
    ex = mg.Executor(device_place)
    ids.set(device_place.to_device(np.array([1, 4, 0], np.int64)))
    with pytest.raises(mg.OpError, match=r"embedding: input 'ids' had 1 value\(s\) outside "
                                         r"\[0, 4\).*position 1"):
        ex.run([op], scope, fetch=[out])
    ids.set(device_place.to_device(np.array([1, 3, 0], np.int64)))
    (got,) = ex.run([op], scope, fetch=[out])
    np.testing.assert_array_equal(got, np.ones((3, 3)))
