"""group_norm and instance_norm: normalisation over groups of channels of each sample.

group_norm(x, scale, bias; groups, epsilon): x (N, C, *spatial), C a multiple of
groups (torch.nn.GroupNorm(groups, C)); per sample and group of C / groups
channels, with the biased variance over those channels and every spatial position,
    y = (x - mean) / sqrt(variance + epsilon) * scale[c] + bias[c],
scale and bias (optional) one value per channel. `mean` and `variance` (N,
groups) are the groups' statistics, computed stably, kept for the gradient.
instance_norm(x, scale, bias; epsilon): group_norm with a group per channel
(torch F.instance_norm(x, weight=scale, bias=bias), no running estimates); x
needs more than one spatial value per channel. Neither is mode-dependent, and
both work with a batch of one.
Grads (with xhat = (x - mean) * invstd and g = dy * scale, the means over a
group): dx = invstd * (g - mean(g) - xhat * mean(g * xhat)),
dscale[c] = sum of dy * xhat over the samples and positions of channel c,
dbias[c] = sum of dy there.
In ONNX: InstanceNormalization; group_norm as InstanceNormalization of x
reshaped to (N, groups, -1), then the per-channel scale and bias. Kernels:
kernels/cpu/group_norm.py, kernels/cuda/norm.py.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import group_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import norm as cuda
from minigraph.ops.layer_norm import norm_grad_maker
from minigraph.schema import (
    Attr,
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import (
    check_float,
    check_rank,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
    positive,
)


def check_groups(op_type, x, groups):
    """OpError naming `groups` unless it divides x's channels (when known)."""
    c = x.shape[1]
    if c >= 0 and c % groups:
        raise OpError(f"{op_type}: attribute 'groups' ({groups}) must divide the {c} channels "
                      f"of input 'x' (shape {x.shape})")


def infer_norm(op_type, groups_of):
    """infer of group_norm / instance_norm: x (N, C, *) float; scale, bias (C,)."""
    def infer(ins, attrs):
        x = ins["x"]
        check_rank(op_type, "x", x, (2, 3, 4, 5) if op_type == "group_norm" else (3, 4, 5))
        check_float(op_type, "x", x)
        groups = groups_of(x, attrs)
        if op_type == "group_norm":
            check_groups(op_type, x, groups)
        elif min(x.shape[2:]) >= 0 and math.prod(x.shape[2:]) == 1:
            fail(op_type, "x", f"needs more than one spatial value per channel, got shape "
                               f"{x.shape}")
        c = x.shape[1]
        for slot in ("scale", "bias"):
            if ins.get(slot) is not None:
                check_shape(op_type, slot, ins[slot], (c,),
                            f" (one value per channel of input 'x' with shape {x.shape})")
                check_same_dtype(op_type, slot, ins[slot], "x", x)
        stat = Meta((x.shape[0], groups), x.dtype)
        return {"y": Meta(x.shape, x.dtype), "mean": stat, "variance": stat}
    return infer


def infer_norm_grad(op_type, groups_of):
    def infer(ins, attrs):
        x = ins["x"]
        check_shape(op_type, "dy", ins["dy"], x.shape, " (the shape of x)")
        stat = (x.shape[0], groups_of(x, attrs))
        for slot in ("mean", "variance"):
            check_shape(op_type, slot, ins[slot], stat, " (x's samples and groups)")
        c = Meta((x.shape[1],), x.dtype)
        return {"dx": Meta(x.shape, x.dtype), "dscale": c, "dbias": c}
    return infer


def export_instance_norm(ctx, op):
    """InstanceNormalization (the scale and bias ones and zeros when absent)."""
    x, y = op.inputs["x"], op.outputs["y"]
    c, dt = ctx.shape(x)[1], ctx.dtype(x)
    affine = [ctx.value(op.inputs[s]) if op.inputs[s] is not None else
              ctx.const(y, s, np.full(c, 1.0 if s == "scale" else 0.0, dt))
              for s in ("scale", "bias")]
    return [ctx.node("InstanceNormalization", [ctx.value(x), *affine], [ctx.output(y)],
                     epsilon=float(op.attrs["epsilon"]))]


def export_group_norm(ctx, op):
    """InstanceNormalization of x reshaped to (N, groups, -1), reshaped back to x's
    shape, then Mul by the scale and Add of the bias (as (C, 1, ...))."""
    x, y = op.inputs["x"], op.outputs["y"]
    shape, dt, g = ctx.shape(x), ctx.dtype(x), int(op.attrs["groups"])
    rank = len(shape)
    grouped, normed, back, scaled = (ctx.temp(y, s) for s in
                                     ("grouped", "normalized", "ungrouped", "scaled"))
    nodes = [ctx.node("Reshape", [ctx.value(x), ctx.const(y, "groups_shape",
                                                         np.array([0, g, -1], np.int64))],
                      [grouped]),
             ctx.node("InstanceNormalization",
                      [grouped, ctx.const(y, "ones", np.ones(g, dt)),
                       ctx.const(y, "zeros", np.zeros(g, dt))], [normed],
                      epsilon=float(op.attrs["epsilon"]))]
    x_shape = ctx.temp(y, "x_shape")
    nodes += [ctx.node("Shape", [ctx.value(x)], [x_shape]),
              ctx.node("Reshape", [normed, x_shape], [back])]
    per_channel = (shape[1],) + (1,) * (rank - 2)
    cur = back
    for s, onnx_type, name in (("scale", "Mul", scaled), ("bias", "Add", None)):
        if op.inputs[s] is None:
            continue
        out = name if (s == "scale" and op.inputs["bias"] is not None) else None
        target = out or ctx.output(y)
        nodes.append(ctx.node(onnx_type, [cur, ctx.value(op.inputs[s], shape=per_channel)],
                              [target]))
        cur = target
    if cur is back:
        nodes.append(ctx.node("Identity", [back], [ctx.output(y)]))
    return nodes


def register_norm(op_type, attrs, groups_of, export):
    schema = register(OpSchema(
        type=op_type,
        inputs=(Slot("x"), Slot("scale", optional=True), Slot("bias", optional=True)),
        outputs=(Slot("y"), Slot("mean"), Slot("variance")), attrs=attrs,
        infer=infer_norm(op_type, groups_of), grad=norm_grad_maker(op_type), export=export,
        doc=__doc__))
    register(grad_schema(schema, inputs=(Slot("x"), Slot("scale", optional=True), Slot("mean"),
                                         Slot("variance"), Slot("dy")),
                         outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                                  Slot("dbias", optional=True)),
                         infer=infer_norm_grad(op_type + "_grad", groups_of)))


register_norm("group_norm",
              (Attr("groups", (int, np.integer), None, positive, required=True),
               float_attr("epsilon", 1e-5, positive)),
              lambda x, attrs: attrs["groups"], export_group_norm)
register_norm("instance_norm", (float_attr("epsilon", 1e-5, positive),),
              lambda x, attrs: x.shape[1], export_instance_norm)
kernel("group_norm", "cpu", cpu.group_norm_cpu)
kernel("group_norm_grad", "cpu", cpu.group_norm_grad_cpu)
kernel("instance_norm", "cpu", cpu.instance_norm_cpu)
kernel("instance_norm_grad", "cpu", cpu.instance_norm_grad_cpu)
kernel("group_norm", "gpu", cuda.group_norm_gpu, dtypes=GPU_FLOATS)
kernel("group_norm_grad", "gpu", cuda.group_norm_grad_gpu, dtypes=GPU_FLOATS)
kernel("instance_norm", "gpu", cuda.instance_norm_gpu, dtypes=GPU_FLOATS)
kernel("instance_norm_grad", "gpu", cuda.instance_norm_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def group_norm_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets)."""
    grads = (("x", "scale", "bias"), ("x",), ("scale",))
    return [
        ("g2-f32", {"x": ex.r(3, 6, 5, 4) + 2, "scale": ex.r(6, seed=1),
                    "bias": ex.r(6, seed=2)}, dict(groups=2), grads),
        ("g1-f64", {"x": ex.r(2, 4, 9, dtype=np.float64),
                    "scale": ex.r(4, dtype=np.float64, seed=1),
                    "bias": ex.r(4, dtype=np.float64, seed=2)}, dict(groups=1), grads),
        ("one-sample-no-affine-f32", {"x": ex.r(1, 8, 3, 3) * 10}, dict(groups=4), (("x",),)),
    ]


def instance_norm_examples(ex):
    """Cases the device tests run on every place against the CPU."""
    grads = (("x", "scale", "bias"), ("x",))
    return [
        ("f32", {"x": ex.r(2, 3, 7, 5) - 3, "scale": ex.r(3, seed=1), "bias": ex.r(3, seed=2)},
         {}, grads),
        ("one-sample-f64", {"x": ex.r(1, 5, 11, dtype=np.float64)}, dict(epsilon=1e-3),
         (("x",),)),
    ]


examples("group_norm", group_norm_examples)
examples("instance_norm", instance_norm_examples)
