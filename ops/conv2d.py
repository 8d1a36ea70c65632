"""conv2d: a grouped, strided, padded, dilated 2-D convolution (cross-correlation), NCHW.

x (N, C, H, W), filter (O, C / groups, kh, kw) -> out (N, O, Ho, Wo) with
Ho = floor((H + 2 ph - dh (kh - 1) - 1) / sh) + 1 (likewise Wo). Output
channel o of group g = o // (O / groups) sees input channels
[g C / groups, (g + 1) C / groups). No bias: add one with elementwise_add(axis=1).
CPU: float32 convs of one group on the native kernels (kernels/conv2d_cpu:
windows read from a per-image buffer in cache, no columns; built where a C
compiler works), the rest on minigraph.ops.conv_cpu (im2col in chunks of
images, one BLAS product per chunk; the grad adds columns back per tap).
"""
from __future__ import annotations

from minigraph import cpu_blocks
from minigraph.kernels import conv2d as gpu
from minigraph.kernels import conv2d_cpu as native_conv
from minigraph.ops import conv_cpu, conv_cpu_grad
from minigraph.ops.device import GPU_FLOATS, present
from minigraph.ops.window import as_pair, out_size, pair_attr
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import check_float, check_rank, check_same_dtype, fail, int_attr, positive

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


CONV = register(OpSchema(
    type="conv2d", inputs=(Slot("x"), Slot("filter")), outputs=(Slot("out"),),
    attrs=conv_attrs(), infer=infer_conv, resolve_attrs=resolve, doc=__doc__, work_room=True,
    grad=grad_maker("conv2d_grad", keep=("x", "filter"), wrt=("x", "filter"))))
register(grad_schema(CONV, inputs=(Slot("x"), Slot("filter"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dfilter", optional=True)),
                     infer=infer_conv_grad, work_room=True))


def cpu_geometry(op, x, w):
    """The CPU engine's Geometry of this op on x and filter."""
    a = op.attrs
    return conv_cpu.geometry(x.shape, w.shape, a["strides"], a["paddings"], a["dilations"],
                             a["groups"])


@kernel("conv2d", "cpu")
def conv2d_cpu(op, ins, ctx):
    """out[n, o] = sum over the group's channels and taps of filter * window: the
    native kernel where it takes the conv (kernels/conv2d_cpu: float32, one group),
    else conv_cpu's engine with lean work arrays, like its gradient's (conv2d is
    the op training steps run, and their peak memory comes from these;
    fused_conv2d, for inference, takes full chunks), or up to `ctx.room` bytes of them
    (OpSchema.work_room)."""
    x, w = ins["x"], ins["filter"]
    g = cpu_geometry(op, x, w)
    if native_conv.supports(g, x.dtype):
        return {"out": native_conv.forward(x, w, g, cpu_blocks.get_num_threads())}
    return {"out": conv_cpu.forward(x, w, g, lean=True, room=ctx.room)}


@kernel("conv2d_grad", "cpu")
def conv2d_grad_cpu(op, ins, ctx):
    """dx and dfilter (each only when bound): the native kernels where they take the
    conv (dfilter; dx as forward passes over dout, one per phase of the stride),
    else conv_cpu_grad: dx of a stride-1 conv as the conv of dout with the flipped
    filter, dfilter from the same columns, else products with the columns and
    col2im; lean work arrays, or up to `ctx.room` bytes of them."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    g = cpu_geometry(op, x, w)
    need_dx, need_dw = op.wants("dx"), op.wants("dfilter")
    if native_conv.supports(g, x.dtype):
        threads = cpu_blocks.get_num_threads()
        return present(dx=native_conv.input_grad(w, d, g, threads) if need_dx else None,
                       dfilter=native_conv.filter_grad(x, d, g, threads) if need_dw else None)
    dx, dw = conv_cpu_grad.backward(x, w, d, g, need_dx=need_dx, need_dw=need_dw, room=ctx.room)
    return present(dx=dx, dfilter=dw)


def conv_geometry(op):
    """The launchers' keyword arguments for this op's attributes."""
    a = op.attrs
    return dict(strides=a["strides"], paddings=a["paddings"], dilations=a["dilations"],
                groups=a["groups"])


@kernel("conv2d", "gpu", dtypes=GPU_FLOATS)
def conv2d_gpu(op, ins, ctx):
    """out on the device: im2col in chunks, one batched matrix product per chunk."""
    x, w = ins["x"], ins["filter"]
    return {"out": gpu.conv2d(x, w, **conv_geometry(op))}


@kernel("conv2d_grad", "gpu", dtypes=GPU_FLOATS)
def conv2d_grad_gpu(op, ins, ctx):
    """dfilter (dout @ cols^T, summed over images) and dx (col2im of filter^T @ dout)
    on the device; each only when bound."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    dx, dw = gpu.conv2d_grad(x, w, d, **conv_geometry(op), need_dx=op.wants("dx"),
                             need_dfilter=op.wants("dfilter"))
    return present(dx=dx, dfilter=dw)
