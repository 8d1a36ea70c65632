"""conv2d: a grouped, strided, padded, dilated 2-D convolution (cross-correlation).

data_layout "NCHW" (default): x (N, C, H, W), filter (O, C / groups, kh, kw) -> out
(N, O, Ho, Wo); "NHWC" (channels last): x (N, H, W, C) -> out (N, Ho, Wo, O), the
filter the same (O, C / groups, kh, kw) in both (checkpoints load either way). Ho =
floor((H + 2 ph - dh (kh - 1) - 1) / sh) + 1 (likewise Wo). Output channel o of
group g = o // (O / groups) sees input channels [g C / groups, (g + 1) C / groups).
C must be > 0. No bias: add one with elementwise_add on the channel axis (axis 1,
or 3 in NHWC).
Kernels: kernels/cpu/conv2d.py (float32 convs of one group on the native
kernels of kernels/cpu/conv_native.c - NCHW - and conv_nhwc.h - NHWC - where a C
compiler works, the rest by im2col in chunks of images, one BLAS product per
chunk: conv_im2col / conv_im2col_nhwc) and kernels/cuda/conv2d_nhwc.py (NHWC;
NCHW: kernels/cuda/conv2d.py). In ONNX (NCHW only) an NHWC conv is Transpose,
Conv, Transpose.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import conv2d as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import conv2d_nhwc as cuda
from minigraph.kernels.layout import LAYOUTS, channel_axis, image_shape, spatial_axes
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import (
    as_pair,
    check_float,
    check_rank,
    check_same_dtype,
    fail,
    int_attr,
    one_of,
    out_size,
    pair_attr,
    positive,
    str_attr,
)

PAIR_ATTRS = ("strides", "paddings", "dilations")


def conv_attrs():
    return (pair_attr("strides", (1, 1), 1), pair_attr("paddings", (0, 0), 0),
            pair_attr("dilations", (1, 1), 1), int_attr("groups", 1, positive),
            layout_attr())


def layout_attr():
    """The data_layout attribute of the 2-D ops: "NCHW" (default) or "NHWC"."""
    return str_attr("data_layout", "NCHW", one_of(*LAYOUTS))


def resolve(attrs):
    return {**attrs, **{name: as_pair(attrs[name]) for name in PAIR_ATTRS}}


def out_hw(op_type, x_shape, k_hw, attrs):
    """(Ho, Wo); OpError when the padded input is smaller than the dilated filter."""
    sizes = []
    spatial = spatial_axes(attrs["data_layout"])
    for axis, name in ((0, "height"), (1, "width")):
        size, k = x_shape[spatial[axis]], k_hw[axis]
        s, p, d = (attrs[a][axis] for a in PAIR_ATTRS)
        o = out_size(size, k, s, p, d)
        if size >= 0 and k >= 0 and o <= 0:
            raise OpError(f"{op_type}: output {name} would be {o}: input 'x' {name} {size} "
                          f"plus padding 2*{p} is smaller than the dilated filter "
                          f"{d * (k - 1) + 1} (filter {k}, dilation {d})")
        sizes.append(o)
    return tuple(sizes)


def infer_conv(ins, attrs):
    x, w = ins["x"], ins["filter"]
    check_rank("conv2d", "x", x, (4,))
    check_float("conv2d", "x", x)
    check_rank("conv2d", "filter", w, (4,))
    check_same_dtype("conv2d", "filter", w, "x", x)
    g, layout = attrs["groups"], attrs["data_layout"]
    c, o = x.shape[channel_axis(layout)], w.shape[0]
    if c == 0:
        fail("conv2d", "x", f"has 0 channels (shape {x.shape}, {layout})")
    if c >= 0 and c % g:
        fail("conv2d", "x", f"has {c} channels (shape {x.shape}), not divisible by groups={g}")
    if o >= 0 and o % g:
        fail("conv2d", "filter", f"has {o} output channels (shape {w.shape}), not divisible "
                                 f"by groups={g}")
    if c >= 0 and w.shape[1] >= 0 and w.shape[1] != c // g:
        fail("conv2d", "filter", f"must have {c // g} input channels (dim 1) for input 'x' "
                                 f"with {c} channels and groups={g}, got shape {w.shape}")
    ho, wo = out_hw("conv2d", x.shape, w.shape[2:], attrs)
    return {"out": Meta(image_shape(layout, x.shape[0], o, ho, wo), x.dtype)}


def infer_conv_grad(ins, attrs):
    x, w = ins["x"], ins["filter"]
    return {"dx": Meta(x.shape, x.dtype), "dfilter": Meta(w.shape, w.dtype)}


def export_conv2d(ctx, op):
    """Conv with explicit symmetric pads, strides, dilations and group (NHWC: between
    two Transposes)."""
    return conv_nodes(ctx, op, [ctx.value(op.inputs["x"]), ctx.value(op.inputs["filter"])],
                      ctx.output(op.outputs["out"]))


def conv_nodes(ctx, op, inputs, output):
    """The ONNX nodes of a conv2d or fused_conv2d op on `inputs` (x, filter[, bias]):
    one Conv, or in NHWC (ONNX's Conv is NCHW only) x transposed to NCHW, the Conv,
    and its result transposed back to NHWC."""
    a = op.attrs
    ph, pw = onnx_export.pair(a["paddings"])
    conv = dict(kernel_shape=list(ctx.shape(op.inputs["filter"])[2:]), pads=[ph, pw, ph, pw],
                strides=list(onnx_export.pair(a["strides"])),
                dilations=list(onnx_export.pair(a["dilations"])), group=int(a["groups"]))
    if a["data_layout"] == "NCHW":
        return [ctx.node("Conv", inputs, [output], **conv)]
    return channels_last(ctx, op, inputs[0], output,
                         lambda x, y: [ctx.node("Conv", [x, *inputs[1:]], [y], **conv)])


def channels_last(ctx, op, x, output, nchw_nodes):
    """The nodes computing `output` (NHWC) by NCHW nodes: Transpose of x (an ONNX name,
    NHWC) to NCHW, nchw_nodes(x_nchw, y_nchw), Transpose of y_nchw to `output`."""
    out = op.outputs["out"]
    x_nchw, y_nchw = ctx.temp(out, "x_nchw"), ctx.temp(out, "nchw")
    return [ctx.node("Transpose", [x], [x_nchw], perm=[0, 3, 1, 2]),
            *nchw_nodes(x_nchw, y_nchw),
            ctx.node("Transpose", [y_nchw], [output], perm=[0, 2, 3, 1])]


CONV = register(OpSchema(
    type="conv2d", inputs=(Slot("x"), Slot("filter")), outputs=(Slot("out"),),
    attrs=conv_attrs(), infer=infer_conv, resolve_attrs=resolve, doc=__doc__, work_room=True,
    grad=grad_maker("conv2d_grad", keep=("x", "filter"), wrt=("x", "filter")),
    export=export_conv2d, roles=("conv", "linear"),
    weight=("filter", 0, lambda attrs: channel_axis(attrs["data_layout"]))))
register(grad_schema(CONV, inputs=(Slot("x"), Slot("filter"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dfilter", optional=True)),
                     infer=infer_conv_grad, work_room=True))

kernel("conv2d", "cpu", cpu.conv2d_cpu)
kernel("conv2d_grad", "cpu", cpu.conv2d_grad_cpu)
kernel("conv2d", "gpu", cuda.conv2d_gpu, dtypes=GPU_FLOATS)
kernel("conv2d_grad", "gpu", cuda.conv2d_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def conv2d_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("groups-f32", {"x": ex.r(2, 4, 6, 6), "filter": ex.r(6, 2, 3, 3)},
         dict(paddings=1, groups=2), (("x", "filter"), ("x",), ("filter",))),
        ("strided-f64", {"x": ex.r(1, 3, 9, 8, dtype=np.float64),
                "filter": ex.r(4, 3, 3, 2, dtype=np.float64)},
         dict(strides=2, paddings=(1, 0), dilations=2), (("x", "filter"),)),
        ("nhwc-groups-f32", {"x": ex.r(2, 6, 5, 4), "filter": ex.r(6, 2, 3, 3)},
         dict(paddings=1, groups=2, data_layout="NHWC"), (("x", "filter"), ("x",), ("filter",))),
        ("nhwc-strided-f64", {"x": ex.r(1, 9, 8, 3, dtype=np.float64),
                              "filter": ex.r(5, 3, 3, 2, dtype=np.float64)},
         dict(strides=(2, 1), paddings=(1, 0), dilations=(1, 2), data_layout="NHWC"),
         (("x", "filter"),)),
    ]


examples("conv2d", conv2d_examples)
