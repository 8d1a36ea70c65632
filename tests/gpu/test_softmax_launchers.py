"""kernels/cuda/softmax.py and kernels/cuda/softmax_with_cross_entropy.py against the float64
references, on the emulator and (marked gpu) a real GPU: softmax and its grad
along any axis, NaN and extreme logits; softmax with cross entropy, its grad with
and without d(softmax), label smoothing (0: the unsmoothed bits), bad labels flagged
on the device and raised once."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng
from references import softmax as softmax_ref


@pytest.mark.parametrize("shape,axis", [((5, 10), -1), ((3, 1000), 1), ((4, 7, 5), 1),
                                        ((2, 3, 4, 5), 0), ((6,), 0), ((3, 1), -1), ((1, 6, 2), -2)],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_and_grad_along_any_axis(device, shape, axis, dtype):
    from minigraph.kernels.cuda import softmax

    x = (rng(9).normal(size=shape) * 20).astype(dtype)
    out = softmax.softmax(device.put(x), axis)
    want = softmax_ref(x, axis)
    assert rel_err(device.get(out), want) < TOL[dtype]
    d = rng(10).normal(size=shape).astype(dtype)
    o = device.get(out).astype(np.float64)
    dot = (d * o).sum(axis=axis, keepdims=True)
    want_dx, terms = o * (d - dot), o * (abs(d) + abs(dot))
    got = device.get(softmax.softmax_grad(out, device.put(d), axis))
    assert rel_err(got, want_dx, terms) < TOL[dtype]


def test_softmax_nan_and_extremes(device):
    from minigraph.kernels.cuda import softmax

    x = np.array([[1.0, np.nan, 2.0], [1000.0, -1000.0, 1000.0]], np.float32)
    for axis in (1, 0):
        got = device.get(softmax.softmax(device.put(x), axis))
        with np.errstate(invalid="ignore"):
            np.testing.assert_allclose(got, softmax_ref(x, axis), rtol=1e-6)


@pytest.mark.parametrize("rows,classes", [(5, 10), (3, 1000), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_with_cross_entropy(device, rows, classes, dtype):
    from minigraph.kernels.cuda import softmax_with_cross_entropy as swce

    r = rng(15)
    logits = (r.normal(size=(rows, classes)) * 30).astype(dtype)
    label = r.integers(0, classes, rows).astype(np.int64)
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    status = swce.LabelStatus()
    sm, loss = swce.forward(device.put(logits), device.put(label), status)
    assert rel_err(device.get(sm), np.exp(logp)) < TOL[dtype]
    assert rel_err(device.get(loss), -logp[np.arange(rows), label]) < TOL[dtype]
    dloss, dsm = r.normal(size=rows).astype(dtype), r.normal(size=(rows, classes)).astype(dtype)
    p = np.exp(logp)
    onehot = np.eye(classes)[label]
    want = (p - onehot) * dloss[:, None] + p * (dsm - (dsm * p).sum(axis=1, keepdims=True))
    got = swce.grad(device.put(label), sm, device.put(dloss), device.put(dsm), status)
    assert rel_err(device.get(got), want) < TOL[dtype] * 10
    got = swce.grad(device.put(label), sm, device.put(dloss), None, status)
    assert rel_err(device.get(got), (p - onehot) * dloss[:, None]) < TOL[dtype] * 10
    status.check()


@pytest.mark.parametrize("rows,classes", [(5, 10), (3, 1000), (2, 1)])
@pytest.mark.parametrize("eps", [0.1, 1.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_label_smoothing(device, rows, classes, eps, dtype):
    from minigraph.kernels.cuda import softmax_with_cross_entropy as swce

    r = rng(16)
    logits = (r.normal(size=(rows, classes)) * 30).astype(dtype)
    label = r.integers(0, classes, rows).astype(np.int64)
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    target = (1 - eps) * np.eye(classes)[label] + eps / classes
    status = swce.LabelStatus()
    sm, loss = swce.forward(device.put(logits), device.put(label), status, label_smoothing=eps)
    assert rel_err(device.get(loss), -(target * logp).sum(axis=1)) < TOL[dtype] * 10
    dloss = r.normal(size=rows).astype(dtype)
    got = swce.grad(device.put(label), sm, device.put(dloss), None, status, label_smoothing=eps)
    assert rel_err(device.get(got), (np.exp(logp) - target) * dloss[:, None]) < TOL[dtype] * 10
    plain = swce.forward(device.put(logits), device.put(label), status)
    zero = swce.forward(device.put(logits), device.put(label), status, label_smoothing=0.0)
    for a, b in zip(plain, zero, strict=True):
        np.testing.assert_array_equal(device.get(a), device.get(b))
    status.check()


def test_bad_labels_are_flagged_not_hidden(device):
    from minigraph.kernels.cuda import softmax_with_cross_entropy as swce

    status = swce.LabelStatus()
    _, loss = swce.forward(device.put(np.zeros((3, 4), np.float32)),
                           device.put(np.array([0, 4, 1], np.int64)), status)
    got = device.get(loss)
    assert np.isnan(got[1]) and np.isfinite(got[[0, 2]]).all()
    with pytest.raises(ValueError, match=r"1 value\(s\) outside \[0, K\), e.g. at row 1"):
        status.check()
    status.check()
