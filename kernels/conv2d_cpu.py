"""Launchers of the native CPU conv kernels (conv2d_cpu.c, built by native.py):
float32 NCHW convolutions of one group, any kernel size, stride, padding and
dilation - the forward pass (with fused_conv2d's epilogue), the filter
gradient, and the input gradient as a forward pass over dout.

`supports(g, dtype)` says whether they take a conv here; the conv ops call
them where they do, else conv_cpu's numpy engine (the reference they are
tested against). Sizes come as minigraph.ops.conv_cpu.Geometry (n c h w o kh
kw groups sh sw ph pw dh dw ho wo).
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels import native

MR = 4                       # the forward tile's output channels (conv2d_cpu.c)
MAX_PHASES = 64              # conv2d_cpu.c's bound on a buffer's column phases
# multiply-adds a thread must have to be worth starting (each call starts its threads:
# tens of microseconds); the demo net's conv (0.6 M) ran 1.3x as long on 2 threads as on 1
MIN_THREAD_WORK = 2_000_000

_P, _L = ctypes.c_void_p, ctypes.c_int64


def _lib():
    lib = native.library("conv2d_cpu")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.conv2d_forward_f32.argtypes = [_P, _P, _P, _P, _P, _P, _L]
        lib.conv2d_filter_grad_f32.argtypes = [_P, _P, _P, _P, _L]
        lib._typed = True
    return lib


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return _lib() is not None


def supports(g, dtype):
    """True when the kernels take this conv: float32, one group, at most MAX_PHASES
    column phases (min(stride across, reach across + 1))."""
    return (g.groups == 1 and np.dtype(dtype) == np.float32
            and min(g.sw, (g.kw - 1) * g.dw + 1) <= MAX_PHASES and available())


def _threads(g, threads):
    """At most `threads`, at least 1, and no more than the conv's work is worth."""
    work = g.n * g.o * g.c * g.kh * g.kw * g.ho * g.wo
    return max(1, min(int(threads), work // MIN_THREAD_WORK))


def _dims(g, relu=False, dilate=(1, 1)):
    return np.array([g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                     g.ho, g.wo, int(bool(relu)), *dilate], dtype=np.int64)


def _ptr(array):
    return None if array is None else array.ctypes.data


def _float32(array, shape, name):
    """`array` as a C-contiguous float32 array of `shape` (a copy only where needed)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.shape != tuple(shape):
        raise ValueError(f"conv2d_cpu: {name} has shape {array.shape}, expected {tuple(shape)}")
    return array


def pack_filter(w, g):
    """The filter (O, C, kh, kw) as the forward kernel reads it: output channels padded
    with zeros to a multiple of MR, blocks of MR laid out (block, C kh kw, MR)."""
    blocks = -(-g.o // MR)
    rows = np.zeros((blocks * MR, g.c * g.kh * g.kw), dtype=np.float32)
    rows[:g.o] = w.reshape(g.o, -1)
    return np.ascontiguousarray(rows.reshape(blocks, MR, -1).transpose(0, 2, 1))


def forward(x, w, g, threads, bias=None, residual=None, relu=False, dilate=(1, 1)):
    """out (N, O, Ho, Wo) float32 = conv(x, w) (+ bias[o]) (+ residual) (then max(., 0)),
    on `threads` threads; the epilogue runs on each tile of outputs in registers.
    dilate (uh, uw): x's values taken uh rows and uw columns apart, zeros between
    (g.h and g.w are x's own sizes, g.ho and g.wo the output's)."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    packed = pack_filter(_float32(w, (g.o, g.c, g.kh, g.kw), "filter"), g)
    bias = None if bias is None else _float32(bias, (g.o,), "bias")
    out = np.empty((g.n, g.o, g.ho, g.wo), dtype=np.float32)
    residual = None if residual is None else _float32(residual, out.shape, "residual")
    if g.n and g.o and g.ho and g.wo:
        failed = _lib().conv2d_forward_f32(_ptr(x), _ptr(packed), _ptr(bias), _ptr(residual),
                                           _ptr(out), _ptr(_dims(g, relu, dilate)),
                                           _threads(g, threads))
        if failed:
            raise MemoryError("conv2d_cpu.forward: the kernel's buffers could not be allocated")
    return out


def filter_grad(x, d, g, threads):
    """dfilter (O, C, kh, kw) float32 of out = conv(x, w) for dout `d` (N, O, Ho, Wo),
    on `threads` threads (each sums a fixed range of images; the sums are added in
    thread order)."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    d = _float32(d, (g.n, g.o, g.ho, g.wo), "dout")
    dw = np.zeros((g.o, g.c, g.kh, g.kw), dtype=np.float32)
    if g.n and g.o and g.ho and g.wo:
        failed = _lib().conv2d_filter_grad_f32(_ptr(x), _ptr(d), _ptr(dw), _ptr(_dims(g)),
                                               _threads(g, threads))
        if failed:
            raise MemoryError("conv2d_cpu.filter_grad: the kernel's buffers could not be "
                              "allocated")
    return dw


def input_geometry(g):
    """The conv whose output is dx of the conv g, or None where there is none here
    (padding beyond the filter's reach): dout, its values sh rows and sw columns
    apart (input_grad's `dilate`), padded by dh (kh - 1) - ph and dw (kw - 1) - pw,
    with the flipped filter, stride 1, an output of x's size."""
    qh, qw = g.dh * (g.kh - 1) - g.ph, g.dw * (g.kw - 1) - g.pw
    if min(qh, qw) < 0:
        return None
    return g._replace(c=g.o, h=g.ho, w=g.wo, o=g.c, sh=1, sw=1, ph=qh, pw=qw, ho=g.h, wo=g.w)


def input_grad(w, d, g, threads):
    """dx (N, C, H, W) float32 of out = conv(x, w) for dout `d`, a forward pass over
    dout; None where input_geometry has no such pass (the caller's engine then
    computes dx)."""
    w = _float32(w, (g.o, g.c, g.kh, g.kw), "filter")
    gd = input_geometry(g)
    if g.kh == g.kw == 1 and g.ph == g.pw == 0 and (g.sh, g.sw) != (1, 1):
        # strided 1x1: dx is zero but where the windows read x, a 1x1 conv of dout there
        gd = g._replace(c=g.o, h=g.ho, w=g.wo, o=g.c, sh=1, sw=1)
        dx = np.zeros((g.n, g.c, g.h, g.w), dtype=np.float32)
        dx[:, :, :g.sh * g.ho:g.sh, :g.sw * g.wo:g.sw] = forward(
            d, w.transpose(1, 0, 2, 3), gd, threads)
        return dx
    if gd is None:
        return None
    flipped = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    return forward(d, flipped, gd, threads, dilate=(g.sh, g.sw))
