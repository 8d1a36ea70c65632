"""pool2d: max or average pooling over 2-D windows, NCHW or NHWC.

data_layout "NCHW" (default): x (N, C, H, W) -> out (N, C, Ho, Wo); "NHWC" (channels
last): x (N, H, W, C) -> out (N, Ho, Wo, C). Ho = floor((H + 2 ph - kh) / sh) + 1;
`strides` None means `ksize`; `global_pooling` pools each whole H x W plane to
1 x 1 (ksize, strides and paddings are then ignored). Padding never wins a max (it is
-inf) and is not counted by an average: the divisor is the number of real
elements under the window. Padding must be smaller than the window, so
every window holds at least one real element.
Grad: max sends dout to the first maximum of each window (row-major: the first
tap, replaced by a later one only where strictly greater, as on the GPU); avg
spreads dout / count over the real elements of the window.
Kernels: kernels/cpu/pool2d.py, kernels/cuda/pool2d.py. In ONNX (NCHW only) an NHWC
pool is Transpose, the pool, Transpose.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import pool2d as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import pool2d as cuda
from minigraph.kernels.layout import image_shape, nchw_sizes, spatial_axes
from minigraph.ops.conv2d import channels_last, layout_attr
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
    bool_attr,
    check_float,
    check_rank,
    one_of,
    out_size,
    pair_attr,
    str_attr,
)


def pool_attrs():
    return (str_attr("pool_type", "max", one_of("max", "avg")),
            pair_attr("ksize", (2, 2), 1), pair_attr("strides", None, 1, nullable=True),
            pair_attr("paddings", (0, 0), 0), bool_attr("global_pooling", False), layout_attr())


def resolve(attrs):
    ksize = as_pair(attrs["ksize"])
    strides = as_pair(attrs["strides"]) or ksize
    return {**attrs, "ksize": ksize, "strides": strides, "paddings": as_pair(attrs["paddings"])}


def validate_pool(op):
    a = op.attrs
    (ph, pw), (kh, kw) = a["paddings"], a["ksize"]
    if not a["global_pooling"] and (ph >= kh or pw >= kw):
        raise OpError(f"{op.type}: attribute 'paddings' {a['paddings']} must be smaller than "
                      f"'ksize' {a['ksize']} in each dim, so every window holds an element "
                      "of the input")


def out_hw(op_type, x_shape, attrs):
    """(Ho, Wo); OpError when the padded input is smaller than the window."""
    if attrs["global_pooling"]:
        return (1, 1)
    sizes = []
    spatial = spatial_axes(attrs["data_layout"])
    for axis, name in ((0, "height"), (1, "width")):
        size = x_shape[spatial[axis]]
        k, s, p = (attrs[a][axis] for a in ("ksize", "strides", "paddings"))
        o = out_size(size, k, s, p)
        if size >= 0 and o <= 0:
            raise OpError(f"{op_type}: output {name} would be {o}: input 'x' {name} {size} "
                          f"plus padding 2*{p} is smaller than the window {k}")
        sizes.append(o)
    return tuple(sizes)


def infer_pool(ins, attrs):
    x = ins["x"]
    check_rank("pool2d", "x", x, (4,))
    check_float("pool2d", "x", x)
    layout = attrs["data_layout"]
    n, c, _, _ = nchw_sizes(layout, x.shape)
    return {"out": Meta(image_shape(layout, n, c, *out_hw("pool2d", x.shape, attrs)), x.dtype)}


def export_pool2d(ctx, op):
    """MaxPool / AveragePool (padding excluded from the divisor) with explicit
    pads; global pooling -> GlobalMaxPool / GlobalAveragePool; NHWC between two
    Transposes."""
    a, x, out = op.attrs, ctx.value(op.inputs["x"]), ctx.output(op.outputs["out"])
    kind = "Max" if a["pool_type"] == "max" else "Average"
    if a["global_pooling"]:
        attrs, onnx_type = {}, f"Global{kind}Pool"
    else:
        ksize = onnx_export.pair(a["ksize"])
        strides = ksize if a["strides"] is None else onnx_export.pair(a["strides"])
        ph, pw = onnx_export.pair(a["paddings"])
        attrs = dict(kernel_shape=list(ksize), strides=list(strides), pads=[ph, pw, ph, pw],
                     **({} if kind == "Max" else {"count_include_pad": 0}))
        onnx_type = f"{kind}Pool"
    if a["data_layout"] == "NCHW":
        return [ctx.node(onnx_type, [x], [out], **attrs)]
    return channels_last(ctx, op, x, out,
                         lambda xt, yt: [ctx.node(onnx_type, [xt], [yt], **attrs)])


POOL = register(OpSchema(
    type="pool2d", inputs=(Slot("x"),), outputs=(Slot("out"),), attrs=pool_attrs(),
    infer=infer_pool, validate=validate_pool, resolve_attrs=resolve, export=export_pool2d,
    doc=__doc__, roles=("pool",),
    grad=grad_maker("pool2d_grad")))   # dx from x and dout: the max is located again


def averages(attrs):
    """Whether pool2d_grad averages (then it reads only x's shape, so a training step
    drops x's values once the forward pass has read them)."""
    return attrs["pool_type"] == "avg"


register(grad_schema(POOL, inputs=(Slot("x", shape_only=averages), Slot("dout")),
                     outputs=(Slot("dx", optional=True),),
                     infer=lambda ins, attrs: {"dx": ins["x"]}, validate=validate_pool))

kernel("pool2d", "cpu", cpu.pool2d_cpu, bind=cpu.bind_pool2d)
kernel("pool2d_grad", "cpu", cpu.pool2d_grad_cpu)
kernel("pool2d", "gpu", cuda.pool2d_gpu, dtypes=GPU_FLOATS)
kernel("pool2d_grad", "gpu", cuda.pool2d_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def pool2d_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("max-f32", {"x": ex.r(2, 3, 6, 6)}, dict(ksize=2), (("x",),)),
        ("avg-pad-f64", {"x": ex.r(2, 2, 7, 7, dtype=np.float64)},
         dict(pool_type="avg", ksize=3, strides=2, paddings=1), (("x",),)),
        ("max-pad-f32", {"x": ex.r(1, 2, 5, 5)}, dict(ksize=3, strides=2, paddings=1), (("x",),)),
        ("global-max-f64", {"x": ex.r(2, 3, 4, 5, dtype=np.float64)},
         dict(global_pooling=True), (("x",),)),
        ("global-avg-f32", {"x": ex.r(2, 3, 4, 5)},
         dict(pool_type="avg", global_pooling=True), (("x",),)),
        ("nhwc-max-pad-f32", {"x": ex.r(2, 5, 6, 3)},
         dict(ksize=3, strides=2, paddings=1, data_layout="NHWC"), (("x",),)),
        ("nhwc-avg-pad-f64", {"x": ex.r(2, 7, 7, 2, dtype=np.float64)},
         dict(pool_type="avg", ksize=3, strides=2, paddings=1, data_layout="NHWC"), (("x",),)),
        ("nhwc-max-tiles-f32", {"x": ex.r(2, 4, 6, 5)}, dict(ksize=2, data_layout="NHWC"),
         (("x",),)),
        ("nhwc-global-max-f64", {"x": ex.r(2, 4, 5, 3, dtype=np.float64)},
         dict(global_pooling=True, data_layout="NHWC"), (("x",),)),
        ("nhwc-global-avg-f32", {"x": ex.r(2, 4, 5, 3)},
         dict(pool_type="avg", global_pooling=True, data_layout="NHWC"), (("x",),)),
    ]


examples("pool2d", pool2d_examples)
