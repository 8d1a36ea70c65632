"""fused_conv2d: conv2d, a per-channel bias, a residual, relu and a 2x2 max pooling as
one op (inference).

y = act(conv2d(x, filter) + bias[o] + residual), act = relu or the identity;
`bias` (O,) and `residual` (y's shape) are optional. out = y, or with `pool`
"max2x2" the max of each 2x2 window of y at stride 2 without padding (pool2d's
max, ksize 2: Ho = floor(H / 2), an odd last row or column left out). The
attributes are conv2d's (strides, paddings, dilations, groups, data_layout: the
bias goes along the channel axis of either layout), `activation` ("relu" or
"none") and `pool` ("none" or "max2x2").
mg.passes.fuse_conv2d builds it from conv2d -> elementwise_add (the layer's bias,
on the channel axis) -> add (a residual of the same shape) -> relu -> pool2d
(max, 2x2 windows at stride 2, no padding) chains of an inference net, so the
bias, the residual and relu are applied to each chunk of the convolution's output
while it is in cache, with no array in between; the native NCHW kernels pool each
image's outputs while they are in cache, so the full-size y is never in memory
(the largest arrays of a small CNN's inference).

It is an inference-only op: it has no gradient, and backward through it is an
error (train the net with conv2d and fuse its inference copy).
Kernels (beside conv2d's): kernels/cpu/conv2d.py (the native kernel with the
epilogue on each tile of outputs in registers, else the im2col engine with it on
each chunk, then pool2d's kernel) and kernels/cuda/conv2d.py (the conv2d launcher,
then the bias, residual and relu launchers in place on its output, then pool2d's).
In ONNX it is Conv (with the bias as its third input; NHWC between two
Transposes), then Add of the residual, Relu and MaxPool.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import conv2d as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import conv2d_nhwc as cuda
from minigraph.kernels.layout import channel_axis, spatial_axes
from minigraph.ops.conv2d import channels_last, conv_attrs, conv_nodes, infer_conv, resolve
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    inference_only,
    kernel,
    register,
)
from minigraph.validators import check_extra_input, infer_as, one_of, str_attr

TYPE = "fused_conv2d"


def infer_fused(ins, attrs):
    out = infer_as(TYPE, "conv2d", infer_conv, ins, attrs)["out"]
    layout = attrs["data_layout"]
    channels = out.shape[channel_axis(layout)]
    check_extra_input(TYPE, "bias", ins.get("bias"), ins["x"], (channels,),
                      " (one value per output channel)")
    check_extra_input(TYPE, "residual", ins.get("residual"), ins["x"], out.shape,
                      " (the convolution's output shape)")
    if attrs["pool"] == "none":
        return {"out": out}
    shape = list(out.shape)
    for axis in spatial_axes(layout):
        if 0 <= shape[axis] < 2:
            raise OpError(f"{TYPE}: attribute 'pool' {attrs['pool']!r} needs the "
                          f"convolution's output to be at least 2x2, got shape {out.shape}")
        shape[axis] = shape[axis] // 2 if shape[axis] > 0 else shape[axis]
    return {"out": Meta(tuple(shape), out.dtype)}


def export_fused(ctx, op):
    """Conv (the bias as its third input), then Add of the residual, then Relu, then
    MaxPool."""
    ins = [ctx.value(op.inputs[s]) for s in ("x", "filter")]
    if op.inputs["bias"] is not None:
        ins.append(ctx.value(op.inputs["bias"]))
    residual = op.inputs["residual"]
    out, relu = op.outputs["out"], op.attrs["activation"] == "relu"
    activation = "relu" if relu else None
    if op.attrs["pool"] != "none":
        activation = ("pool", lambda x, result: _pool_nodes(ctx, op, x, result, relu))
    return ctx.epilogue(out, "conv", lambda name: conv_nodes(ctx, op, ins, name),
                        [("residual", residual)] if residual is not None else [], activation)


def _pool_nodes(ctx, op, x, result, relu):
    """Relu (where the op has it), then MaxPool of 2x2 windows at stride 2 (NHWC between
    two Transposes)."""
    nodes = []
    if relu:
        nodes.append(ctx.node("Relu", [x], [ctx.temp(op.outputs["out"], "relu")]))
        x = nodes[-1].output[0]
    pool = dict(kernel_shape=[2, 2], strides=[2, 2])
    if op.attrs["data_layout"] == "NCHW":
        return [*nodes, ctx.node("MaxPool", [x], [result], **pool)]
    return [*nodes, *channels_last(ctx, op, x, result,
                                   lambda xt, yt: [ctx.node("MaxPool", [xt], [yt], **pool)])]


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("filter"), Slot("bias", optional=True),
            Slot("residual", optional=True)),
    outputs=(Slot("out"),),
    attrs=conv_attrs() + (str_attr("activation", "none", one_of("none", "relu")),
                          str_attr("pool", "none", one_of("none", "max2x2"))),
    infer=infer_fused, resolve_attrs=resolve, export=export_fused,
    grad=inference_only(TYPE, "conv2d (and its bias add and relu)"),
    roles=("fused_conv",), doc=__doc__))
kernel(TYPE, "cpu", cpu.fused_conv2d_cpu, bind=cpu.bind_fused_conv2d)
kernel(TYPE, "gpu", cuda.fused_conv2d_gpu, dtypes=GPU_FLOATS)


def fused_conv2d_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); an inference op, so no gradients."""
    x, w = ex.r(2, 4, 7, 6), ex.r(6, 2, 3, 3, seed=1)
    return [("bias-residual-relu-f32", {"x": x, "filter": w, "bias": ex.r(6, seed=2),
                                        "residual": ex.r(2, 6, 7, 6, seed=3)},
             dict(paddings=1, groups=2, activation="relu"), ()),
            ("bias-f64", {"x": ex.r(1, 3, 9, 8, dtype=np.float64),
                          "filter": ex.r(4, 3, 3, 2, dtype=np.float64),
                          "bias": ex.r(4, dtype=np.float64)},
             dict(strides=2, dilations=2), ()),
            ("plain-f32", {"x": x, "filter": ex.r(5, 4, 1, 1)}, {}, ()),
            ("nhwc-bias-residual-relu-f32",
             {"x": ex.r(2, 7, 6, 4), "filter": w, "bias": ex.r(6, seed=2),
              "residual": ex.r(2, 7, 6, 6, seed=3)},
             dict(paddings=1, groups=2, activation="relu", data_layout="NHWC"), ()),
            ("nhwc-bias-f64", {"x": ex.r(1, 9, 8, 3, dtype=np.float64),
                               "filter": ex.r(4, 3, 3, 2, dtype=np.float64),
                               "bias": ex.r(4, dtype=np.float64)},
             dict(strides=2, dilations=2, data_layout="NHWC"), ()),
            ("bias-relu-pool-f32", {"x": ex.r(2, 8, 9, 10), "filter": ex.r(6, 8, 3, 3, seed=1),
                                    "bias": ex.r(6, seed=2)},
             dict(paddings=1, activation="relu", pool="max2x2"), ()),
            ("nhwc-residual-pool-f64",
             {"x": ex.r(2, 6, 7, 3, dtype=np.float64),
              "filter": ex.r(4, 3, 3, 3, dtype=np.float64),
              "residual": ex.r(2, 6, 7, 4, seed=3, dtype=np.float64)},
             dict(paddings=1, pool="max2x2", data_layout="NHWC"), ())]


examples(TYPE, fused_conv2d_examples)
