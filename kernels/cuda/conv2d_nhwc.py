"""Launchers for kernels/conv2d_nhwc.cu (+ matmul.cu): conv2d forward and gradients on
channels-last (NHWC) device arrays, by im2col and tiled matrix products; and the
conv ops' GPU kernels, which send NCHW convs to kernels/conv2d.py.

x (N, H, W, C), filter (O, C / G, kh, kw) (the NCHW filter), out (N, Ho, Wo, O).
Images are processed in chunks whose columns fit launch.COLS_BUDGET; a chunk's
columns are one row per output pixel (P = images x Ho Wo rows of C kh kw), so per
group g (Og = O / G output channels, Kg = C / G kh kw):
  out[:, g]     = cols[:, g] (P x Kg) @ filter_g^T (Kg x Og)     already NHWC
  dfilter_g    += dout[:, g]^T (Og x P) @ cols[:, g] (P x Kg)
  dcols[:, g]   = dout[:, g] (P x Og) @ filter_g (Og x Kg), then dx = col2im(dcols).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cpu.conv_separable import parts
from minigraph.kernels.cuda import (
    activation,
    broadcast,
    conv2d,
    elementwise,
    launch,
    loader,
    pool2d,
)
from minigraph.kernels.cuda.matmul import gemm_plan
from minigraph.kernels.layout import nchw_sizes

MODULE = "conv2d_nhwc"
SIGNATURES = {f"{k}_nhwc_{t}": "PP" + "i" * 14 for k in ("im2col", "col2im")
              for t in ("f32", "f64")}


def _pair(v):
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


def geometry(x_shape, w_shape, strides=1, paddings=0, dilations=1, groups=1):
    """conv2d.geometry's dict for a channels-last x (N, H, W, C)."""
    return conv2d.geometry(nchw_sizes("NHWC", x_shape), w_shape, strides, paddings,
                           dilations, groups)


def _cols_launch(kind, dtype, nb, g):
    """go(src, dst): the im2col or col2im launch for `nb` images of geometry `g`."""
    name = f"{kind}_nhwc_{loader.suffix(dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    items = nb * (g["CKK"] * g["HW"] if kind == "im2col" else g["C"] * g["H"] * g["W"])
    go = k.prepared((launch.flat_grid(items, dev, threads, k.resources), 1, 1), (threads, 1, 1))
    sizes = (nb, g["C"], g["H"], g["W"], g["kh"], g["kw"], g["sh"], g["sw"], g["ph"], g["pw"],
             g["dh"], g["dw"], g["Ho"], g["Wo"])
    return lambda src, dst: go(src, dst, *sizes)


def _chunks(g, itemsize):
    nb = launch.conv_chunk(g["N"], g["CKK"] * g["HW"] * itemsize, g["G"], loader.device())
    return nb, [(n0, min(nb, g["N"] - n0)) for n0 in range(0, g["N"], nb)]


def _plan(kind, x, w, strides, paddings, dilations, groups, make):
    """The plan `make(x, geometry)` of a launcher, once per device, kind, shapes, dtypes
    and attributes (unhashable attributes are normalised first)."""
    plans = loader.cached("conv2d_nhwc.plans", dict)
    pairs = tuple(_pair(v) for v in (strides, paddings, dilations))
    key = (kind, tuple(x.shape), tuple(w.shape), x.dtype, w.dtype, pairs, int(groups))
    found = plans.get(key)
    if found is None:
        g = geometry(x.shape, w.shape, *pairs, groups)
        launch.check_array(f"{kind}: filter", w, w.shape, x.dtype)
        found = plans[key] = make(x, g)
    return found


class _Forward:
    """conv2d_nhwc's launches for one geometry: out's shape, the columns' size
    (values), and per chunk (x offset, out offset in bytes, im2col, the product)."""

    def __init__(self, x, g):
        itemsize = np.dtype(x.dtype).itemsize
        self.out_shape = (g["N"], g["Ho"], g["Wo"], g["O"])
        nb, chunks = _chunks(g, itemsize)
        self.cols = nb * g["CKK"] * g["HW"]
        og, kg = g["Og"], g["Kg"]
        self.chunks = [
            (n0 * g["H"] * g["W"] * g["C"] * itemsize, n0 * g["HW"] * g["O"] * itemsize,
             _cols_launch("im2col", x.dtype, count, g),
             gemm_plan(x.dtype, False, True, count * g["HW"], og, kg, g["CKK"], kg, g["O"],
                       inner_count=g["G"], batches=g["G"],
                       strides=(0, kg, 0, og * kg, 0, og)))
            for n0, count in chunks]


def conv2d_nhwc(x, w, strides=1, paddings=0, dilations=1, groups=1, out=None):
    """out (N, Ho, Wo, O) = the grouped, strided, padded, dilated cross-correlation of
    x (N, H, W, C) with w (O, C / groups, kh, kw). Returns out. The columns live in
    the device's scratch (loader.scratch)."""
    plan = _plan("conv2d", x, w, strides, paddings, dilations, groups, _Forward)
    xp, wp = loader.ptr(x, "conv2d: x"), loader.ptr(w, "conv2d: filter")
    if out is None:
        out = loader.empty(plan.out_shape, x.dtype)
    else:
        launch.check_array("conv2d: out", out, plan.out_shape, x.dtype)
    if not plan.chunks:
        return out
    op = loader.address(out)
    cols = loader.scratch(plan.cols, x.dtype)
    for x_off, out_off, im2col, product in plan.chunks:
        im2col(xp + x_off, cols)
        product(cols, wp, op + out_off)
    return out


class _Backward:
    """conv2d_nhwc_grad's launches for one geometry: per chunk (x offset, dout offset
    in bytes, im2col, the dfilter product, the dcols product, col2im)."""

    def __init__(self, x, g):
        itemsize = np.dtype(x.dtype).itemsize
        nb, chunks = _chunks(g, itemsize)
        self.cols = nb * g["CKK"] * g["HW"]
        self.dout_shape = (g["N"], g["Ho"], g["Wo"], g["O"])
        og, kg, ckk, o = g["Og"], g["Kg"], g["CKK"], g["O"]
        self.chunks = []
        for i, (n0, count) in enumerate(chunks):
            rows = count * g["HW"]
            dfilter = gemm_plan(x.dtype, True, False, og, kg, rows, o, ckk, kg, beta=i > 0,
                                inner_count=g["G"], batches=g["G"],
                                strides=(0, og, 0, kg, 0, og * kg))
            dcols = gemm_plan(x.dtype, False, False, rows, kg, og, o, kg, ckk,
                              inner_count=g["G"], batches=g["G"],
                              strides=(0, og, 0, og * kg, 0, kg))
            self.chunks.append((n0 * g["H"] * g["W"] * g["C"] * itemsize,
                                n0 * g["HW"] * o * itemsize,
                                _cols_launch("im2col", x.dtype, count, g), dfilter, dcols,
                                _cols_launch("col2im", x.dtype, count, g)))


def conv2d_nhwc_grad(x, w, dout, strides=1, paddings=0, dilations=1, groups=1, need_dx=True,
                     need_dfilter=True):
    """(dx, dfilter) of conv2d_nhwc; None for the ones not needed. The columns live in
    the device's scratch (loader.scratch)."""
    plan = _plan("conv2d_grad", x, w, strides, paddings, dilations, groups, _Backward)
    xp, wp, dp, dx, dw = conv2d.grad_operands(plan, x, w, dout, need_dx, need_dfilter)
    if not plan.chunks:
        return dx, dw
    cols = loader.scratch(plan.cols, x.dtype)
    dxp, dwp = loader.address(dx), loader.address(dw)
    for x_off, d_off, im2col, dfilter, dcols, col2im in plan.chunks:
        if dw is not None:
            im2col(xp + x_off, cols)
            dfilter(dp + d_off, cols, dwp)
        if dx is not None:
            dcols(dp + d_off, wp, cols)
            col2im(cols, dxp + x_off)
    return dx, dw


# ---- op kernels (both layouts) ------------------------------------------------------

def _nhwc(op):
    return op.attrs["data_layout"] == "NHWC"


def conv2d_gpu(op, ins, ctx):
    """out on the device: NHWC here (im2col in chunks, one product per group and
    chunk), NCHW by kernels/conv2d.py."""
    if not _nhwc(op):
        return conv2d.conv2d_gpu(op, ins, ctx)
    return {"out": conv2d_nhwc(ins["x"], ins["filter"], **conv2d.conv_geometry(op))}


def conv2d_grad_gpu(op, ins, ctx):
    """dfilter and dx on the device, each only when bound: NHWC here, NCHW by
    kernels/conv2d.py."""
    if not _nhwc(op):
        return conv2d.conv2d_grad_gpu(op, ins, ctx)
    dx, dw = conv2d_nhwc_grad(ins["x"], ins["filter"], ins["dout"], **conv2d.conv_geometry(op),
                              need_dx=op.wants("dx"), need_dfilter=op.wants("dfilter"))
    return present(dx=dx, dfilter=dw)


def fused_conv2d_gpu(op, ins, ctx):
    """NHWC: the conv2d_nhwc launcher, then bias (on the last axis), residual and relu in
    place on its output; NCHW by kernels/conv2d.py; then, with attribute pool, pool2d's
    max over 2x2 windows at stride 2."""
    out = _fused_nhwc(op, ins) if _nhwc(op) else conv2d.fused_conv2d_gpu(op, ins, ctx)["out"]
    if op.attrs["pool"] == "max2x2":
        out = pool2d.pool2d(out, "max", 2, 2, 0, data_layout=op.attrs["data_layout"])
    return {"out": out}


def _fused_nhwc(op, ins):
    out = conv2d_nhwc(ins["x"], ins["filter"], **conv2d.conv_geometry(op))
    if ins.get("bias") is not None:
        elementwise.add(out, ins["bias"], axis=3, out=out)
    if ins.get("residual") is not None:
        broadcast.add(out, ins["residual"], out=out)
    if op.attrs["activation"] == "relu":
        activation.relu(out, out=out)
    return out


def fused_separable_conv2d_gpu(op, ins, ctx):
    """fused_separable_conv2d: fused_conv2d_gpu on the depthwise conv, then on the 1x1
    conv (conv_separable.parts)."""
    depthwise, pointwise = parts(op)
    mid = fused_conv2d_gpu(depthwise, {"x": ins["x"], "filter": ins["dw_filter"],
                                       "bias": ins.get("dw_bias")}, ctx)["out"]
    return fused_conv2d_gpu(pointwise, {"x": mid, "filter": ins["filter"],
                                        "bias": ins.get("bias"),
                                        "residual": ins.get("residual")}, ctx)
