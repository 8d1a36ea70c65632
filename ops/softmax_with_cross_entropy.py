"""softmax_with_cross_entropy: softmax of logits and the cross-entropy with hard labels.

logits (N, K) float, label (N,) int64 in [0, K) -> softmax (N, K),
loss (N,) = -log softmax[i, label[i]]. Computed from the row-max-shifted
logits with log-sum-exp in float64, so huge logits stay finite.
Grad w.r.t. logits: (softmax - onehot(label)) * dloss[:, None], plus the
softmax Jacobian applied to dsoftmax when the softmax output is used too.
The label has no gradient.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import loader
from minigraph.kernels import softmax_with_cross_entropy as gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpError, OpSchema, Slot, grad_maker, kernel, register
from minigraph.validators import check_float, check_rank, check_shape, fail

OP = "softmax_with_cross_entropy"


def infer_swce(ins, attrs):
    logits, label = ins["logits"], ins["label"]
    check_rank(OP, "logits", logits, (2,))
    check_float(OP, "logits", logits)
    if label.dtype != np.int64:
        fail(OP, "label", f"must have dtype int64 (class indices), got {label.dtype}")
    n = logits.shape[0]
    check_shape(OP, "label", label, (n,), f" (one class index per row of input 'logits' "
                                          f"with shape {logits.shape})")
    return {"softmax": Meta(logits.shape, logits.dtype), "loss": Meta((n,), logits.dtype)}


def check_labels(label, classes):
    """OpError naming the first label outside [0, classes)."""
    bad = np.flatnonzero((label < 0) | (label >= classes))
    if bad.size:
        i = int(bad[0])
        raise OpError(f"{OP}: input 'label' has value {int(label[i])} at row {i}, outside "
                      f"[0, {classes}) for logits with {classes} classes")


def infer_swce_grad(ins, attrs):
    sm = ins["softmax"]
    if ins["dloss"] is not None:
        check_shape(OP + "_grad", "dloss", ins["dloss"], sm.shape[:1], " (the shape of loss)")
    if ins["dsoftmax"] is not None:
        check_shape(OP + "_grad", "dsoftmax", ins["dsoftmax"], sm.shape,
                    " (the shape of softmax)")
    return {"dlogits": Meta(sm.shape, sm.dtype)}


register(OpSchema(
    type=OP, inputs=(Slot("logits"), Slot("label")), outputs=(Slot("softmax"), Slot("loss")),
    infer=infer_swce, doc=__doc__,
    grad=grad_maker(OP + "_grad", keep=("label", "softmax"), wrt=("logits",),
                    dout={"loss": "dloss", "softmax": "dsoftmax"})))
register(OpSchema(
    type=OP + "_grad",
    inputs=(Slot("label"), Slot("softmax"), Slot("dloss", optional=True),
            Slot("dsoftmax", optional=True)),
    outputs=(Slot("dlogits", optional=True),), infer=infer_swce_grad))


@kernel(OP, "cpu")
def softmax_with_cross_entropy_cpu(op, ins, ctx):
    """softmax = exp(z - lse(z)), loss = lse(z) - z[label], z the logits shifted by the row max."""
    logits, label = ins["logits"], ins["label"]
    check_labels(label, logits.shape[1])
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -log_softmax[np.arange(logits.shape[0]), label]
    return {"softmax": np.exp(log_softmax).astype(logits.dtype),
            "loss": loss.astype(logits.dtype)}


@kernel(OP + "_grad", "cpu")
def softmax_with_cross_entropy_grad_cpu(op, ins, ctx):
    """dlogits = (softmax - onehot(label)) * dloss[:, None]
    + softmax * (dsoftmax - sum(dsoftmax * softmax, axis=1))."""
    sm, label = ins["softmax"], ins["label"]
    dloss, dsoftmax = ins["dloss"], ins["dsoftmax"]
    dlogits = np.zeros(sm.shape, dtype=np.float64)
    if dloss is not None:
        check_labels(label, sm.shape[1])
        dlogits += sm
        dlogits[np.arange(sm.shape[0]), label] -= 1.0
        dlogits *= dloss[:, None]
    if dsoftmax is not None:
        inner = np.einsum("ij,ij->i", dsoftmax, sm, dtype=np.float64)[:, None]
        dlogits += sm * (dsoftmax - inner)
    return {"dlogits": dlogits.astype(sm.dtype)}


def label_status(what):
    """The device-side record of out-of-range labels met by the `what` kernels;
    the place's check_errors() (at fetch time) raises for them."""
    return loader.error_flag(what, gpu.LabelStatus)


@kernel(OP, "gpu", dtypes=GPU_FLOATS)
def softmax_with_cross_entropy_gpu(op, ins, ctx):
    """softmax and loss on the device, from the max-shifted logits in double.
    A label outside [0, K) gets loss NaN and is flagged on the device; the
    error raises at the next fetch (see minigraph.place), not here."""
    logits, label = ins["logits"], ins["label"]
    softmax, loss = gpu.forward(logits, label, label_status(OP))
    return {"softmax": softmax, "loss": loss}


@kernel(OP + "_grad", "gpu", dtypes=GPU_FLOATS)
def softmax_with_cross_entropy_grad_gpu(op, ins, ctx):
    """dlogits on the device, from the terms whose incoming gradient is bound;
    nothing when dlogits is unbound."""
    sm, label = ins["softmax"], ins["label"]
    dloss, dsoftmax = ins["dloss"], ins["dsoftmax"]
    if not op.wants("dlogits"):
        return {}
    return {"dlogits": gpu.grad(label, sm, dloss, dsoftmax, label_status(op.type))}
