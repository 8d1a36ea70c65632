"""argmax and accuracy: indices and a score, no gradients.

argmax(x; axis=-1):       out = np.argmax(x, axis) as int64 (the first maximum on
                          ties), x's shape without `axis`; x float, rank >= 1.
accuracy(logits, label):  out = the fraction (float32, shape ()) of rows i where
                          argmax(logits[i]) == label[i] (first maximum on ties);
                          logits (N, K) float, label (N,) int64 in [0, K) (a label
                          outside is an error naming 'label'); N == 0 gives NaN.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import argmax as gpu
from minigraph.kernels import loader
from minigraph.ops.axis import normalized_axis
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpError, OpSchema, Slot, kernel, register
from minigraph.validators import check_float, check_rank, check_shape, fail, int_attr


def infer_argmax(ins, attrs):
    x = ins["x"]
    check_float("argmax", "x", x)
    if len(x.shape) == 0:
        fail("argmax", "x", "must have rank >= 1, got a scalar (shape ())")
    ax = normalized_axis("argmax", attrs["axis"], len(x.shape))
    if x.shape[ax] == 0:
        fail("argmax", "x", f"has no values along axis {attrs['axis']} (shape {x.shape}); "
                            "its argmax is undefined")
    return {"out": Meta(x.shape[:ax] + x.shape[ax + 1:], np.dtype(np.int64))}


def infer_accuracy(ins, attrs):
    logits, label = ins["logits"], ins["label"]
    check_rank("accuracy", "logits", logits, (2,))
    check_float("accuracy", "logits", logits)
    if label.dtype != np.int64:
        fail("accuracy", "label", f"must have dtype int64 (class indices), got {label.dtype}")
    check_shape("accuracy", "label", label, logits.shape[:1],
                f" (one class index per row of input 'logits' with shape {logits.shape})")
    return {"out": Meta((), np.dtype(np.float32))}


register(OpSchema(type="argmax", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  attrs=(int_attr("axis", -1),), infer=infer_argmax, doc=__doc__))
register(OpSchema(type="accuracy", inputs=(Slot("logits"), Slot("label")),
                  outputs=(Slot("out"),), infer=infer_accuracy, doc=__doc__))


@kernel("argmax", "cpu")
def argmax_cpu(op, ins, ctx):
    """out = np.argmax(x, axis) as int64."""
    return {"out": np.argmax(ins["x"], axis=op.attrs["axis"]).astype(np.int64)}


@kernel("accuracy", "cpu")
def accuracy_cpu(op, ins, ctx):
    """out = mean(argmax(logits, 1) == label) as a float32 scalar; NaN for no rows."""
    logits, label = ins["logits"], ins["label"]
    classes = logits.shape[1]
    bad = np.flatnonzero((label < 0) | (label >= classes))
    if bad.size:
        i = int(bad[0])
        raise OpError(f"accuracy: input 'label' has value {int(label[i])} at row {i}, outside "
                      f"[0, {classes}) for logits with {classes} classes")
    if label.size == 0:
        return {"out": np.array(np.nan, dtype=np.float32)}
    hits = np.count_nonzero(np.argmax(logits, axis=1) == label)
    return {"out": np.array(hits / label.size, dtype=np.float32)}


# ---- GPU bindings: kernels/argmax.cu ----

@kernel("argmax", "gpu", dtypes=GPU_FLOATS)
def argmax_gpu(op, ins, ctx):
    """out = the first maximum's index along axis (int64), on the device."""
    return {"out": gpu.argmax(ins["x"], op.attrs["axis"])}


@kernel("accuracy", "gpu", dtypes=GPU_FLOATS)
def accuracy_gpu(op, ins, ctx):
    """out = the fraction of rows whose argmax is the label (float32), on the device.
    A label outside [0, K) is flagged there and raises at the next fetch."""
    status = loader.error_flag("accuracy", gpu.LabelStatus)
    return {"out": gpu.accuracy(ins["logits"], ins["label"], status)}
