"""fused_fc: an fc layer's product, its bias and relu as one op (inference).

out = act(flatten(x) @ y + bias), act = relu or the identity: mul's x, y and
x_num_col_dims, `bias` (one value per column of y, optional) and `activation`
("relu" or "none"). mg.passes.fuse_fc builds it from mul -> elementwise_add
(the layer's bias, on out's last axis) -> relu chains of an inference net, or of
a training net's infer branch: one op and one output array where there were
three.

It is an inference-only op: it has no gradient, and backward through it is an
error (train the net with fc and fuse its inference copy, or its infer branch).
With `weight_fixed` (the default) its weight is a parameter of an inference net,
which no op writes: the CPU kernel packs it once and makes the array read-only (a
new value, Variable.set, is a new array). Without it (what fuse_fc builds in a
training net's infer branch, whose weights the optimizer updates in place) the
weight is never packed: BLAS's product, then the bias and relu in place on it.
Kernels (beside mul's): kernels/cpu/mul.py (fc_native.c's kernel, with the bias
and relu added to each tile of outputs in registers, for float32 products of
at least fc_native.MIN_WORK multiply-adds and a fixed weight; else BLAS's
product, then the bias and relu in place on it) and kernels/cuda/matmul.py (the
mul launcher, then the bias and relu launchers in place on its output). In ONNX
it is MatMul, then Add of the bias and Relu.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import mul as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import matmul as cuda
from minigraph.ops.mul import infer_mul, matmul_nodes
from minigraph.schema import OpSchema, Slot, examples, inference_only, kernel, register
from minigraph.validators import (
    bool_attr,
    check_extra_input,
    infer_as,
    int_attr,
    one_of,
    positive,
    str_attr,
)

TYPE = "fused_fc"


def infer_fused(ins, attrs):
    out = infer_as(TYPE, "mul", infer_mul, ins, attrs)["out"]
    check_extra_input(TYPE, "bias", ins.get("bias"), ins["x"], (out.shape[-1],),
                      " (one value per column of 'y')")
    return {"out": out}


def export_fused(ctx, op):
    """MatMul (mul's), then Add of the bias, then Relu."""
    bias = op.inputs["bias"]
    return ctx.epilogue(op.outputs["out"], "matmul", lambda name: matmul_nodes(ctx, op, name),
                        [("bias", bias)] if bias is not None else [],
                        op.attrs["activation"] == "relu")


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("y"), Slot("bias", optional=True)),
    outputs=(Slot("out"),),
    attrs=(int_attr("x_num_col_dims", 1, positive),
           str_attr("activation", "none", one_of("none", "relu")),
           bool_attr("weight_fixed", True)),
    infer=infer_fused, export=export_fused, roles=("fused_fc",), doc=__doc__,
    grad=inference_only(TYPE, "fc (mul, its bias add and relu)")))
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
             dict(x_num_col_dims=2, weight_fixed=False), ())]


examples(TYPE, fused_fc_examples)
