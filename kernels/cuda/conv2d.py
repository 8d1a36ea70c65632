"""Launchers for kernels/conv2d.cu (+ matmul.cu): conv2d forward and gradients
on NCHW device arrays - through cuDNN where it loads (kernels/cuda/cudnn.py),
else by im2col and batched matrix products (cuBLAS where it loads, else the
hand-written GEMM).

Images are processed in chunks whose columns fit launch.COLS_BUDGET; per
chunk and group g (Og = O / G output channels, Kg = C / G * kh * kw):
  out[n, g]    = filter_g (Og x Kg) @ cols[n, g] (Kg x HoWo), a strided-batched product
  dfilter_g   += doutT_g (Og x nb HoWo) @ folded_g^T: ONE product over every image
                 and pixel of the chunk, with the columns folded (images side by
                 side, (Kg, nb HoWo)) and dout's first two axes swapped (O, nb, HoWo)
  dcols[n, g]  = filter_g^T @ dout[n, g], then dx = col2im(dcols).
The hand-written GEMM splits the filter gradient's long K over the grid and sums
the slices in a fixed order (matmul.kernel_plan).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import cudnn, launch, libraries, loader
from minigraph.kernels.cuda.matmul import bias_act, gemm_plan

MODULE = "conv2d"
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"im2col_{_t}": "PPi" + "i" * 14, f"col2im_{_t}": "PP" + "i" * 14,
                       f"swap01_{_t}": "PPqqq"})


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


def _cols_launch(kind, dtype, nb, g, folded=False):
    """go(src, dst): the im2col (its columns `folded` or per image, see the .cu) or
    col2im launch for `nb` images of geometry `g`."""
    name = f"{kind}_{loader.suffix(dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    items = nb * (g["CKK"] * g["HW"] if kind == "im2col" else g["C"] * g["H"] * g["W"])
    go = k.prepared((launch.flat_grid(items, dev, threads, k.resources), 1, 1), (threads, 1, 1))
    sizes = (nb, g["C"], g["H"], g["W"], g["kh"], g["kw"], g["sh"], g["sw"], g["ph"], g["pw"],
             g["dh"], g["dw"], g["Ho"], g["Wo"])
    if kind == "im2col":
        flag = int(folded)
        return lambda src, dst: go(src, dst, flag, *sizes)
    return lambda src, dst: go(src, dst, *sizes)


def _swap_launch(dtype, nb, g):
    """go(src, dst): dout (nb, O, HoWo) -> (O, nb, HoWo)."""
    name = f"swap01_{loader.suffix(dtype)}"
    go = loader.flat_go(MODULE, name, SIGNATURES[name], nb * g["O"] * g["HW"])
    sizes = (nb, g["O"], g["HW"])
    return lambda src, dst: go(src, dst, *sizes)


def _chunks(g, itemsize):
    nb = launch.conv_chunk(g["N"], g["CKK"] * g["HW"] * itemsize, g["G"], loader.device())
    return nb, [(n0, min(nb, g["N"] - n0)) for n0 in range(0, g["N"], nb)]


def _plan(kind, x, w, strides, paddings, dilations, groups, make):
    """The plan `make(x, w, geometry)` of a conv launcher, once per device, kind, shapes,
    dtypes and attributes (an unhashable attribute is normalised first)."""
    plans = loader.cached("conv2d.plans", dict)
    libs = libraries.plan_key()
    key = (kind, x.shape, w.shape, x.dtype, w.dtype, strides, paddings, dilations, groups, libs)
    try:
        found = plans.get(key)
    except TypeError:
        strides, paddings, dilations = _pair(strides), _pair(paddings), _pair(dilations)
        key = (kind, x.shape, w.shape, x.dtype, w.dtype, strides, paddings, dilations, groups,
               libs)
        found = plans.get(key)
    if found is None:
        g = geometry(x.shape, w.shape, strides, paddings, dilations, groups)
        launch.check_array(f"{kind}: filter", w, w.shape, x.dtype)
        found = loader.cache_put(plans, key, make(x, g))
    return found


class _Forward:
    """conv2d's launches for one geometry: out's shape, the columns' size (values),
    and per chunk (x offset, out offset in bytes, im2col, the product)."""

    def __init__(self, x, g):
        itemsize = np.dtype(x.dtype).itemsize
        self.out_shape = (g["N"], g["O"], g["Ho"], g["Wo"])
        nb, chunks = _chunks(g, itemsize)
        self.cols = nb * g["CKK"] * g["HW"]
        self.chunks = [
            (n0 * g["C"] * g["H"] * g["W"] * itemsize, n0 * g["O"] * g["HW"] * itemsize,
             _cols_launch("im2col", x.dtype, count, g),
             gemm_plan(x.dtype, False, False, g["Og"], g["HW"], g["Kg"], g["Kg"], g["HW"],
                       g["HW"], inner_count=g["G"], batches=count * g["G"],
                       strides=(0, g["Og"] * g["Kg"], g["CKK"] * g["HW"], g["Kg"] * g["HW"],
                                g["O"] * g["HW"], g["Og"] * g["HW"]), what="conv2d"))
            for n0, count in chunks]


def conv2d(x, w, strides=1, paddings=0, dilations=1, groups=1, out=None):
    """out (N, O, Ho, Wo) = the grouped, strided, padded, dilated cross-correlation
    of x (N, C, H, W) with w (O, C / groups, kh, kw). Returns out. The columns
    live in the device's scratch (loader.scratch): no array of their own."""
    done = cudnn.forward(x, w, strides, paddings, dilations, groups, out)
    if done is not None:
        return done
    plan = _plan("conv2d", x, w, strides, paddings, dilations, groups, _Forward)
    xp, wp = loader.ptr(x, "conv2d: x"), loader.ptr(w, "conv2d: filter")
    if out is None:
        out = loader.empty(plan.out_shape, x.dtype)
    else:
        launch.check_array("conv2d: out", out, plan.out_shape, x.dtype)
    if not plan.chunks:
        return out
    op = loader.address(out)                # made here, or checked by check_array
    cols = loader.scratch(plan.cols, x.dtype)
    for x_off, out_off, im2col, product in plan.chunks:
        im2col(xp + x_off, cols)
        product(wp, cols, op + out_off)
    return out


class _Backward:
    """conv2d_grad's launches for one geometry: the columns' and swapped dout's sizes
    (values), and per chunk (x offset, dout offset in bytes, folded im2col, the dout
    swap, the dfilter product, the dcols product, col2im)."""

    def __init__(self, x, g):
        itemsize = np.dtype(x.dtype).itemsize
        nb, chunks = _chunks(g, itemsize)
        self.cols = nb * g["CKK"] * g["HW"]
        self.swapped = nb * g["O"] * g["HW"]
        self.dout_shape = (g["N"], g["O"], g["Ho"], g["Wo"])
        image_out = g["O"] * g["HW"]
        self.chunks = []
        for i, (n0, count) in enumerate(chunks):
            k = count * g["HW"]               # every image and pixel of the chunk
            dfilter = gemm_plan(x.dtype, False, True, g["Og"], g["Kg"], k, k, k, g["Kg"],
                                beta=i > 0, inner_count=1, batches=g["G"],
                                strides=(g["Og"] * k, 0, g["Kg"] * k, 0, g["Og"] * g["Kg"], 0),
                                what="conv2d_grad: dfilter")
            dcols = gemm_plan(x.dtype, True, False, g["Kg"], g["HW"], g["Og"], g["Kg"], g["HW"],
                              g["HW"], inner_count=g["G"], batches=count * g["G"],
                              strides=(0, g["Og"] * g["Kg"], image_out, g["Og"] * g["HW"],
                                       g["CKK"] * g["HW"], g["Kg"] * g["HW"]),
                              what="conv2d_grad: dx")
            self.chunks.append((n0 * g["C"] * g["H"] * g["W"] * itemsize,
                                n0 * image_out * itemsize,
                                _cols_launch("im2col", x.dtype, count, g, folded=True),
                                _swap_launch(x.dtype, count, g), dfilter, dcols,
                                _cols_launch("col2im", x.dtype, count, g)))


def grad_operands(plan, x, w, dout, need_dx, need_dfilter):
    """(x, filter and dout pointers, dx, dfilter) of a conv2d_grad `plan` (NCHW's or
    NHWC's): dout checked against the plan, dx and dfilter new arrays where needed
    (None where not); dfilter zero where the plan has no work (an empty batch)."""
    if dout.shape != plan.dout_shape or dout.dtype != x.dtype:
        launch.check_array("conv2d_grad: dout", dout, plan.dout_shape, x.dtype)
    xp, wp = loader.ptr(x, "conv2d_grad: x"), loader.ptr(w, "conv2d_grad: filter")
    dp = loader.ptr(dout, "conv2d_grad: dout")
    dx = loader.empty(x.shape, x.dtype) if need_dx else None
    dw = loader.empty(w.shape, w.dtype) if need_dfilter else None
    if not plan.chunks and dw is not None:
        from minigraph.kernels.cuda import fill

        fill.fill_constant(dw, 0)
    return xp, wp, dp, dx, dw


def conv2d_grad(x, w, dout, strides=1, paddings=0, dilations=1, groups=1, need_dx=True,
                need_dfilter=True):
    """(dx, dfilter) of conv2d; None for the ones not needed. The columns live in
    the device's scratch (loader.scratch)."""
    done = cudnn.backward(x, w, dout, strides, paddings, dilations, groups, need_dx,
                          need_dfilter)
    if done is not None:
        return done
    plan = _plan("conv2d_grad", x, w, strides, paddings, dilations, groups, _Backward)
    xp, wp, dp, dx, dw = grad_operands(plan, x, w, dout, need_dx, need_dfilter)
    if not plan.chunks:
        return dx, dw
    itemsize = np.dtype(x.dtype).itemsize
    cols = loader.scratch(plan.cols + (plan.swapped if dw is not None else 0), x.dtype)
    swapped = cols + plan.cols * itemsize
    dxp, dwp = loader.address(dx), loader.address(dw)
    for x_off, d_off, im2col, swap, dfilter, dcols, col2im in plan.chunks:
        if dw is not None:
            im2col(xp + x_off, cols)
            swap(dp + d_off, swapped)
            dfilter(swapped, cols, dwp)
        if dx is not None:
            dcols(wp, dp + d_off, cols)
            col2im(cols, dxp + x_off)
    return dx, dw


# ---- op kernels -------------------------------------------------------------------

def conv_geometry(op):
    """The launchers' keyword arguments for this op's attributes."""
    a = op.attrs
    return dict(strides=a["strides"], paddings=a["paddings"], dilations=a["dilations"],
                groups=a["groups"])


def conv2d_gpu(op, ins, ctx):
    """out on the device: im2col in chunks, one batched matrix product per chunk."""
    x, w = ins["x"], ins["filter"]
    return {"out": conv2d(x, w, **conv_geometry(op))}


def conv2d_grad_gpu(op, ins, ctx):
    """dfilter (dout @ cols^T, summed over images) and dx (col2im of filter^T @ dout)
    on the device; each only when bound."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    dx, dw = conv2d_grad(x, w, d, **conv_geometry(op), need_dx=op.wants("dx"),
                             need_dfilter=op.wants("dfilter"))
    return present(dx=dx, dfilter=dw)


def fused_conv2d(x, w, bias=None, residual=None, relu=False, strides=1, paddings=0,
                 dilations=1, groups=1):
    """out = act(conv2d(x, w) + bias[o] + residual), act = relu or the identity; bias
    (O,) and residual (out's shape) optional. Through cuDNN, the bias, residual and
    relu fused into its call (cudnnConvolutionBiasActivationForward) where it offers
    that for this shape; otherwise the convolution, then ONE epilogue launch
    (matmul.bias_act)."""
    if bias is not None:
        launch.check_array("fused_conv2d: bias", bias, (w.shape[0],), x.dtype)
    fused = cudnn.fused_forward(x, w, bias, residual, relu, strides, paddings, dilations,
                                groups)
    if fused is not None:
        return fused
    out = conv2d(x, w, strides, paddings, dilations, groups)
    return bias_act(out, bias, residual, relu, inner=out.shape[2] * out.shape[3],
                    what="fused_conv2d")


def fused_conv2d_gpu(op, ins, ctx):
    """fused_conv2d on the device: one cuDNN call, or the convolution and one epilogue."""
    return {"out": fused_conv2d(ins["x"], ins["filter"], ins.get("bias"), ins.get("residual"),
                                op.attrs["activation"] == "relu", **conv_geometry(op))}
