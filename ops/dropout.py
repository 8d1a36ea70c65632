"""dropout: inverted dropout with counter-based masks (train), identity (infer).

Inputs x (float) and step (int64 scalar: the layer's persistable counter);
attributes p (in [0, 1)), is_infer (the mode attribute: a net forks at it)
and seed (in [0, 2**32)); outputs out, mask (uint8, optional) and step_out
(the step Variable itself, updated in place).
train: keep_i = u_i >= p; factor = 1 / (1 - p) in float64, cast to x's dtype;
       out = x * (keep * factor); mask = keep as uint8; then step += 1.
infer: out = a copy of x; mask and step are not written.
u_i, for element i of x in flat C order, is (w >> 8) / 2**24 with w word i % 4
of Philox4x32-10(counter = i // 4, stream = 2, key = (seed, step as uint32)),
i.e. kernels/cuda/fill.cu's philox(i // 4, 2, seed + (step << 32)): a mask depends
on (seed, step, i) only, and the CPU and the GPU draw the same one.
dropout_grad(mask, dout; p): dx = dout * (mask * factor) (the same factor);
with is_infer (not made by backward, which runs the train branch) dx = dout.
Kernels: kernels/cpu/dropout.py, kernels/cuda/dropout.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import dropout as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import dropout as cuda
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import bool_attr, check_float, check_shape, fail, float_attr, int_attr


def probability(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1) (the probability of dropping)"


def seed_range(v):
    return None if 0 <= v < 2**32 else "must be in [0, 2**32)"


def infer_dropout(ins, attrs):
    x, step = ins["x"], ins["step"]
    check_float("dropout", "x", x)
    if tuple(step.shape) != () or step.dtype != np.int64:
        fail("dropout", "step", f"must be an int64 scalar (shape ()), got {step.dtype} of "
                                f"shape {step.shape}")
    return {"out": Meta(x.shape, x.dtype), "mask": Meta(x.shape, np.dtype(np.uint8))}


def infer_dropout_grad(ins, attrs):
    d, mask = ins["dout"], ins["mask"]
    check_float("dropout_grad", "dout", d)
    if mask is not None:
        if mask.dtype != np.uint8:
            fail("dropout_grad", "mask", f"must have dtype uint8, got {mask.dtype}")
        check_shape("dropout_grad", "mask", mask, d.shape, " (the shape of 'dout')")
    return {"dx": Meta(d.shape, d.dtype)}


def grad_dropout(op, dout, make_grad):
    """dropout_grad(mask, dout) -> dx; the mask output must be bound in training."""
    if not op.attrs["is_infer"] and op.outputs["mask"] is None and dout.get("out") is not None:
        raise OpError("dropout: output 'mask' must be bound for the gradient (dropout_grad "
                      "reads it)")
    return MAKE_GRAD(op, dout, make_grad)


MAKE_GRAD = grad_maker("dropout_grad", keep=("mask",))


def export_dropout(ctx, op):
    """Identity: inference dropout passes x through (mask and step are not written)."""
    onnx_export.infer_only(op)
    return [ctx.node("Identity", [ctx.value(op.inputs["x"])], [ctx.output(op.outputs["out"])])]


DROPOUT = register(OpSchema(
    type="dropout", inputs=(Slot("x"), Slot("step")),
    outputs=(Slot("out"), Slot("mask", optional=True), Slot("step_out")),
    attrs=(float_attr("p", 0.5, probability), bool_attr("is_infer", False),
           int_attr("seed", 0, seed_range)),
    inplace={"step_out": "step"}, mode_attr="is_infer", infer=infer_dropout,
    grad=grad_dropout, export=export_dropout, doc=__doc__, roles=("dropout",)))
register(grad_schema(DROPOUT, inputs=(Slot("mask", optional=True), Slot("dout")),
                     outputs=(Slot("dx", optional=True),), infer=infer_dropout_grad))


kernel("dropout", "cpu", cpu.dropout_cpu)
kernel("dropout_grad", "cpu", cpu.dropout_grad_cpu)
kernel("dropout", "gpu", cuda.dropout_gpu, dtypes=GPU_FLOATS)
kernel("dropout_grad", "gpu", cuda.dropout_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def dropout_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("train-f32", {"x": ex.r(5, 13), "step": np.array(3, np.int64)},
         dict(p=0.3, seed=11), (("x",),)),
        ("train-f64", {"x": ex.r(4, 8, dtype=np.float64), "step": np.array(0, np.int64)},
         dict(p=0.6, seed=2**32 - 1), (("x",),)),
        ("p0-f32", {"x": ex.r(9), "step": np.array(1, np.int64)}, dict(p=0.0), (("x",),)),
    ]


examples("dropout", dropout_examples)
