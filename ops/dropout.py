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
i.e. kernels/fill.cu's philox(i // 4, 2, seed + (step << 32)): a mask depends
on (seed, step, i) only, and the CPU and the GPU draw the same one.
dropout_grad(mask, dout; p): dx = dout * (mask * factor) (the same factor);
with is_infer (not made by backward, which runs the train branch) dx = dout.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import dropout as gpu
from minigraph.kernels import shape_ops as gpu_shape
from minigraph.ops.device import GPU_FLOATS, present
from minigraph.ops.philox import philox_words, uniforms24
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import bool_attr, check_float, check_shape, fail, float_attr, int_attr

STREAM = 2      # fill.cu's uniform and gaussian initialisers use streams 0 and 1


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

DROPOUT = register(OpSchema(
    type="dropout", inputs=(Slot("x"), Slot("step")),
    outputs=(Slot("out"), Slot("mask", optional=True), Slot("step_out")),
    attrs=(float_attr("p", 0.5, probability), bool_attr("is_infer", False),
           int_attr("seed", 0, seed_range)),
    inplace={"step_out": "step"}, mode_attr="is_infer", infer=infer_dropout,
    grad=grad_dropout, doc=__doc__))
register(grad_schema(DROPOUT, inputs=(Slot("mask", optional=True), Slot("dout")),
                     outputs=(Slot("dx", optional=True),), infer=infer_dropout_grad))


def scale_factor(p, dtype):
    """1 / (1 - p) computed in float64, as a scalar of `dtype`."""
    return np.dtype(dtype).type(1.0 / (1.0 - p))


def keep_mask(n, p, seed, step):
    """keep_i = u_i >= p for i < n (see the module docstring), a bool array."""
    seed64 = int(seed) + ((int(step) & 0xFFFFFFFF) << 32)
    return uniforms24(philox_words(n, STREAM, seed64)) >= p


@kernel("dropout", "cpu")
def dropout_cpu(op, ins, ctx):
    """train: out = x * (keep * factor), mask = keep, then step += 1 in place;
    infer: out = a copy of x."""
    x, step = ins["x"], ins["step"]
    a = op.attrs
    if a["is_infer"]:
        return {"out": x.copy(), "step_out": step}
    p = a["p"]
    if p == 0.0:                        # every u_i >= 0: all kept, factor 1
        keep = np.ones(x.shape, dtype=bool)
        out = x.copy()
    else:
        keep = keep_mask(x.size, p, a["seed"], step).reshape(x.shape)
        out = x * (keep.astype(x.dtype) * scale_factor(p, x.dtype))
    step[...] = step + 1
    return {"out": out, "mask": keep.astype(np.uint8), "step_out": step}


@kernel("dropout_grad", "cpu")
def dropout_grad_cpu(op, ins, ctx):
    """dx = dout * (mask * factor); dx = a copy of dout for is_infer."""
    if not op.wants("dx"):
        return {}
    d, mask = ins["dout"], ins["mask"]
    if op.attrs["is_infer"]:
        return {"dx": d.copy()}
    if mask is None:
        raise OpError("dropout_grad: input 'mask' is required in training (is_infer=False)")
    return {"dx": d * (mask.astype(d.dtype) * scale_factor(op.attrs["p"], d.dtype))}


# ---- GPU bindings: kernels/dropout.cu ----

@kernel("dropout", "gpu", dtypes=GPU_FLOATS)
def dropout_gpu(op, ins, ctx):
    """train: the CPU's masks drawn on the device (same bits), step += 1 there;
    infer: out = a device copy of x."""
    x, step = ins["x"], ins["step"]
    a = op.attrs
    if a["is_infer"]:
        return {"out": gpu_shape.copy(x), "step_out": step}
    out, mask = gpu.dropout(x, step, a["p"], a["seed"], want_mask=op.wants("mask"))
    return present(out=out, mask=mask, step_out=step)


@kernel("dropout_grad", "gpu", dtypes=GPU_FLOATS)
def dropout_grad_gpu(op, ins, ctx):
    """dx = dout * (mask * factor) on the device; a copy of dout for is_infer."""
    if not op.wants("dx"):
        return {}
    d, mask = ins["dout"], ins["mask"]
    if op.attrs["is_infer"]:
        return {"dx": gpu_shape.copy(d)}
    if mask is None:
        raise OpError("dropout_grad: input 'mask' is required in training (is_infer=False)")
    return {"dx": gpu.dropout_grad(mask, d, op.attrs["p"])}
