"""argmax and accuracy: indices and a score, no gradients.

argmax(x; axis=-1):       out = np.argmax(x, axis) as int64 (the first maximum on
                          ties), x's shape without `axis`; x float, rank >= 1.
accuracy(logits, label):  out = the fraction (float32, shape ()) of rows i where
                          argmax(logits[i]) == label[i] (first maximum on ties);
                          logits (N, K) float, label (N,) int64 in [0, K) (a label
                          outside is an error naming 'label'); N == 0 gives NaN.
Kernels: kernels/cpu/metrics.py, kernels/cuda/argmax.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import metrics as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import argmax as cuda
from minigraph.schema import Meta, OpSchema, Slot, examples, kernel, register
from minigraph.validators import (
    check_float,
    check_rank,
    check_shape,
    fail,
    int_attr,
    normalized_axis,
)


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


def export_argmax(ctx, op):
    """ArgMax along `axis`, keepdims=0, the first maximum, int64."""
    return [ctx.node("ArgMax", [ctx.value(op.inputs["x"])], [ctx.output(op.outputs["out"])],
                     axis=int(op.attrs["axis"]), keepdims=0)]


def export_accuracy(ctx, op):
    """ReduceMean(Cast(Equal(ArgMax(logits, axis 1), label), float32)): a scalar."""
    out = op.outputs["out"]
    pred, hit, hits = (ctx.temp(out, s) for s in ("argmax", "equal", "float"))
    return [ctx.node("ArgMax", [ctx.value(op.inputs["logits"])], [pred], axis=1, keepdims=0),
            ctx.node("Equal", [pred, ctx.value(op.inputs["label"])], [hit]),
            ctx.node("Cast", [hit], [hits], to=ctx.onnx.TensorProto.FLOAT),
            ctx.node("ReduceMean", [hits], [ctx.output(out)], keepdims=0)]


register(OpSchema(type="argmax", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  attrs=(int_attr("axis", -1),), infer=infer_argmax, export=export_argmax,
                  doc=__doc__))
register(OpSchema(type="accuracy", inputs=(Slot("logits"), Slot("label")),
                  outputs=(Slot("out"),), infer=infer_accuracy, export=export_accuracy,
                  doc=__doc__))


kernel("argmax", "cpu", cpu.argmax_cpu)
kernel("accuracy", "cpu", cpu.accuracy_cpu)
kernel("argmax", "gpu", cuda.argmax_gpu, dtypes=GPU_FLOATS)
kernel("accuracy", "gpu", cuda.accuracy_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def argmax_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("last-f32", {"x": ex.r(6, 9)}, {}, ()),
        ("mid-f64", {"x": ex.r(3, 5, 4, dtype=np.float64)}, dict(axis=1), ()),
    ]


def accuracy_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"logits": ex.r(20, 4), "label": ex.labels(20, 4)}, {}, ()),
        ("f64", {"logits": ex.r(7, 3, dtype=np.float64), "label": ex.labels(7, 3)}, {}, ()),
    ]


examples("argmax", argmax_examples)
examples("accuracy", accuracy_examples)
