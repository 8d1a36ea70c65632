"""fused_fc: an fc layer's product, its bias, a residual and an activation as one op
(inference), its input normalised first where a layer_norm was folded in.

out = act(flatten(x') @ y + bias + residual), act = relu, gelu or the identity:
mul's x, y and x_num_col_dims, `bias` (one value per column of y, optional),
`residual` (optional: added as add adds, numpy broadcasting both ways; in practice
a value of the product's shape, a transformer block's residual stream) and
`activation` ("relu", "gelu": gelu's exact x Phi(x), or "none"). x' is x, or with
`normalize` layer_norm's y of x over its axes from x_num_col_dims on, with
`norm_scale` and `norm_bias` (optional, one value per position of those axes) and
`norm_epsilon`: a pre-norm transformer block's layer_norm before its products.
mg.passes.fuse_fc builds it from mul -> elementwise_add (the layer's bias, on out's
last axis) -> add (a residual) -> relu or gelu chains of an inference net, or of a
training net's infer branch: one op and one output array where there were up to
four; then folds in the layer_norm whose only reader it is. Each step gives the bits
of the op it replaces (layer_norm's kernel, the bias add, then the residual add, then
the activation's kernel).

It is an inference-only op: it has no gradient, and backward through it is an
error (train the net with fc and fuse its inference copy, or its infer branch).
With `weight_fixed` (the default) its weight is a parameter of an inference net,
which no op writes: the CPU kernel packs it once and makes the array read-only (a
new value, Variable.set, is a new array). Without it (what fuse_fc builds in a
training net's infer branch, whose weights the optimizer updates in place) the
weight is never packed: BLAS's product, then the bias and relu in place on it.
Kernels (beside mul's): kernels/cpu/mul.py (fc_native.c's kernel, with the bias
and relu added to each tile of outputs in registers, for float32 products of
a fixed weight with at least fc_native.MIN_WORK multiply-adds, or at most
fc_native.COLS_MAX columns (fc_cols.h's kernel), where that was faster than BLAS
on the machine; its few-rows kernel,
with the bias, a residual of the product's shape and relu, for a generated
token's; else BLAS's product, then the bias and relu in place on it; then what is
left of the residual and activation in place, gelu by gelu's kernel) and
kernels/cuda/matmul.py (the mul launcher, then the bias, residual and relu
launcher in place on its output, then gelu's). In ONNX it is MatMul, then Add of
the bias and of the residual, then Relu or gelu's nodes, after layer_norm's where
it normalises x.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import mul as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import matmul as cuda
from minigraph.ops.activation import gelu_nodes
from minigraph.ops.binary import broadcast_shape
from minigraph.ops.layer_norm import layer_norm_nodes
from minigraph.ops.mul import infer_mul, matmul_nodes
from minigraph.schema import Meta, OpSchema, Slot, examples, inference_only, kernel, register
from minigraph.validators import (
    bool_attr,
    check_extra_input,
    check_float,
    check_same_dtype,
    fail,
    float_attr,
    infer_as,
    int_attr,
    non_negative,
    one_of,
    positive,
    str_attr,
)

TYPE = "fused_fc"


NORM_ATTRS = (bool_attr("normalize", False), float_attr("norm_epsilon", 1e-5, non_negative))
NORM_SLOTS = (Slot("norm_scale", optional=True), Slot("norm_bias", optional=True))


def check_norm(op_type, ins, attrs):
    """With attribute normalize, x is a float tensor and norm_scale and norm_bias (each
    optional) hold one value per position of x's axes from x_num_col_dims on, as
    layer_norm's scale and bias; without it, neither is bound."""
    x, n = ins["x"], attrs["x_num_col_dims"]
    if not attrs["normalize"]:
        for slot in (s.name for s in NORM_SLOTS):
            if ins.get(slot) is not None:
                fail(op_type, slot, "is bound but attribute 'normalize' is False (the "
                                    "layer_norm's scale and bias of an op that normalises x)")
        return
    check_float(op_type, "x", x)
    tail = x.shape[n:]
    length = -1 if min(tail, default=1) < 0 else math.prod(tail)
    for slot in (s.name for s in NORM_SLOTS):
        check_extra_input(op_type, slot, ins.get(slot), x, (length,),
                          f" (one value per position of axes {n}.. of input 'x' with shape "
                          f"{x.shape})")


def norm_nodes(ctx, op):
    """(layer_norm's ONNX nodes of x into a new value, its name) with attribute
    normalize, else ([], None): the product then reads x itself."""
    if not op.attrs["normalize"]:
        return [], None
    out = op.outputs["out"]
    out = out[0] if isinstance(out, list) else out
    name = ctx.temp(out, "normalized")
    return layer_norm_nodes(ctx, op.inputs["x"], op.inputs["norm_scale"],
                            op.inputs["norm_bias"], op.attrs["x_num_col_dims"],
                            op.attrs["norm_epsilon"], name, out), name


def infer_fused(ins, attrs):
    out = infer_as(TYPE, "mul", infer_mul, ins, attrs)["out"]
    check_norm(TYPE, ins, attrs)
    check_extra_input(TYPE, "bias", ins.get("bias"), ins["x"], (out.shape[-1],),
                      " (one value per column of 'y')")
    residual = ins.get("residual")
    if residual is None:
        return {"out": out}
    check_same_dtype(TYPE, "residual", residual, "x", ins["x"])
    return {"out": Meta(broadcast_shape(TYPE, out.shape, residual.shape,
                                                 ("the product", "residual")), out.dtype)}


def export_fused(ctx, op):
    """layer_norm's nodes where x is normalised, MatMul (mul's), then Add of the bias and
    of the residual, then Relu or gelu's nodes."""
    nodes, x = norm_nodes(ctx, op)
    adds = [(slot, op.inputs[slot]) for slot in ("bias", "residual")
            if op.inputs[slot] is not None]
    act = {"none": None, "relu": "relu",
           "gelu": ("gelu", lambda x, out: gelu_nodes(ctx, x, op.outputs["out"], out))}
    return nodes + ctx.epilogue(op.outputs["out"], "matmul",
                                lambda name: matmul_nodes(ctx, op, name, x), adds,
                                act[op.attrs["activation"]])


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("y"), Slot("bias", optional=True),
            Slot("residual", optional=True), *NORM_SLOTS),
    outputs=(Slot("out"),),
    attrs=(int_attr("x_num_col_dims", 1, positive),
           str_attr("activation", "none", one_of("none", "relu", "gelu")),
           bool_attr("weight_fixed", True), *NORM_ATTRS),
    infer=infer_fused, export=export_fused, roles=("fused_fc",), doc=__doc__,
    grad=inference_only(TYPE, "fc (mul, its bias add, a residual add and relu or gelu)")))
kernel(TYPE, "cpu", cpu.fused_fc_cpu, bind=cpu.bind_fused_fc)
kernel(TYPE, "gpu", cuda.fused_fc_gpu, dtypes=GPU_FLOATS)


def fused_fc_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); an inference op, so no gradients."""
    return [("bias-relu-f32", {"x": ex.r(7, 3, 5), "y": ex.r(15, 9, seed=1),
                               "bias": ex.r(9, seed=2)}, dict(activation="relu"), ()),
            ("cols2-bias-f64", {"x": ex.r(2, 3, 4, dtype=np.float64),
                                "y": ex.r(4, 6, dtype=np.float64, seed=1),
                                "bias": ex.r(6, dtype=np.float64, seed=2)},
             dict(x_num_col_dims=2), ()),
            ("plain-relu-f32", {"x": ex.r(4, 8), "y": ex.r(8, 17, seed=1)},
             dict(activation="relu"), ()),
            ("trained-weight-f32", {"x": ex.r(3, 5, 8), "y": ex.r(8, 6, seed=1),
                                    "bias": ex.r(6, seed=2)},
             dict(x_num_col_dims=2, weight_fixed=False), ()),
            ("residual-gelu-f32", {"x": ex.r(2, 3, 8), "y": ex.r(8, 6, seed=1),
                                   "bias": ex.r(6, seed=2), "residual": ex.r(2, 3, 6, seed=3)},
             dict(x_num_col_dims=2, activation="gelu", weight_fixed=False), ()),
            ("broadcast-residual-relu-f64",
             {"x": ex.r(4, 5, dtype=np.float64), "y": ex.r(5, 3, dtype=np.float64, seed=1),
              "residual": ex.r(2, 1, 3, dtype=np.float64, seed=2)},
             dict(activation="relu"), ()),
            ("normalized-gelu-f32", {"x": ex.r(2, 3, 8) * 3 + 1, "y": ex.r(8, 6, seed=1),
                                     "bias": ex.r(6, seed=2), "norm_scale": ex.r(8, seed=3),
                                     "norm_bias": ex.r(8, seed=4)},
             dict(x_num_col_dims=2, activation="gelu", weight_fixed=False, normalize=True), ()),
            ("normalized-no-affine-f64", {"x": ex.r(3, 2, 5, dtype=np.float64),
                                          "y": ex.r(10, 4, dtype=np.float64, seed=1)},
             dict(normalize=True, norm_epsilon=1e-3), ())]


examples(TYPE, fused_fc_examples)
