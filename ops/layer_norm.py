"""layer_norm: normalisation over the trailing axes of each sample (torch's
F.layer_norm(x, x.shape[begin_norm_axis:], weight, bias, eps)).

x is split at begin_norm_axis into rows (the axes before) of L values (the axes
from it on); per row, with the biased variance,
    y = (x - mean) / sqrt(variance + epsilon) * scale + bias,
scale and bias (optional) holding L values, one per position of a row. The
outputs `mean` and `variance` (x's leading shape) are the rows' statistics,
computed stably (never E[x^2] - E[x]^2), kept for the gradient. epsilon may be
0 (a row of equal values is then an error naming it); an empty batch gives an
empty y. Not mode-dependent: training and inference compute the same, a batch of
one included.
layer_norm_grad(x, scale, mean, variance, dy) -> dx, dscale, dbias, with
xhat = (x - mean) * invstd, g = dy * scale:
    dx = invstd * (g - mean_row(g) - xhat * mean_row(g * xhat)),
    dscale = sum over rows of dy * xhat, dbias = sum over rows of dy.
In ONNX it is LayerNormalization (opset 17 and later), else its moments
spelled out. Kernels: kernels/cpu/layer_norm.py, kernels/cuda/norm.py.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import layer_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import norm_op as cuda
from minigraph.schema import (
    Meta,
    OpDesc,
    OpSchema,
    Slot,
    examples,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import (
    check_float,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
    int_attr,
    non_negative,
)

TYPE = "layer_norm"


def row_shape(op_type, x, attrs):
    """(the statistics' shape, L) of x normalised from begin_norm_axis; an OpError
    naming the attribute unless it is in [1, rank)."""
    begin, rank = attrs["begin_norm_axis"], len(x.shape)
    if not 1 <= begin < rank:
        fail(op_type, "x", f"of rank {rank} (shape {x.shape}) cannot be normalised from "
                           f"attribute 'begin_norm_axis' {begin}: it must be in [1, {rank})")
    tail = x.shape[begin:]
    return tuple(x.shape[:begin]), (-1 if min(tail) < 0 else math.prod(tail))


def infer_layer_norm(ins, attrs):
    x = ins["x"]
    check_float(TYPE, "x", x)
    stats, length = row_shape(TYPE, x, attrs)
    for slot in ("scale", "bias"):
        if ins.get(slot) is not None:
            check_shape(TYPE, slot, ins[slot], (length,),
                        f" (one value per position of axes {attrs['begin_norm_axis']}.. of "
                        f"input 'x' with shape {x.shape})")
            check_same_dtype(TYPE, slot, ins[slot], "x", x)
    stat = Meta(stats, x.dtype)
    return {"y": Meta(x.shape, x.dtype), "mean": stat, "variance": stat}


def infer_layer_norm_grad(ins, attrs):
    x = ins["x"]
    stats, length = row_shape(TYPE + "_grad", x, attrs)
    check_shape(TYPE + "_grad", "dy", ins["dy"], x.shape, " (the shape of x)")
    for slot in ("mean", "variance"):
        check_shape(TYPE + "_grad", slot, ins[slot], stats, " (x's rows)")
    return {"dx": Meta(x.shape, x.dtype), "dscale": Meta((length,), x.dtype),
            "dbias": Meta((length,), x.dtype)}


def norm_grad_maker(op_type):
    """The grad maker of a normalisation with optional scale and bias that saves its
    statistics as `mean` and `variance` (layer_norm, group_norm, instance_norm)."""
    def make(op, dout, make_grad):
        dy = dout.get("y")
        if dy is None:
            return []
        made = {"dx": make_grad(op.inputs["x"])}
        for slot in ("scale", "bias"):
            if op.inputs[slot] is not None:
                made["d" + slot] = make_grad(op.inputs[slot])
        if all(v is None for v in made.values()):
            return []
        return [OpDesc(op_type + "_grad", dict(
            x=op.inputs["x"], scale=op.inputs["scale"], mean=op.outputs["mean"],
            variance=op.outputs["variance"], dy=dy, **made, **op.attrs))]
    return make


def export_layer_norm(ctx, op):
    """LayerNormalization from axis begin_norm_axis (opset 17+; the scale and bias
    reshaped to the normalised axes, ones and zeros when absent), else the moments
    spelled out (onnx_export.moments_normalize)."""
    a, y = op.attrs, op.outputs["y"]
    return layer_norm_nodes(ctx, op.inputs["x"], op.inputs["scale"], op.inputs["bias"],
                            a["begin_norm_axis"], a["epsilon"], ctx.output(y), y)


def layer_norm_nodes(ctx, x, scale, bias, begin, eps, result, named_after):
    """The ONNX nodes of layer_norm's y of Variable x (scale and bias Variables or None)
    into the value named `result`, their helper values named after Variable
    `named_after` (export_layer_norm's, and a fused op's that normalises its input)."""
    shape = ctx.shape(x)
    tail = tuple(shape[begin:])
    if min(tail) < 0:
        raise ValueError(f"layer_norm computing {named_after.name!r}: the normalised axes of "
                         f"{x.name!r} (shape {shape}) must be known")
    dt = ctx.dtype(x)
    affine = [ctx.value(v, shape=tail) if v is not None else
              ctx.const(named_after, s, np.full(tail, 1.0 if s == "scale" else 0.0, dt))
              for s, v in (("scale", scale), ("bias", bias))]
    if ctx.opset >= 17:
        return [ctx.node("LayerNormalization", [ctx.value(x), *affine], [result],
                         axis=begin, epsilon=float(eps))]
    normed = ctx.temp(named_after, "normalized")
    nodes = onnx_export.moments_normalize(ctx, ctx.value(x), list(range(begin, len(shape))),
                                          float(eps), normed, named_after, dt)
    scaled = ctx.temp(named_after, "scaled")
    return nodes + [ctx.node("Mul", [normed, affine[0]], [scaled]),
                    ctx.node("Add", [scaled, affine[1]], [result])]


SCHEMA = register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("scale", optional=True), Slot("bias", optional=True)),
    outputs=(Slot("y"), Slot("mean"), Slot("variance")),
    attrs=(int_attr("begin_norm_axis", 1), float_attr("epsilon", 1e-5, non_negative)),
    infer=infer_layer_norm, grad=norm_grad_maker(TYPE), export=export_layer_norm,
    roles=("layer_norm",), doc=__doc__))
register(grad_schema(SCHEMA, inputs=(Slot("x"), Slot("scale", optional=True), Slot("mean"),
                                     Slot("variance"), Slot("dy")),
                     outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                              Slot("dbias", optional=True)),
                     infer=infer_layer_norm_grad))
kernel(TYPE, "cpu", cpu.layer_norm_cpu, bind=cpu.bind_layer_norm)
kernel(TYPE + "_grad", "cpu", cpu.layer_norm_grad_cpu)
kernel(TYPE, "gpu", cuda.layer_norm_gpu, dtypes=GPU_FLOATS)
kernel(TYPE + "_grad", "gpu", cuda.layer_norm_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def layer_norm_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets)."""
    grads = (("x", "scale", "bias"), ("x",), ("scale",), ("bias",))
    return [
        ("rows-f32", {"x": ex.r(6, 33) + 4, "scale": ex.r(33, seed=1),
                      "bias": ex.r(33, seed=2)}, {}, grads),
        ("begin2-f64", {"x": ex.r(3, 4, 5, 7, dtype=np.float64),
                        "scale": ex.r(35, dtype=np.float64, seed=1),
                        "bias": ex.r(35, dtype=np.float64, seed=2)},
         dict(begin_norm_axis=2, epsilon=1e-3), grads),
        ("one-row-no-affine-f32", {"x": ex.r(1, 700) * 30}, {}, (("x",),)),
        ("scale-only-f64", {"x": ex.r(5, 4, dtype=np.float64),
                            "scale": ex.r(4, dtype=np.float64, seed=3)}, {},
         (("x", "scale"),)),
        ("bias-only-rank5-eps0-f32", {"x": ex.r(2, 3, 2, 2, 5), "bias": ex.r(10, seed=4)},
         dict(begin_norm_axis=3, epsilon=0.0), (("x", "bias"),)),
        ("empty-f32", {"x": ex.r(0, 5), "scale": ex.r(5, seed=1), "bias": ex.r(5, seed=2)},
         {}, grads),
    ]


examples(TYPE, layer_norm_examples)
