"""conv2d: a grouped, strided, padded, dilated 2-D convolution (cross-correlation), NCHW.

x (N, C, H, W), filter (O, C / groups, kh, kw) -> out (N, O, Ho, Wo) with
Ho = floor((H + 2 ph - dh (kh - 1) - 1) / sh) + 1 (likewise Wo). Output
channel o of group g = o // (O / groups) sees input channels
[g C / groups, (g + 1) C / groups). No bias: add one with elementwise_add(axis=1).
Kernels: kernels/cpu/conv2d.py (float32 convs of one group on the native
kernels of kernels/cpu/conv_native.c where a C compiler works, the rest by
im2col in chunks of images, one BLAS product per chunk) and kernels/cuda/conv2d.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import conv2d as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import conv2d as cuda
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
    out_size,
    pair_attr,
    positive,
)

PAIR_ATTRS = ("strides", "paddings", "dilations")


def conv_attrs():
    return (pair_attr("strides", (1, 1), 1), pair_attr("paddings", (0, 0), 0),
            pair_attr("dilations", (1, 1), 1), int_attr("groups", 1, positive))


def resolve(attrs):
    return {**attrs, **{name: as_pair(attrs[name]) for name in PAIR_ATTRS}}


def out_hw(op_type, x_shape, k_hw, attrs):
    """(Ho, Wo); OpError when the padded input is smaller than the dilated filter."""
    sizes = []
    for axis, name in ((0, "height"), (1, "width")):
        size, k = x_shape[2 + axis], k_hw[axis]
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
    g = attrs["groups"]
    c, o = x.shape[1], w.shape[0]
    if c >= 0 and c % g:
        fail("conv2d", "x", f"has {c} channels (shape {x.shape}), not divisible by groups={g}")
    if o >= 0 and o % g:
        fail("conv2d", "filter", f"has {o} output channels (shape {w.shape}), not divisible "
                                 f"by groups={g}")
    if c >= 0 and w.shape[1] >= 0 and w.shape[1] != c // g:
        fail("conv2d", "filter", f"must have {c // g} input channels (dim 1) for input 'x' "
                                 f"with {c} channels and groups={g}, got shape {w.shape}")
    ho, wo = out_hw("conv2d", x.shape, w.shape[2:], attrs)
    return {"out": Meta((x.shape[0], o, ho, wo), x.dtype)}


def infer_conv_grad(ins, attrs):
    x, w = ins["x"], ins["filter"]
    return {"dx": Meta(x.shape, x.dtype), "dfilter": Meta(w.shape, w.dtype)}


def export_conv2d(ctx, op):
    """Conv with explicit symmetric pads, strides, dilations and group."""
    return [conv_node(ctx, op, [ctx.value(op.inputs["x"]), ctx.value(op.inputs["filter"])],
                      ctx.output(op.outputs["out"]))]


def conv_node(ctx, op, inputs, output):
    """The ONNX Conv of a conv2d or fused_conv2d op on `inputs` (x, filter[, bias])."""
    a = op.attrs
    ph, pw = onnx_export.pair(a["paddings"])
    return ctx.node("Conv", inputs, [output], kernel_shape=list(ctx.shape(op.inputs["filter"])[2:]),
                    pads=[ph, pw, ph, pw], strides=list(onnx_export.pair(a["strides"])),
                    dilations=list(onnx_export.pair(a["dilations"])), group=int(a["groups"]))


CONV = register(OpSchema(
    type="conv2d", inputs=(Slot("x"), Slot("filter")), outputs=(Slot("out"),),
    attrs=conv_attrs(), infer=infer_conv, resolve_attrs=resolve, doc=__doc__, work_room=True,
    grad=grad_maker("conv2d_grad", keep=("x", "filter"), wrt=("x", "filter")),
    export=export_conv2d, roles=("conv", "linear"), weight=("filter", 0, 1)))
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
    ]


examples("conv2d", conv2d_examples)
