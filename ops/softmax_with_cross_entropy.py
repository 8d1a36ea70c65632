"""softmax_with_cross_entropy: softmax of logits and the cross-entropy with hard labels.

logits (N, K) float, label (N,) int64 in [0, K) -> softmax (N, K),
loss (N,) = -log softmax[i, label[i]]. Computed from the row-max-shifted
logits with log-sum-exp in float64, so huge logits stay finite.
Grad w.r.t. logits: (softmax - onehot(label)) * dloss[:, None], plus the
softmax Jacobian applied to dsoftmax when the softmax output is used too.
With label_smoothing eps (torch's CrossEntropyLoss(label_smoothing=eps)) the target
is (1 - eps) onehot(label) + eps / K: loss = (1 - eps) (-log softmax[label]) + eps
mean_k(-log softmax[k]), and the onehot of the gradient becomes that target.
The label has no gradient. Kernels: kernels/cpu/softmax_with_cross_entropy.py,
kernels/cuda/softmax_with_cross_entropy.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import softmax_with_cross_entropy as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import softmax_with_cross_entropy as cuda
from minigraph.schema import Meta, OpSchema, Slot, examples, grad_maker, kernel, register
from minigraph.validators import check_float, check_rank, check_shape, fail, float_attr, in_range

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


def infer_swce_grad(ins, attrs):
    sm = ins["softmax"]
    if ins["dloss"] is not None:
        check_shape(OP + "_grad", "dloss", ins["dloss"], sm.shape[:1], " (the shape of loss)")
    if ins["dsoftmax"] is not None:
        check_shape(OP + "_grad", "dsoftmax", ins["dsoftmax"], sm.shape,
                    " (the shape of softmax)")
    return {"dlogits": Meta(sm.shape, sm.dtype)}


def export_swce(ctx, op):
    """softmax = Softmax(logits, axis 1); loss = -GatherElements(LogSoftmax(logits),
    label[:, None], axis 1)[:, 0]. Only the outputs used downstream are made."""
    logits, label = ctx.value(op.inputs["logits"]), op.inputs["label"]
    sm, loss = op.outputs["softmax"], op.outputs["loss"]
    nodes = []
    if ctx.wants(sm):
        nodes.append(ctx.node("Softmax", [logits], [ctx.output(sm)], axis=1))
    if ctx.wants(loss):
        logp, idx, picked, picked1 = (ctx.temp(loss, s) for s in
                                      ("log_softmax", "label_col", "picked", "picked_flat"))
        axis1 = ctx.const(loss, "axis1", np.array([1], np.int64))
        nodes += [ctx.node("LogSoftmax", [logits], [logp], axis=1),
                  ctx.node("Unsqueeze", [ctx.value(label), axis1], [idx]),
                  ctx.node("GatherElements", [logp, idx], [picked], axis=1),
                  ctx.node("Squeeze", [picked, axis1], [picked1])]
        eps = float(op.attrs["label_smoothing"])
        if not eps:
            return nodes + [ctx.node("Neg", [picked1], [ctx.output(loss)])]
        dt = ctx.dtype(op.inputs["logits"])
        k = ctx.shape(op.inputs["logits"])[1]
        total, kept, spread = (ctx.temp(loss, s) for s in ("sum_log_softmax", "kept", "spread"))
        nodes += [ctx.node("ReduceSum", [logp, axis1], [total], keepdims=0),
                  ctx.node("Mul", [picked1, ctx.const(loss, "kept_weight",
                                                      np.array(eps - 1.0, dt))], [kept]),
                  ctx.node("Mul", [total, ctx.const(loss, "spread_weight",
                                                    np.array(-eps / k, dt))], [spread]),
                  ctx.node("Add", [kept, spread], [ctx.output(loss)])]
    return nodes


ATTRS = (float_attr("label_smoothing", 0.0, in_range(0.0, 1.0)),)
register(OpSchema(
    type=OP, inputs=(Slot("logits"), Slot("label")), outputs=(Slot("softmax"), Slot("loss")),
    attrs=ATTRS, infer=infer_swce, export=export_swce, doc=__doc__,
    grad=grad_maker(OP + "_grad", keep=("label", "softmax"), wrt=("logits",),
                    dout={"loss": "dloss", "softmax": "dsoftmax"})))
register(OpSchema(
    type=OP + "_grad",
    inputs=(Slot("label"), Slot("softmax"), Slot("dloss", optional=True),
            Slot("dsoftmax", optional=True)),
    outputs=(Slot("dlogits", optional=True),), attrs=ATTRS, infer=infer_swce_grad,
    no_export="a gradient op (training only)"))

kernel(OP, "cpu", cpu.softmax_with_cross_entropy_cpu)
kernel(OP + "_grad", "cpu", cpu.softmax_with_cross_entropy_grad_cpu)
kernel(OP, "gpu", cuda.softmax_with_cross_entropy_gpu, dtypes=GPU_FLOATS)
kernel(OP + "_grad", "gpu", cuda.softmax_with_cross_entropy_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def softmax_with_cross_entropy_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"logits": ex.r(5, 7) * 10, "label": ex.labels(5, 7)}, {}, (("logits",),)),
        ("f64", {"logits": ex.r(4, 3, dtype=np.float64), "label": ex.labels(4, 3)},
         {}, (("logits",),)),
        ("smoothed-f32", {"logits": ex.r(6, 5) * 4, "label": ex.labels(6, 5)},
         dict(label_smoothing=0.1), (("logits",),)),
    ]


examples("softmax_with_cross_entropy", softmax_with_cross_entropy_examples)
