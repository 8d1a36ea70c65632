"""Launchers for kernels/conv2d.cu (+ matmul.cu): conv2d forward and gradients
on NCHW device arrays, by im2col and batched tiled matrix products.

Images are processed in chunks whose columns fit launch.COLS_BUDGET; per
chunk and group g (Og = O / G output channels, Kg = C / G * kh * kw):
  out[n, g]    = filter_g (Og x Kg) @ cols[n, g] (Kg x HoWo)
  dfilter_g   += sum over n of dout[n, g] (Og x HoWo) @ cols[n, g]^T
  dcols[n, g]  = filter_g^T @ dout[n, g], then dx = col2im(dcols).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import launch, loader
from minigraph.kernels.matmul import gemm

MODULE = "conv2d"
SIGNATURES = {f"{k}_{t}": "PP" + "i" * 14 for k in ("im2col", "col2im") for t in ("f32", "f64")}


def _pair(v):
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


def geometry(x_shape, w_shape, strides=1, paddings=0, dilations=1, groups=1):
    """A dict of the conv's sizes; ValueError for inconsistent shapes."""
    n, c, h, w = (int(d) for d in x_shape)
    o, cg, kh, kw = (int(d) for d in w_shape)
    (sh, sw), (ph, pw), (dh, dw) = _pair(strides), _pair(paddings), _pair(dilations)
    if c % groups or o % groups or cg != c // groups:
        raise ValueError(f"conv2d: filter {tuple(w_shape)} does not fit input {tuple(x_shape)} "
                         f"with groups={groups}")
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"conv2d: output would be {ho}x{wo} for input {tuple(x_shape)}")
    return dict(N=n, C=c, H=h, W=w, O=o, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw,
                Ho=ho, Wo=wo, G=groups, Og=o // groups, Kg=cg * kh * kw, CKK=c * kh * kw,
                HW=ho * wo)


def _cols_kernel(kind, dtype, src, dst, nb, g):
    name = f"{kind}_{loader.suffix(dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    items = nb * (g["CKK"] * g["HW"] if kind == "im2col" else g["C"] * g["H"] * g["W"])
    k.launch((launch.flat_grid(items, dev, threads, k.resources), 1, 1), (threads, 1, 1), src,
             dst, nb, g["C"], g["H"], g["W"], g["kh"], g["kw"], g["sh"], g["sw"], g["ph"],
             g["pw"], g["dh"], g["dw"], g["Ho"], g["Wo"])


def _chunks(g, itemsize):
    nb = launch.conv_chunk(g["N"], g["CKK"] * g["HW"] * itemsize, g["G"], loader.device())
    return nb, [(n0, min(nb, g["N"] - n0)) for n0 in range(0, g["N"], nb)]


def conv2d(x, w, strides=1, paddings=0, dilations=1, groups=1, out=None):
    """out (N, O, Ho, Wo) = the grouped, strided, padded, dilated cross-correlation
    of x (N, C, H, W) with w (O, C / groups, kh, kw). Returns out."""
    g = geometry(x.shape, w.shape, strides, paddings, dilations, groups)
    launch.check_contiguous("conv2d: x", x)
    out_shape = (g["N"], g["O"], g["Ho"], g["Wo"])
    out = loader.empty(out_shape, x.dtype) if out is None else out
    launch.check_array("conv2d: filter", w, w.shape, x.dtype)
    launch.check_array("conv2d: out", out, out_shape, x.dtype)
    itemsize = np.dtype(x.dtype).itemsize
    nb, chunks = _chunks(g, itemsize)
    if not chunks:
        return out
    cols = loader.empty((nb * g["CKK"] * g["HW"],), x.dtype)
    for n0, count in chunks:
        _cols_kernel("im2col", x.dtype, loader.ptr(x) + n0 * g["C"] * g["H"] * g["W"] * itemsize,
                     loader.ptr(cols), count, g)
        gemm(x.dtype, False, False, g["Og"], g["HW"], g["Kg"], loader.ptr(w), g["Kg"],
             loader.ptr(cols), g["HW"], loader.ptr(out) + n0 * g["O"] * g["HW"] * itemsize,
             g["HW"], inner_count=g["G"], batches=count * g["G"],
             strides=(0, g["Og"] * g["Kg"], g["CKK"] * g["HW"], g["Kg"] * g["HW"],
                      g["O"] * g["HW"], g["Og"] * g["HW"]))
    return out


def conv2d_grad(x, w, dout, strides=1, paddings=0, dilations=1, groups=1, need_dx=True,
                need_dfilter=True):
    """(dx, dfilter) of conv2d; None for the ones not needed."""
    g = geometry(x.shape, w.shape, strides, paddings, dilations, groups)
    itemsize = np.dtype(x.dtype).itemsize
    launch.check_contiguous("conv2d_grad: x", x)
    launch.check_array("conv2d_grad: filter", w, w.shape, x.dtype)
    launch.check_array("conv2d_grad: dout", dout, (g["N"], g["O"], g["Ho"], g["Wo"]), x.dtype)
    dx = loader.empty(x.shape, x.dtype) if need_dx else None
    dw = loader.empty(w.shape, w.dtype) if need_dfilter else None
    nb, chunks = _chunks(g, itemsize)
    if not chunks:
        if dw is not None:
            from minigraph.kernels import fill

            fill.fill_constant(dw, 0)
        return dx, dw
    cols = loader.empty((nb * g["CKK"] * g["HW"],), x.dtype)
    image_out = g["O"] * g["HW"]
    for i, (n0, count) in enumerate(chunks):
        d0 = loader.ptr(dout) + n0 * image_out * itemsize
        if dw is not None:
            _cols_kernel("im2col", x.dtype,
                         loader.ptr(x) + n0 * g["C"] * g["H"] * g["W"] * itemsize,
                         loader.ptr(cols), count, g)
            gemm(x.dtype, False, True, g["Og"], g["Kg"], g["HW"], d0, g["HW"], loader.ptr(cols),
                 g["HW"], loader.ptr(dw), g["Kg"], beta=i > 0, inner_count=g["G"],
                 batches=g["G"],
                 strides=(0, g["Og"] * g["HW"], 0, g["Kg"] * g["HW"], 0, g["Og"] * g["Kg"]),
                 red=count, a_red=image_out, b_red=g["CKK"] * g["HW"])
        if dx is not None:
            gemm(x.dtype, True, False, g["Kg"], g["HW"], g["Og"], loader.ptr(w), g["Kg"], d0,
                 g["HW"], loader.ptr(cols), g["HW"], inner_count=g["G"],
                 batches=count * g["G"],
                 strides=(0, g["Og"] * g["Kg"], image_out, g["Og"] * g["HW"],
                          g["CKK"] * g["HW"], g["Kg"] * g["HW"]))
            _cols_kernel("col2im", x.dtype, loader.ptr(cols),
                         loader.ptr(dx) + n0 * g["C"] * g["H"] * g["W"] * itemsize, count, g)
    return dx, dw
