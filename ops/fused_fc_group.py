"""fused_fc_group: several products of one x as one op (inference).

out[g] = flatten(x') @ y[g] + bias[g] for each weight y[g] (K, M_g): mul's x and
x_num_col_dims, `y` a list of weights, `bias` a list of one bias per weight (M_g
values) or unbound, `out` the list of products, out[g] of shape x.shape[:n] + (M_g,);
x' is x, or with `normalize` layer_norm's y of x (norm_scale, norm_bias and
norm_epsilon, as fused_fc's), computed once for every product. mg.passes.fuse_fc
builds it in a training net's infer branch from the fused_fc ops of one layer that
read the same x, with persistable weights and neither a residual nor an activation:
a multi_head_attention's q, k and v products become one op, and on the CPU one
hand-out to the threads, where there were three; then folds in the layer_norm before
it. Each output has the bits of the ops it replaces.

It is an inference-only op: it has no gradient. Its weights are the training net's,
which the optimizer updates in place: nothing is packed. Kernels: kernels/cpu/mul.py
(fc_native's few-rows group kernel where every product takes it, a generated token's;
else each product as fused_fc runs it) and kernels/cuda/matmul.py (fused_fc's product
and epilogue for each). In ONNX it is fused_fc's MatMul and Add for each product,
after layer_norm's nodes where it normalises x.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from minigraph.kernels.cpu import mul as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import matmul as cuda
from minigraph.ops.fused_fc import NORM_ATTRS, NORM_SLOTS, check_norm, norm_nodes
from minigraph.ops.mul import infer_mul, matmul_nodes
from minigraph.schema import OpError, OpSchema, Slot, examples, inference_only, kernel, register
from minigraph.validators import check_extra_input, infer_as, int_attr, positive

TYPE = "fused_fc_group"


def members(op):
    """Each product of `op` as a fused_fc-like (inputs, outputs, attrs) namespace."""
    biases = op.inputs.get("bias") or [None] * len(op.inputs["y"])
    return [SimpleNamespace(inputs={"x": op.inputs["x"], "y": y, "bias": b},
                            outputs={"out": out}, attrs=op.attrs)
            for y, b, out in zip(op.inputs["y"], biases, op.outputs["out"])]


def infer_group(ins, attrs):
    ys, biases = ins["y"], ins.get("bias") or None
    if not ys:
        raise OpError(f"{TYPE}: input 'y' must list at least one weight, got none")
    if biases is not None and len(biases) != len(ys):
        raise OpError(f"{TYPE}: input 'bias' must list one bias per weight ({len(ys)}), "
                      f"got {len(biases)}")
    outs = []
    for g, y in enumerate(ys):
        try:
            out = infer_as(TYPE, "mul", infer_mul, {"x": ins["x"], "y": y}, attrs)["out"]
            if biases is not None:
                check_extra_input(TYPE, "bias", biases[g], ins["x"], (out.shape[-1],),
                                  " (one value per column of its weight)")
        except OpError as e:
            raise OpError(str(e).replace("input 'y'", f"input 'y'[{g}]", 1)
                          .replace("input 'bias'", f"input 'bias'[{g}]", 1)) from None
        outs.append(out)
    check_norm(TYPE, ins, attrs)
    return {"out": outs}


def export_group(ctx, op):
    """layer_norm's nodes where x is normalised, then fused_fc's MatMul and Add of the
    bias for each product."""
    nodes, x = norm_nodes(ctx, op)
    for m in members(op):
        bias = m.inputs["bias"]
        nodes += ctx.epilogue(m.outputs["out"], "matmul",
                              lambda name, m=m: matmul_nodes(ctx, m, name, x),
                              [("bias", bias)] if bias is not None else [])
    return nodes


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("y", duplicable=True), Slot("bias", optional=True, duplicable=True),
            *NORM_SLOTS),
    outputs=(Slot("out", duplicable=True),),
    attrs=(int_attr("x_num_col_dims", 1, positive), *NORM_ATTRS),
    infer=infer_group, export=export_group, roles=("fused_fc_group",), doc=__doc__,
    grad=inference_only(TYPE, "fc (mul and its bias add)")))
kernel(TYPE, "cpu", cpu.fused_fc_group_cpu, bind=cpu.bind_fused_fc_group)
kernel(TYPE, "gpu", cuda.fused_fc_group_gpu, dtypes=GPU_FLOATS)


def fused_fc_group_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); an inference op, so no gradients."""
    return [("qkv-f32", {"x": ex.r(1, 1, 8), "y": [ex.r(8, 8, seed=s) for s in (1, 2, 3)],
                         "bias": [ex.r(8, seed=s) for s in (4, 5, 6)]},
             dict(x_num_col_dims=2), ()),
            ("two-widths-f64", {"x": ex.r(5, 6, dtype=np.float64),
                                "y": [ex.r(6, 3, dtype=np.float64, seed=1),
                                      ex.r(6, 7, dtype=np.float64, seed=2)]}, {}, ()),
            ("normalized-qkv-f32", {"x": ex.r(1, 2, 8) * 2 - 1,
                                    "y": [ex.r(8, 8, seed=s) for s in (1, 2, 3)],
                                    "norm_scale": ex.r(8, seed=7), "norm_bias": ex.r(8, seed=8)},
             dict(x_num_col_dims=2, normalize=True), ())]


examples(TYPE, fused_fc_group_examples)
