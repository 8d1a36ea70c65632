"""fused_separable_conv2d: a depthwise conv with its bias and relu, then a 1x1 conv with
its bias, a residual and relu, as one op (inference): a MobileNet block.

mid = act_dw(conv2d(x, dw_filter, groups = C) + dw_bias[k]), out = act(conv2d(mid,
filter) + bias[o] + residual); x has C channels, dw_filter is (C m, 1, kh, kw) (m:
the channel multiplier), filter (O, C m, 1, 1). The attributes are the depthwise
conv's (strides, paddings, dilations, groups, which must equal C, and data_layout,
the layout of both convs), `dw_activation` and `activation` ("relu" or "none"); the
1x1 conv has stride 1, no padding and one group. dw_bias (C m,), bias (O,) and
residual (out's shape) are optional.
mg.passes.fuse_separable_conv2d builds it from a fused_conv2d of a depthwise conv
(no residual, no pooling) whose output only a fused_conv2d of a 1x1 conv (stride 1,
no padding, one group, no pooling) reads, in an NCHW inference net: on the CPU the
depthwise outputs of an image then stay in a thread's cache until the 1x1 conv has
read them, where the two ops wrote them to memory and read them back (the largest
arrays of a MobileNet's inference but its 1x1 convs' outputs).

It is an inference-only op: it has no gradient, and backward through it is an error
(train the net with conv2d and fuse its inference copy).
Kernels: kernels/cpu/conv_separable.py (conv_native.c's separable kernel, the bits of
the native depthwise and 1x1 kernels one after the other; else fused_conv2d's kernel
on each conv) and kernels/cuda/conv2d_nhwc.py (fused_conv2d's kernel on each conv).
In ONNX it is fused_conv2d's nodes for each conv: Conv (with dw_bias), Relu, Conv
(with bias), Add of the residual, Relu.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import conv_separable as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import conv2d_nhwc as cuda
from minigraph.kernels.layout import channel_axis
from minigraph.ops.conv2d import conv_attrs, conv_nodes, infer_conv, resolve
from minigraph.schema import OpError, OpSchema, Slot, examples, inference_only, kernel, register
from minigraph.validators import check_extra_input, fail, one_of, str_attr

TYPE = "fused_separable_conv2d"


def infer_separable(ins, attrs):
    x, w = ins["x"], ins["filter"]
    depthwise, pointwise = cpu.part_attrs(attrs)
    c = x.shape[channel_axis(attrs["data_layout"])] if len(x.shape) == 4 else -1
    if c >= 0 and attrs["groups"] != c:
        fail(TYPE, "x", f"has {c} channels (shape {x.shape}), but groups={attrs['groups']}: "
                        "the first conv is depthwise, groups must equal x's channels")
    mid = _as_conv(infer_conv, {"x": x, "filter": ins["dw_filter"]}, depthwise,
                   "dw_filter")["out"]
    channels = mid.shape[channel_axis(attrs["data_layout"])]
    check_extra_input(TYPE, "dw_bias", ins.get("dw_bias"), x, (channels,),
                      " (one value per output channel of the depthwise conv)")
    if len(w.shape) == 4 and any(d not in (1, -1) for d in w.shape[2:]):
        fail(TYPE, "filter", f"must be a 1x1 filter ({w.shape[0]}, {channels}, 1, 1), got "
                             f"shape {w.shape}")
    out = _as_conv(infer_conv, {"x": mid, "filter": w}, pointwise, "filter")["out"]
    o = out.shape[channel_axis(attrs["data_layout"])]
    check_extra_input(TYPE, "bias", ins.get("bias"), x, (o,),
                      " (one value per output channel)")
    check_extra_input(TYPE, "residual", ins.get("residual"), x, out.shape,
                      " (the op's output shape)")
    return {"out": out}


def _as_conv(infer, ins, attrs, filter_slot):
    """infer(ins, attrs) of conv2d, its errors naming this op and `filter_slot`."""
    try:
        return infer(ins, attrs)
    except OpError as e:
        raise OpError(str(e).replace("conv2d:", f"{TYPE}:", 1)
                      .replace("input 'filter'", f"input {filter_slot!r}")) from None


def export_separable(ctx, op):
    """fused_conv2d's nodes for each conv: Conv (dw_bias its third input), Relu, then
    Conv (bias its third input), Add of the residual, Relu."""
    depthwise, pointwise = (_ExportView(op, attrs, s)
                            for attrs, s in zip(cpu.part_attrs(op.attrs), ("dw_filter", "filter")))
    out = op.outputs["out"]

    def conv(view, x, bias_slot):
        ins = [x, ctx.value(op.inputs[view.filter_slot])]
        if op.inputs[bias_slot] is not None:
            ins.append(ctx.value(op.inputs[bias_slot]))
        return lambda name: conv_nodes(ctx, view, ins, name)

    mid = ctx.temp(out, "depthwise")
    first = conv(depthwise, ctx.value(op.inputs["x"]), "dw_bias")
    if op.attrs["dw_activation"] == "relu":
        conv_out = ctx.temp(out, "depthwise_conv")
        nodes = [*first(conv_out), ctx.node("Relu", [conv_out], [mid])]
    else:
        nodes = list(first(mid))
    residual = op.inputs["residual"]
    return nodes + ctx.epilogue(out, "conv", conv(pointwise, mid, "bias"),
                                [("residual", residual)] if residual is not None else [],
                                "relu" if op.attrs["activation"] == "relu" else None)


class _ExportView:
    """One of the op's convs as conv_nodes reads an op: attrs, its filter as
    inputs["filter"], the op's output (for helper names)."""

    def __init__(self, op, attrs, filter_slot):
        self.attrs, self.filter_slot = attrs, filter_slot
        self.inputs = {"filter": op.inputs[filter_slot]}
        self.outputs = op.outputs


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("dw_filter"), Slot("dw_bias", optional=True), Slot("filter"),
            Slot("bias", optional=True), Slot("residual", optional=True)),
    outputs=(Slot("out"),),
    attrs=conv_attrs() + (str_attr("dw_activation", "none", one_of("none", "relu")),
                          str_attr("activation", "none", one_of("none", "relu"))),
    infer=infer_separable, resolve_attrs=resolve, export=export_separable,
    grad=inference_only(TYPE, "conv2d (the depthwise and the 1x1 conv, their bias adds "
                              "and relus)"),
    roles=("fused_separable_conv",), doc=__doc__))
kernel(TYPE, "cpu", cpu.fused_separable_conv2d_cpu, bind=cpu.bind_fused_separable_conv2d)
kernel(TYPE, "gpu", cuda.fused_separable_conv2d_gpu, dtypes=GPU_FLOATS)


def fused_separable_conv2d_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); an inference op, so no gradients."""
    return [("mobilenet-f32", {"x": ex.r(3, 4, 9, 8), "dw_filter": ex.r(4, 1, 3, 3, seed=1),
                               "dw_bias": ex.r(4, seed=2), "filter": ex.r(6, 4, 1, 1, seed=3),
                               "bias": ex.r(6, seed=4)},
             dict(paddings=1, groups=4, dw_activation="relu", activation="relu"), ()),
            ("strided-multiplier-residual-f32",
             {"x": ex.r(2, 3, 10, 9), "dw_filter": ex.r(6, 1, 3, 3, seed=1),
              "filter": ex.r(5, 6, 1, 1, seed=3), "residual": ex.r(2, 5, 5, 5, seed=5)},
             dict(strides=2, paddings=1, groups=3, activation="relu"), ()),
            ("dilated-f64", {"x": ex.r(2, 3, 9, 9, dtype=np.float64),
                             "dw_filter": ex.r(3, 1, 3, 3, seed=1, dtype=np.float64),
                             "filter": ex.r(4, 3, 1, 1, seed=3, dtype=np.float64),
                             "bias": ex.r(4, seed=4, dtype=np.float64)},
             dict(paddings=2, dilations=2, groups=3, dw_activation="relu"), ()),
            ("nhwc-f32", {"x": ex.r(2, 7, 6, 4), "dw_filter": ex.r(4, 1, 3, 3, seed=1),
                          "dw_bias": ex.r(4, seed=2), "filter": ex.r(3, 4, 1, 1, seed=3),
                          "residual": ex.r(2, 7, 6, 3, seed=5)},
             dict(paddings=1, groups=4, data_layout="NHWC", dw_activation="relu"), ())]


examples(TYPE, fused_separable_conv2d_examples)
