"""Launchers of the native channels-last (NHWC) CPU conv kernels (conv_nhwc.h, in
conv_native.c's library): float32 convolutions of one group, any kernel size, stride,
padding and dilation, x (N, H, W, C), filter (O, C, kh, kw) (the NCHW filter), out
(N, Ho, Wo, O) - the forward pass (with fused_conv2d's epilogue), the filter
gradient, and the input gradient as forward passes over dout. Forward passes that
conv_native.winograd takes run Winograd's F(4x4, 3x3) on channels-last data
(conv_winograd.h: no transposes on the way in or out), the others the direct
kernel, which vectorizes over output channels.

`conv_native.supports(g, dtype)` says whether they take a conv here (the same rule
as NCHW); the conv ops call them where it does, else conv_im2col_nhwc's numpy engine
(the reference they are tested against). Sizes come as conv_im2col.Geometry.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import conv_native
from minigraph.kernels.cpu.conv_native import _float32, _lib, _ptr, _threads


def _dims(g, relu=False, out_shape=None, at=(0, 0), step=(1, 1), x_pitch=None):
    """conv_nhwc.h's sizes: g, then the output array's rows and columns (out_shape[1:3],
    default g.ho, g.wo), where output (y, x) goes in them (at + step * (y, x)), and x's
    row and image pitches in floats (x_pitch; default those of a C-contiguous x)."""
    out_h, out_w = (g.ho, g.wo) if out_shape is None else out_shape[1:3]
    x_row, x_image = (g.w * g.c, g.h * g.w * g.c) if x_pitch is None else x_pitch
    return np.array([g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                     g.ho, g.wo, int(bool(relu)), out_h, out_w, *at, *step, x_row, x_image],
                    dtype=np.int64)


def forward(x, w, g, threads, bias=None, residual=None, relu=False, max_scratch=None,
            stats=None, fixed=False):
    """out (N, Ho, Wo, O) float32 = conv(x, w) (+ bias[o]) (+ residual) (then max(., 0))
    for x (N, H, W, C), on `threads` threads; as conv_native.forward otherwise
    (max_scratch, stats, fixed and the padding rules)."""
    out = np.empty((g.n, g.ho, g.wo, g.o), dtype=np.float32)
    residual = None if residual is None else _float32(residual, out.shape, "residual")
    x = _float32(x, (g.n, g.h, g.w, g.c), "x")
    _forward_into(out, x, None, w, g, threads, bias=bias, residual=residual, relu=relu,
                  max_scratch=max_scratch, stats=stats, fixed=fixed)
    return out


def _forward_into(out, x, x_pitch, w, g, threads, bias=None, residual=None, relu=False,
                  at=(0, 0), step=(1, 1), max_scratch=None, stats=None, fixed=False):
    """forward's outputs into out (C-contiguous float32, (N, rows, cols, O)): output
    (y, x) at out[:, at[0] + step[0] y, at[1] + step[1] x], the caller having checked
    that these fit; residual (out's shape) read at the same places. x: float32 whose
    pixels hold C contiguous values and whose rows and images are x_pitch floats apart
    (None: C-contiguous (N, H, W, C))."""
    w = _float32(w, (g.o, g.c, g.kh, g.kw), "filter")
    bias = None if bias is None else _float32(bias, (g.o,), "bias")
    if not (g.n and g.o and g.ho and g.wo):
        return
    threads = _threads(g, threads)
    xp = _ptr(x) if x_pitch is None else x.ctypes.data     # a view's first value
    args = (xp, _ptr(w), _ptr(bias), _ptr(residual), _ptr(out))
    shape = (g.n, g.o) + tuple(out.shape[1:3])           # winograd() reads (N, O, rows, cols)
    if conv_native.winograd(g, threads, shape, at, step, max_scratch):
        pitch = (g.w * g.c, g.h * g.w * g.c) if x_pitch is None else x_pitch
        dims = conv_native._winograd_dims(g, relu, nhwc=True, x_row=pitch[0], x_image=pitch[1])
        if conv_native.run_winograd(args, dims, threads, g, stats, w if fixed else None):
            return
    if stats is not None:
        stats["kernel"] = "direct"
    dims = _dims(g, relu, out.shape, at, step, x_pitch)
    if _lib().conv2d_nhwc_forward_f32(*args, _ptr(dims), threads):
        raise MemoryError("conv_native_nhwc.forward: the kernel's buffers could not be "
                          "allocated")


def filter_grad(x, d, g, threads):
    """dfilter (O, C, kh, kw) float32 of out = conv(x, w) for x (N, H, W, C) and dout `d`
    (N, Ho, Wo, O), on `threads` threads (each sums a fixed range of images; the sums
    are added in thread order)."""
    x = _float32(x, (g.n, g.h, g.w, g.c), "x")
    d = _float32(d, (g.n, g.ho, g.wo, g.o), "dout")
    dw = np.zeros((g.o, g.c, g.kh, g.kw), dtype=np.float32)
    if g.n and g.o and g.ho and g.wo:
        if _lib().conv2d_nhwc_filter_grad_f32(_ptr(x), _ptr(d), _ptr(dw), _ptr(_dims(g)),
                                              _threads(g, threads)):
            raise MemoryError("conv_native_nhwc.filter_grad: the kernel's buffers could not "
                              "be allocated")
    return dw


def input_grad(w, d, g, threads, max_scratch=None):
    """dx (N, H, W, C) float32 of out = conv(x, w) for dout `d` (N, Ho, Wo, O): per phase
    (a, b) of the stride, dx[:, a::sh, b::sw] is a stride-1 forward pass over dout
    with the filter taps that reach it (flipped, channels swapped), written in place
    (as conv_native.input_grad, max_scratch too); each phase reads dout where it
    starts, in place (no copy of dout)."""
    w = _float32(w, (g.o, g.c, g.kh, g.kw), "filter")
    d = _float32(d, (g.n, g.ho, g.wo, g.o), "dout")
    passes, whole = conv_native.dx_phases(g)
    dx = (np.empty if whole else np.zeros)((g.n, g.h, g.w, g.c), dtype=np.float32)
    pitch = (g.wo * g.o, g.ho * g.wo * g.o)
    for a, b, r0, c0, row_taps, col_taps, gp in passes:
        part = d[:, r0:, c0:, :]                         # a view: the kernel reads it in place
        sub = w[:, :, row_taps, col_taps].transpose(1, 0, 2, 3)
        _forward_into(dx, part, pitch, sub, gp, threads, at=(a, b), step=(g.sh, g.sw),
                      max_scratch=max_scratch)
    return dx
