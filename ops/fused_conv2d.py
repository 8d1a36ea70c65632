"""fused_conv2d: conv2d, a per-channel bias, a residual and relu as one op (inference).

out = act(conv2d(x, filter) + bias[o] + residual), act = relu or the identity;
`bias` (O,) and `residual` (out's shape) are optional. The attributes are
conv2d's (strides, paddings, dilations, groups, data_layout: the bias goes along
the channel axis of either layout) and `activation` ("relu" or "none").
mg.passes.fuse_conv2d builds it from conv2d -> elementwise_add (the layer's bias,
on the channel axis) -> add (a residual of the same shape) -> relu chains of
an inference net, so the bias, the residual and relu are applied to each chunk
of the convolution's output while it is in cache, with no array in between.

It is an inference-only op: it has no gradient, and backward through it is an
error (train the net with conv2d and fuse its inference copy).
Kernels (beside conv2d's): kernels/cpu/conv2d.py (the native kernel with the
epilogue on each tile of outputs in registers, else the im2col engine with it on
each chunk) and kernels/cuda/conv2d.py (the conv2d launcher, then the bias,
residual and relu launchers in place on its output). In ONNX it is Conv (with
the bias as its third input; NHWC between two Transposes), then Add of the
residual and Relu.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import conv2d as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import conv2d_nhwc as cuda
from minigraph.kernels.layout import channel_axis
from minigraph.ops.conv2d import conv_attrs, conv_nodes, infer_conv, resolve
from minigraph.schema import OpSchema, Slot, examples, inference_only, kernel, register
from minigraph.validators import check_extra_input, infer_as, one_of, str_attr

TYPE = "fused_conv2d"


def infer_fused(ins, attrs):
    out = infer_as(TYPE, "conv2d", infer_conv, ins, attrs)["out"]
    channels = out.shape[channel_axis(attrs["data_layout"])]
    check_extra_input(TYPE, "bias", ins.get("bias"), ins["x"], (channels,),
                      " (one value per output channel)")
    check_extra_input(TYPE, "residual", ins.get("residual"), ins["x"], out.shape,
                      " (the convolution's output shape)")
    return {"out": out}


def export_fused(ctx, op):
    """Conv (the bias as its third input), then Add of the residual, then Relu."""
    ins = [ctx.value(op.inputs[s]) for s in ("x", "filter")]
    if op.inputs["bias"] is not None:
        ins.append(ctx.value(op.inputs["bias"]))
    residual = op.inputs["residual"]
    return ctx.epilogue(op.outputs["out"], "conv", lambda name: conv_nodes(ctx, op, ins, name),
                        [("residual", residual)] if residual is not None else [],
                        "relu" if op.attrs["activation"] == "relu" else None)


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("filter"), Slot("bias", optional=True),
            Slot("residual", optional=True)),
    outputs=(Slot("out"),),
    attrs=conv_attrs() + (str_attr("activation", "none", one_of("none", "relu")),),
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
             dict(strides=2, dilations=2, data_layout="NHWC"), ())]


examples(TYPE, fused_conv2d_examples)
