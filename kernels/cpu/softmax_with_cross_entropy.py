"""CPU kernels of softmax_with_cross_entropy (ops/softmax_with_cross_entropy.py):
log-sum-exp of the row-max-shifted logits in float64; a label outside [0, K) is an
error naming it. Float32 logits with hard labels run swce_native's one pass a row
(the same arithmetic) where it applies.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import swce_native
from minigraph.schema import OpError


def check_labels(label, classes):
    """OpError naming the first label outside [0, classes)."""
    bad = np.flatnonzero((label < 0) | (label >= classes))
    if bad.size:
        i = int(bad[0])
        raise OpError(f"softmax_with_cross_entropy: input 'label' has value {int(label[i])} "
                      f"at row {i}, outside [0, {classes}) for logits with {classes} classes")


def softmax_with_cross_entropy_cpu(op, ins, ctx):
    """softmax = exp(z - lse(z)), loss = lse(z) - z[label], z the logits shifted by the row
    max; with label_smoothing eps, loss = (1 - eps) (lse(z) - z[label]) + eps mean_k(lse(z) -
    z[k])."""
    logits, label = ins["logits"], ins["label"]
    done = swce_native.forward(logits, label, op.attrs["label_smoothing"])
    if done is not None:
        return done
    check_labels(label, logits.shape[1])
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -log_softmax[np.arange(logits.shape[0]), label]
    eps = op.attrs["label_smoothing"]
    if eps:                     # the target (1 - eps) onehot + eps / K, as torch's
        loss = (1.0 - eps) * loss - eps * log_softmax.mean(axis=1)
    return {"softmax": np.exp(log_softmax).astype(logits.dtype),
            "loss": loss.astype(logits.dtype)}


def softmax_with_cross_entropy_grad_cpu(op, ins, ctx):
    """dlogits = (softmax - target) * dloss[:, None]
    + softmax * (dsoftmax - sum(dsoftmax * softmax, axis=1)), target the smoothed
    onehot (1 - eps) onehot(label) + eps / K."""
    sm, label = ins["softmax"], ins["label"]
    dloss, dsoftmax = ins["dloss"], ins["dsoftmax"]
    if dloss is not None and dsoftmax is None:
        done = swce_native.backward(sm, label, dloss, op.attrs["label_smoothing"])
        if done is not None:
            return done
    dlogits = np.zeros(sm.shape, dtype=np.float64)
    if dloss is not None:
        check_labels(label, sm.shape[1])
        eps = op.attrs["label_smoothing"]
        dlogits += sm
        dlogits -= eps / sm.shape[1]
        dlogits[np.arange(sm.shape[0]), label] -= 1.0 - eps
        dlogits *= dloss[:, None]
    if dsoftmax is not None:
        inner = np.einsum("ij,ij->i", dsoftmax, sm, dtype=np.float64)[:, None]
        dlogits += sm * (dsoftmax - inner)
    return {"dlogits": dlogits.astype(sm.dtype)}
