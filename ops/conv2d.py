"""conv2d: a grouped, strided, padded, dilated 2-D convolution (cross-correlation), NCHW.

x (N, C, H, W), filter (O, C / groups, kh, kw) -> out (N, O, Ho, Wo) with
Ho = floor((H + 2 ph - dh (kh - 1) - 1) / sh) + 1 (likewise Wo). Output
channel o of group g = o // (O / groups) sees input channels
[g C / groups, (g + 1) C / groups). No bias: add one with elementwise_add(axis=1).
CPU: im2col through a strided view, one batched matmul over the groups;
the grad scatters columns back with one strided add per filter tap.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import conv2d as gpu
from minigraph.ops.device import GPU_FLOATS, present
from minigraph.ops.window import as_pair, offset_slices, out_size, pad_hw, pair_attr
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    check_float,
    check_rank,
    check_same_dtype,
    fail,
    grad_maker,
    grad_schema,
    int_attr,
    kernel,
    positive,
    register,
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


def im2col(x, k_hw, attrs, hw):
    """Columns (C, kh, kw, N, Ho, Wo): cols[c, i, j, n, h, w] is the input under
    tap (i, j) of the window at output (h, w). A contiguous copy."""
    xp = pad_hw(x, attrs["paddings"])
    (kh, kw), (sh, sw), (dh, dw) = k_hw, attrs["strides"], attrs["dilations"]
    s_n, s_c, s_h, s_w = xp.strides
    view = np.lib.stride_tricks.as_strided(
        xp, shape=(x.shape[1], kh, kw, x.shape[0]) + hw,
        strides=(s_c, s_h * dh, s_w * dw, s_n, s_h * sh, s_w * sw), writeable=False)
    return np.ascontiguousarray(view)


def col2im(dcols, x_shape, attrs, hw):
    """The adjoint of im2col: dcols (C, kh, kw, N, Ho, Wo) summed back into an
    array of x_shape, one strided add per tap."""
    n, c, h, w = x_shape
    ph, pw = attrs["paddings"]
    dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=dcols.dtype)
    for i in range(dcols.shape[1]):
        for j in range(dcols.shape[2]):
            dxp[offset_slices(i, j, hw, attrs["strides"], attrs["dilations"])] += \
                dcols[:, i, j].transpose(1, 0, 2, 3)
    return np.ascontiguousarray(dxp[:, :, ph:ph + h, pw:pw + w])


def infer_conv_grad(ins, attrs):
    x, w = ins["x"], ins["filter"]
    return {"dx": Meta(x.shape, x.dtype), "dfilter": Meta(w.shape, w.dtype)}


CONV = register(OpSchema(
    type="conv2d", inputs=(Slot("x"), Slot("filter")), outputs=(Slot("out"),),
    attrs=conv_attrs(), infer=infer_conv, resolve_attrs=resolve, doc=__doc__,
    grad=grad_maker("conv2d_grad", keep=("x", "filter"), wrt=("x", "filter"))))
register(grad_schema(CONV, inputs=(Slot("x"), Slot("filter"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dfilter", optional=True)),
                     infer=infer_conv_grad))


def grouped_cols(x, k_hw, attrs, hw):
    """im2col as (G, C/G kh kw, N Ho Wo)."""
    g = attrs["groups"]
    rows = x.shape[1] // g * k_hw[0] * k_hw[1]
    return im2col(x, k_hw, attrs, hw).reshape(g, rows, x.shape[0] * hw[0] * hw[1])


def grouped_filter(w, groups):
    """filter as (G, O/G, C/G kh kw)."""
    return w.reshape(groups, w.shape[0] // groups, w[0].size)


@kernel("conv2d", "cpu")
def conv2d_cpu(op, ins):
    """out[n, o] = sum over the group's channels and taps of filter * window."""
    x, w = ins["x"], ins["filter"]
    hw = out_hw(op.type, x.shape, w.shape[2:], op.attrs)
    cols = grouped_cols(x, w.shape[2:], op.attrs, hw)
    out = np.matmul(grouped_filter(w, op.attrs["groups"]), cols)
    out = out.reshape((w.shape[0], x.shape[0]) + hw).transpose(1, 0, 2, 3)
    return {"out": np.ascontiguousarray(out)}


@kernel("conv2d_grad", "cpu")
def conv2d_grad_cpu(op, ins):
    """dfilter = dout @ cols^T per group; dx = col2im(filter^T @ dout)."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    g = op.attrs["groups"]
    hw = out_hw("conv2d", x.shape, w.shape[2:], op.attrs)
    d = np.ascontiguousarray(d.transpose(1, 0, 2, 3)).reshape(g, w.shape[0] // g, d[:, 0].size)
    out = {}
    if op.wants("dfilter"):
        cols = grouped_cols(x, w.shape[2:], op.attrs, hw)
        out["dfilter"] = np.matmul(d, cols.transpose(0, 2, 1)).reshape(w.shape)
    if op.wants("dx"):
        dcols = np.matmul(grouped_filter(w, g).transpose(0, 2, 1), d)
        dcols = dcols.reshape((x.shape[1],) + w.shape[2:] + (x.shape[0],) + hw)
        out["dx"] = col2im(dcols, x.shape, op.attrs, hw)
    return out


def conv_geometry(op):
    """The launchers' keyword arguments for this op's attributes."""
    a = op.attrs
    return dict(strides=a["strides"], paddings=a["paddings"], dilations=a["dilations"],
                groups=a["groups"])


@kernel("conv2d", "gpu", dtypes=GPU_FLOATS)
def conv2d_gpu(op, ins):
    """out on the device: im2col in chunks, one batched matrix product per chunk."""
    x, w = ins["x"], ins["filter"]
    return {"out": gpu.conv2d(x, w, **conv_geometry(op))}


@kernel("conv2d_grad", "gpu", dtypes=GPU_FLOATS)
def conv2d_grad_gpu(op, ins):
    """dfilter (dout @ cols^T, summed over images) and dx (col2im of filter^T @ dout)
    on the device; each only when bound."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    dx, dw = gpu.conv2d_grad(x, w, d, **conv_geometry(op), need_dx=op.wants("dx"),
                             need_dfilter=op.wants("dfilter"))
    return present(dx=dx, dfilter=dw)
