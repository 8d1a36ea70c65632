"""The native softmax_with_cross_entropy kernels (kernels/cpu/swce_native.c) against the
numpy kernels, their reference: the same bits for softmax, loss and dlogits over row
lengths that take each of numpy's summing orders, with label smoothing, huge and
non-finite logits, on 1-3 threads; where they do not apply, None; and the op's
kernels taking them, a bad label still named by the numpy check."""
from types import SimpleNamespace

import numpy as np
import pytest

from minigraph.kernels.cpu import blocks, native, swce_native
from minigraph.kernels.cpu import softmax_with_cross_entropy as kernel
from minigraph.schema import OpError

rng = np.random.default_rng(29)

pytestmark = pytest.mark.skipif(
    not swce_native.available(),
    reason=f"native kernels not built: {native.reason('swce_native')}")

# below 8 values, blocks of 8 (with and without a rest), pairwise halves above 128
SHAPES = [(1, 1), (5, 3), (64, 10), (7, 8), (3, 17), (33, 130), (4, 1000), (2, 4099)]


def op(eps):
    return SimpleNamespace(attrs={"label_smoothing": eps})


def numpy_kernels(monkeypatch):
    """The op's kernels with the native ones off (forward, grad)."""
    def forward(logits, label, eps):
        with monkeypatch.context() as m:
            m.setattr(swce_native, "forward", lambda *a: None)
            return kernel.softmax_with_cross_entropy_cpu(
                op(eps), {"logits": logits, "label": label}, None)

    def grad(sm, label, dloss, eps):
        with monkeypatch.context() as m:
            m.setattr(swce_native, "backward", lambda *a: None)
            return kernel.softmax_with_cross_entropy_grad_cpu(
                op(eps), {"softmax": sm, "label": label, "dloss": dloss, "dsoftmax": None},
                None)
    return forward, grad


def same_bits(got, want):
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def logits_of(shape, scale=4.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("eps", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_same_bits_as_numpy(shape, eps, threads, monkeypatch):
    forward, grad = numpy_kernels(monkeypatch)
    monkeypatch.setattr(swce_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    logits, label = logits_of(shape), rng.integers(0, shape[1], shape[0])
    want = forward(logits, label, eps)
    got = swce_native.forward(logits, label, eps)
    same_bits(got["softmax"], want["softmax"])
    same_bits(got["loss"], want["loss"])
    dloss = rng.standard_normal(shape[0]).astype(np.float32)
    same_bits(swce_native.backward(want["softmax"], label, dloss, eps)["dlogits"],
              grad(want["softmax"], label, dloss, eps)["dlogits"])


def test_huge_and_non_finite_logits_give_numpy_values(monkeypatch):
    forward, grad = numpy_kernels(monkeypatch)
    big = np.finfo(np.float32).max
    logits = np.array([[big, 0.0, -big], [np.inf, 1.0, 2.0], [-np.inf, -np.inf, -np.inf],
                       [1.0, np.nan, 2.0], [np.nan, 0.0, 0.0], [1e-42, -0.0, 0.0]], np.float32)
    label = np.array([0, 1, 2, 0, 1, 2])
    with np.errstate(invalid="ignore", over="ignore"):
        want = forward(logits, label, 0.2)
        got = swce_native.forward(logits, label, 0.2)
    for name in ("softmax", "loss"):
        same_bits(got[name], want[name])
    dloss = np.array([1.0, np.inf, -0.0, np.nan, 2.0, -1.0], np.float32)
    sm = np.nan_to_num(want["softmax"])
    with np.errstate(invalid="ignore"):
        same_bits(swce_native.backward(sm, label, dloss, 0.2)["dlogits"],
                  grad(sm, label, dloss, 0.2)["dlogits"])


def test_where_they_do_not_apply_none():
    logits, label = logits_of((6, 4)), rng.integers(0, 4, 6)
    dloss = np.ones(6, np.float32)
    sm = np.full((6, 4), 0.25, np.float32)
    forward_cases = [
        (logits.astype(np.float64), label),              # not float32
        (logits[:, ::2], label),                          # not contiguous
        (logits, label.astype(np.int32)),                 # labels not int64
        (logits, label[::2]),                             # one label a row
        (np.empty((6, 0), np.float32), label),            # no classes
    ]
    for bad in (-1, 4):                                   # a label outside [0, 4)
        wrong = label.copy()
        wrong[3] = bad
        forward_cases.append((logits, wrong))
    for lg, lb in forward_cases:
        assert swce_native.forward(lg, lb, 0.0) is None
        k = lg.shape[1]
        if lg.dtype == np.float32 and lg.flags.c_contiguous and k:
            assert swce_native.backward(np.full(lg.shape, 1.0 / k, np.float32), lb, dloss,
                                        0.0) is None
    assert swce_native.backward(sm, label, dloss.astype(np.float64), 0.0) is None
    assert swce_native.backward(sm, label, dloss[:3], 0.0) is None


def test_the_op_kernels_take_them_and_a_bad_label_is_named(monkeypatch):
    logits, label = logits_of((8, 5)), rng.integers(0, 5, 8)
    calls = []
    for name in ("forward", "backward"):
        real = getattr(swce_native, name)
        monkeypatch.setattr(swce_native, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    out = kernel.softmax_with_cross_entropy_cpu(op(0.0), {"logits": logits, "label": label},
                                                None)
    kernel.softmax_with_cross_entropy_grad_cpu(
        op(0.0), {"softmax": out["softmax"], "label": label,
                  "dloss": np.ones(8, np.float32), "dsoftmax": None}, None)
    assert calls == ["forward", "backward"]
    kernel.softmax_with_cross_entropy_grad_cpu(            # through softmax too: numpy's
        op(0.0), {"softmax": out["softmax"], "label": label,
                  "dloss": np.ones(8, np.float32), "dsoftmax": np.ones((8, 5), np.float32)},
        None)
    assert calls == ["forward", "backward"]
    label[5] = 7
    with pytest.raises(OpError, match="input 'label' has value 7 at row 5, outside \\[0, 5\\)"):
        kernel.softmax_with_cross_entropy_cpu(op(0.0), {"logits": logits, "label": label}, None)
    with pytest.raises(OpError, match="input 'label' has value 7 at row 5"):
        kernel.softmax_with_cross_entropy_grad_cpu(
            op(0.0), {"softmax": out["softmax"], "label": label,
                      "dloss": np.ones(8, np.float32), "dsoftmax": None}, None)
