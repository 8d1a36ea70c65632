"""group_norm and instance_norm: normalisation over groups of channels of each sample.

group_norm(x, scale, bias; groups, epsilon, data_layout): x (N, C, *spatial) ("NCHW")
or (N, *spatial, C) ("NHWC"), C a multiple of groups (torch.nn.GroupNorm(groups,
C)); per sample and group of C / groups channels, with the biased variance over
those channels and every spatial position,
    y = (x - mean) / sqrt(variance + epsilon) * scale[c] + bias[c],
scale and bias (optional, each on its own) one value per channel. `mean` and
`variance` (N, groups) are the groups' statistics, computed stably, kept for the
gradient. epsilon may be 0 (a zero variance is then an error naming the sample and
group); a batch of a single sample whose groups hold one value each is an error
(PyTorch's check); an empty batch gives an empty y.
instance_norm(x, scale, bias; epsilon, data_layout): group_norm with a group per
channel (torch F.instance_norm(x, weight=scale, bias=bias), no running estimates;
ops/instance_norm.py registers it and tracked_instance_norm, which keeps them); x
needs more than one spatial value per channel. Neither is mode-dependent, and
both work with a batch of one.
Grads (with xhat = (x - mean) * invstd and g = dy * scale, the means over a
group): dx = invstd * (g - mean(g) - xhat * mean(g * xhat)),
dscale[c] = sum of dy * xhat over the samples and positions of channel c,
dbias[c] = sum of dy there.
In ONNX: InstanceNormalization; group_norm as InstanceNormalization of x
reshaped to (N, groups, -1), then the per-channel scale and bias; NHWC is
transposed to NCHW and back around them. Kernels: kernels/cpu/group_norm.py,
kernels/cuda/norm.py.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import group_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import norm_op as cuda
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
    non_negative,
    one_of,
    positive,
    str_attr,
)


def layout_channels(x, layout):
    """(the channel count, the spatial sizes) of x in `layout`."""
    if layout == "NCHW":
        return x.shape[1], tuple(x.shape[2:])
    return x.shape[-1], tuple(x.shape[1:-1])


def check_groups(op_type, x, groups, layout="NCHW"):
    """OpError naming `groups` unless it divides x's channels (when known), or when the
    batch is one sample whose groups hold one value each (PyTorch's "expected more
    than 1 value per channel")."""
    c, spatial = layout_channels(x, layout)
    if c >= 0 and c % groups:
        raise OpError(f"{op_type}: attribute 'groups' ({groups}) must divide the {c} channels "
                      f"of input 'x' (shape {x.shape}, {layout})")
    known = [x.shape[0], c, *spatial]
    if min(known) >= 0 and x.shape[0] * (c // groups) * math.prod(spatial) == 1:
        fail(op_type, "x", f"needs more than one value per group, got shape {x.shape} "
                           f"({layout}) with {groups} groups")


def infer_norm(op_type, groups_of):
    """infer of group_norm / instance_norm: x (N, C, *) or (N, *, C) float; scale, bias
    (C,)."""
    def infer(ins, attrs):
        x = ins["x"]
        layout = attrs.get("data_layout", "NCHW")
        check_rank(op_type, "x", x, (2, 3, 4, 5) if op_type == "group_norm" else (3, 4, 5))
        check_float(op_type, "x", x)
        groups = groups_of(x, attrs)
        c, spatial = layout_channels(x, layout)
        if op_type == "group_norm":
            check_groups(op_type, x, groups, layout)
        elif min(spatial) >= 0 and math.prod(spatial) == 1:
            fail(op_type, "x", f"needs more than one spatial value per channel, got shape "
                               f"{x.shape} ({layout})")
        for slot in ("scale", "bias"):
            if ins.get(slot) is not None:
                check_shape(op_type, slot, ins[slot], (c,),
                            f" (one value per channel of input 'x' with shape {x.shape}, "
                            f"{layout})")
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
        c = Meta((layout_channels(x, attrs.get("data_layout", "NCHW"))[0],), x.dtype)
        return {"dx": Meta(x.shape, x.dtype), "dscale": c, "dbias": c}
    return infer


def to_nchw(ctx, op, nodes_of):
    """The nodes of a normalisation exported in NCHW (nodes_of(x_name, y_name, shape)),
    with x transposed from NHWC and the result back when the op's layout is NHWC."""
    x, y = op.inputs["x"], op.outputs["y"]
    shape = ctx.shape(x)
    if op.attrs["data_layout"] == "NCHW":
        return nodes_of(ctx.value(x), ctx.output(y), shape)
    rank = len(shape)
    xt, yt = ctx.temp(y, "nchw"), ctx.temp(y, "normed_nchw")
    nchw = (shape[0], shape[-1], *shape[1:-1])
    return ([ctx.node("Transpose", [ctx.value(x)], [xt], perm=[0, rank - 1, *range(1, rank - 1)])]
            + nodes_of(xt, yt, nchw)
            + [ctx.node("Transpose", [yt], [ctx.output(y)], perm=[0, *range(2, rank), 1])])


def export_instance_norm(ctx, op):
    """InstanceNormalization (the scale and bias ones and zeros when absent)."""
    y = op.outputs["y"]
    dt = ctx.dtype(op.inputs["x"])

    def nodes(x_name, y_name, shape):
        c = shape[1]
        affine = [ctx.value(op.inputs[s]) if op.inputs[s] is not None else
                  ctx.const(y, s, np.full(c, 1.0 if s == "scale" else 0.0, dt))
                  for s in ("scale", "bias")]
        return [ctx.node("InstanceNormalization", [x_name, *affine], [y_name],
                         epsilon=float(op.attrs["epsilon"]))]
    return to_nchw(ctx, op, nodes)


def export_group_norm(ctx, op):
    """InstanceNormalization of x reshaped to (N, groups, -1), reshaped back to x's
    shape, then Mul by the scale and Add of the bias (as (C, 1, ...))."""
    y = op.outputs["y"]
    dt, g = ctx.dtype(op.inputs["x"]), int(op.attrs["groups"])

    def nodes(x_name, y_name, shape):
        grouped, normed, back, scaled = (ctx.temp(y, s) for s in
                                         ("grouped", "normalized", "ungrouped", "scaled"))
        out = [ctx.node("Reshape", [x_name, ctx.const(y, "groups_shape",
                                                       np.array([0, g, -1], np.int64))],
                        [grouped]),
               ctx.node("InstanceNormalization",
                        [grouped, ctx.const(y, "ones", np.ones(g, dt)),
                         ctx.const(y, "zeros", np.zeros(g, dt))], [normed],
                        epsilon=float(op.attrs["epsilon"]))]
        x_shape = ctx.temp(y, "x_shape")
        out += [ctx.node("Shape", [x_name], [x_shape]),
                ctx.node("Reshape", [normed, x_shape], [back])]
        per_channel = (shape[1],) + (1,) * (len(shape) - 2)
        cur = back
        for s, onnx_type, name in (("scale", "Mul", scaled), ("bias", "Add", None)):
            if op.inputs[s] is None:
                continue
            target = name if (s == "scale" and op.inputs["bias"] is not None) else y_name
            out.append(ctx.node(onnx_type, [cur, ctx.value(op.inputs[s], shape=per_channel)],
                                [target]))
            cur = target
        if cur is back:
            out.append(ctx.node("Identity", [back], [y_name]))
        return out
    return to_nchw(ctx, op, nodes)


def register_norm(op_type, attrs, groups_of, export, doc=__doc__):
    """Register `op_type` (x, scale, bias -> y, mean, variance of its groups) and its
    grad op; groups_of(x, attrs) is its group count."""
    schema = register(OpSchema(
        type=op_type,
        inputs=(Slot("x"), Slot("scale", optional=True), Slot("bias", optional=True)),
        outputs=(Slot("y"), Slot("mean"), Slot("variance")), attrs=attrs,
        infer=infer_norm(op_type, groups_of), grad=norm_grad_maker(op_type), export=export,
        doc=doc))
    register(grad_schema(schema, inputs=(Slot("x"), Slot("scale", optional=True), Slot("mean"),
                                         Slot("variance"), Slot("dy")),
                         outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                                  Slot("dbias", optional=True)),
                         infer=infer_norm_grad(op_type + "_grad", groups_of)))


LAYOUT = str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))
EPSILON = float_attr("epsilon", 1e-5, non_negative)
register_norm("group_norm",
              (Attr("groups", (int, np.integer), None, positive, required=True), EPSILON,
               LAYOUT),
              lambda x, attrs: attrs["groups"], export_group_norm)
kernel("group_norm", "cpu", cpu.group_norm_cpu)
kernel("group_norm_grad", "cpu", cpu.group_norm_grad_cpu)
kernel("group_norm", "gpu", cuda.group_norm_gpu, dtypes=GPU_FLOATS)
kernel("group_norm_grad", "gpu", cuda.group_norm_grad_gpu, dtypes=GPU_FLOATS)


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
        ("nhwc-f32", {"x": ex.r(2, 5, 3, 6) - 1, "scale": ex.r(6, seed=1),
                      "bias": ex.r(6, seed=2)}, dict(groups=3, data_layout="NHWC"), grads),
        ("nhwc-scale-only-eps0-f64", {"x": ex.r(3, 4, 2, 2, 8, dtype=np.float64),
                                      "scale": ex.r(8, dtype=np.float64, seed=1)},
         dict(groups=2, epsilon=0.0, data_layout="NHWC"), (("x", "scale"),)),
        ("rank3-bias-only-f32", {"x": ex.r(4, 6, 7), "bias": ex.r(6, seed=2)},
         dict(groups=2), (("x", "bias"),)),
        ("empty-f32", {"x": ex.r(0, 4, 3, 3), "scale": ex.r(4, seed=1),
                       "bias": ex.r(4, seed=2)}, dict(groups=2), grads),
    ]


examples("group_norm", group_norm_examples)
