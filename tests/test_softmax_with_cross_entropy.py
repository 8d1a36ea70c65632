"""softmax_with_cross_entropy."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

OP = "softmax_with_cross_entropy"
rng = np.random.default_rng(0)


def swce_reference(logits, label, label_smoothing=0.0):
    """Row by row with Python's math on float64: log-sum-exp around the row max; with
    label smoothing eps the cross entropy against the target (1 - eps) onehot + eps / K."""
    softmax = np.zeros_like(logits)
    loss = np.zeros(len(label))
    k = logits.shape[1]
    for i, row in enumerate(logits):
        m = row.max()
        lse = m + np.log(sum(np.exp(v - m) for v in row))
        softmax[i] = [np.exp(v - lse) for v in row]
        target = [label_smoothing / k + (1.0 - label_smoothing) * (c == label[i])
                  for c in range(k)]
        loss[i] = sum(t * (lse - v) for t, v in zip(target, row))
    return {"softmax": softmax, "loss": loss}


@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0])
def test_label_smoothing_forward_and_grad(eps):
    logits, label = rng.standard_normal((5, 4)) * 3, rng.integers(0, 4, 5)
    helper_test_op(OP, {"logits": logits, "label": label}, {"label_smoothing": eps},
                   swce_reference, grad_wrt=("logits",))
    helper_test_op(OP, {"logits": logits, "label": label}, {"label_smoothing": eps},
                   swce_reference, grad_wrt=("logits",), outputs=("loss",))


def test_label_smoothing_must_lie_in_0_1():
    scope = mg.Scope()
    with pytest.raises(mg.OpError, match="softmax_with_cross_entropy: attribute "
                                         "'label_smoothing' must be in \\[0.0, 1.0\\]"):
        mg.Operator(OP, logits=scope.new_var("z"), label=scope.new_var("y"),
                    softmax=scope.new_var("s"), loss=scope.new_var("l"), label_smoothing=1.5)


def test_forward_and_grad_through_loss_and_softmax():
    logits, label = rng.standard_normal((5, 4)), rng.integers(0, 4, 5)
    helper_test_op(OP, {"logits": logits, "label": label}, {}, swce_reference,
                   grad_wrt=("logits",))


def test_grad_through_loss_only():
    logits, label = rng.standard_normal((6, 3)), rng.integers(0, 3, 6)
    helper_test_op(OP, {"logits": logits, "label": label}, {}, swce_reference,
                   grad_wrt=("logits",), outputs=("loss",))


def test_large_logits_stay_finite():
    logits = np.array([[1e3, 0.0, -1e3], [0.0, 1e3, 999.0], [-1e3, -1e3, -1e3]], "float32")
    label = np.array([0, 2, 1])
    got = helper_test_op(OP, {"logits": logits, "label": label}, {}, swce_reference,
                         atol=1e-6, rtol=1e-6)
    assert np.all(np.isfinite(got["loss"])) and np.all(np.isfinite(got["softmax"]))
    np.testing.assert_allclose(got["loss"], [0.0, 1.0 + np.log1p(np.exp(-1.0)), np.log(3)],
                               rtol=1e-6)
    helper_test_op(OP, {"logits": logits.astype("f8"), "label": label}, {}, swce_reference,
                   grad_wrt=("logits",), outputs=("loss",))


def build(logits, label):
    scope = mg.Scope()
    lg, lb = scope.new_var("logits"), scope.new_var("label")
    lg.set(logits)
    lb.set(label)
    return scope, mg.Operator(OP, logits=lg, label=lb, softmax=scope.new_var("softmax"),
                              loss=scope.new_var("loss"))


@pytest.mark.parametrize("label, match", [
    (np.zeros(4, "int32"), "input 'label' must have dtype int64 .*got int32"),
    (np.zeros((4, 1), "int64"), r"input 'label' must have shape \(4,\) .*got \(4, 1\)"),
    (np.zeros(3, "int64"), r"input 'label' must have shape \(4,\)"),
])
def test_bad_label_at_build(label, match):
    with pytest.raises(mg.OpError, match=f"{OP}: " + match):
        build(np.zeros((4, 10)), label)


@pytest.mark.parametrize("bad", [10, -1])
def test_label_out_of_range_at_run(bad):
    scope, op = build(np.zeros((4, 10)), np.array([1, 2, bad, 3]))
    with pytest.raises(mg.OpError, match=rf"input 'label' has value {bad} at row 2, outside "
                                         r"\[0, 10\)"):
        mg.Executor().run([op], scope)


def test_logits_must_be_2d_float():
    with pytest.raises(mg.OpError, match="input 'logits' must have rank 2"):
        build(np.zeros((4, 10, 1)), np.zeros(4, "int64"))
    with pytest.raises(mg.OpError, match="input 'logits' must be a float tensor"):
        build(np.zeros((4, 10), "int64"), np.zeros(4, "int64"))
