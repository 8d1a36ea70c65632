"""sigmoid_cross_entropy_with_logits: binary cross entropy of sigmoid(x) against a
float label in [0, 1], elementwise, in its stable form (torch's BCEWithLogitsLoss
with reduction='none'):
    out = max(x, 0) - x * label + log(1 + exp(-|x|))
grad(x, label, dout): dx = dout * (sigmoid(x) - label), dlabel = -dout * x.
x and label have one shape and float dtype. In ONNX: Relu(x) - x * label +
Log(1 + Exp(-Abs(x))). (The other losses of layers.loss are compositions of
elementwise ops.) Kernels: kernels/cpu/loss.py, kernels/cuda/loss.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import loss as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import loss as cuda
from minigraph.schema import (
    Meta,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import check_float, check_same_dtype, check_shape

TYPE = "sigmoid_cross_entropy_with_logits"


def infer_bce(ins, attrs):
    x, y = ins["x"], ins["label"]
    check_float(TYPE, "x", x)
    check_same_dtype(TYPE, "label", y, "x", x)
    check_shape(TYPE, "label", y, x.shape, " (the shape of input 'x')")
    return {"out": Meta(x.shape, x.dtype)}


def infer_bce_grad(ins, attrs):
    x = ins["x"]
    check_shape(TYPE + "_grad", "dout", ins["dout"], x.shape, " (the shape of x)")
    return {"dx": Meta(x.shape, x.dtype), "dlabel": Meta(x.shape, x.dtype)}


def export_bce(ctx, op):
    """Relu(x) - x * label + Log(1 + Exp(-Abs(x)))."""
    x, y, out = ctx.value(op.inputs["x"]), ctx.value(op.inputs["label"]), op.outputs["out"]
    one = ctx.const(out, "one", np.array(1.0, ctx.dtype(op.inputs["x"])))
    relu, xy, ax, neg, ex, plus, log, diff = (ctx.temp(out, s) for s in (
        "relu", "x_label", "abs", "neg_abs", "exp", "one_plus", "log", "diff"))
    return [ctx.node("Relu", [x], [relu]), ctx.node("Mul", [x, y], [xy]),
            ctx.node("Abs", [x], [ax]), ctx.node("Neg", [ax], [neg]),
            ctx.node("Exp", [neg], [ex]), ctx.node("Add", [one, ex], [plus]),
            ctx.node("Log", [plus], [log]), ctx.node("Sub", [relu, xy], [diff]),
            ctx.node("Add", [diff, log], [ctx.output(out)])]


SCHEMA = register(OpSchema(
    type=TYPE, inputs=(Slot("x"), Slot("label")), outputs=(Slot("out"),), infer=infer_bce,
    grad=grad_maker(TYPE + "_grad", keep=("x", "label"), wrt=("x", "label")),
    export=export_bce, doc=__doc__))
register(grad_schema(SCHEMA, inputs=(Slot("x"), Slot("label"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dlabel", optional=True)),
                     infer=infer_bce_grad))
kernel(TYPE, "cpu", cpu.sigmoid_cross_entropy_with_logits_cpu)
kernel(TYPE + "_grad", "cpu", cpu.sigmoid_cross_entropy_with_logits_grad_cpu)
kernel(TYPE, "gpu", cuda.sigmoid_cross_entropy_with_logits_gpu, dtypes=GPU_FLOATS)
kernel(TYPE + "_grad", "gpu", cuda.sigmoid_cross_entropy_with_logits_grad_gpu,
       dtypes=GPU_FLOATS)


def bce_examples(ex):
    """Cases the device tests run on every place against the CPU."""
    def label(*shape, dtype=np.float32):
        return (ex.r(*shape, dtype=dtype, seed=5) > 0).astype(dtype) * 0.9 + 0.05
    return [("f32", {"x": ex.r(6, 7) * 20, "label": label(6, 7)}, {},
             (("x", "label"), ("x",))),
            ("f64", {"x": ex.r(33, dtype=np.float64) * 5, "label": label(33, dtype=np.float64)},
             {}, (("x",),))]


examples(TYPE, bce_examples)
