"""Launchers of the native depthwise conv kernels (conv_depthwise.c, built by
native.py): float32 NCHW convolutions whose groups equal the input channels (output
channel o reads input channel o // m alone, m = O / C), any kernel size, stride,
padding and dilation - the forward pass with fused_conv2d's epilogue (bias, residual,
relu), the input gradient and the filter gradient. The im2col engine runs such a conv
as one small product per channel; these run each plane as vectors of output columns.

`supports(g, dtype)` says whether they take a conv here (kernels/cpu/conv2d.py then
times them against the im2col engine, the reference they are tested against). Sizes
come as conv_im2col.Geometry.

Channels-last (NHWC) depthwise convs (`forward_nhwc`, `input_grad_nhwc`,
`filter_grad_nhwc`, conv_depthwise_nhwc.h) give the NCHW kernels' bits: the forward
pass of channel multiplier 1 (MobileNet's) reads channels last as they lie; the other
multipliers and the gradients run the NCHW kernels between transposes (x, dout and a
residual to channels first, the result back, by conv_depthwise_transpose on the
kernels' threads). numpy's im2col engine for NHWC took 64 times as long as the NCHW
kernel on a MobileNet-sized depthwise conv.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import native

# multiply-adds a thread must have to be worth waking (a depthwise multiply-add costs
# several of a dense conv's: one load each, short rows)
MIN_THREAD_WORK = 1 << 19

_P, _L = ctypes.c_void_p, ctypes.c_int64
_ptr = native.address


def _lib():
    lib = native.library("conv_depthwise")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.conv_depthwise_forward.argtypes = [_P, _P, _P, _P, _P, _P, _L]
        lib.conv_depthwise_input_grad.argtypes = [_P, _P, _P, _P, _L]
        lib.conv_depthwise_filter_grad.argtypes = [_P, _P, _P, _P, _L]
        lib.conv_depthwise_forward_nhwc.argtypes = [_P, _P, _P, _P, _P, _P, _L]
        lib.conv_depthwise_transpose.argtypes = [_P, _P, _L, _L, _L, _L]
        lib.conv_depthwise_transpose.restype = None
        lib._typed = True
    return lib


def available():
    """True when the kernels are built and loaded (native.reason says why not)."""
    return _lib() is not None


def supports(g, dtype):
    """True when the kernels take this conv: float32, more than one group, each group
    one input channel (a conv of one group on one channel stays conv_native's)."""
    return (1 < g.groups == g.c and np.dtype(dtype) == np.float32 and available())


def _threads(g, threads):
    """At most `threads`, at least 1, and no more than the conv's work is worth."""
    work = g.n * g.o * g.kh * g.kw * g.ho * g.wo
    return max(1, min(int(threads), work // MIN_THREAD_WORK))


def _dims(g, relu=False):
    return np.array([g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                     g.ho, g.wo, int(bool(relu))], dtype=np.int64)


def _float32(array, shape, name, who="conv_depthwise"):
    """`array` as a C-contiguous float32 array of `shape` (a copy only where needed); a
    ValueError naming `who` and `name` where the shape differs."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.shape != tuple(shape):
        raise ValueError(f"{who}: {name} has shape {array.shape}, expected {tuple(shape)}")
    return array


def _check(failed, what):
    if failed:
        raise MemoryError(f"conv_depthwise.{what}: the kernel's buffers could not be allocated")


def forward(x, w, g, threads, bias=None, residual=None, relu=False):
    """out (N, O, Ho, Wo) float32 = the depthwise conv of x with w (O, 1, kh, kw)
    (+ bias[o]) (+ residual, out's shape) (then max(., 0)), on up to `threads`
    threads."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    w = _float32(w, (g.o, 1, g.kh, g.kw), "filter")
    bias = None if bias is None else _float32(bias, (g.o,), "bias")
    out_shape = (g.n, g.o, g.ho, g.wo)
    residual = None if residual is None else _float32(residual, out_shape, "residual")
    out = np.empty(out_shape, dtype=np.float32)
    if out.size:
        _check(_lib().conv_depthwise_forward(_ptr(x), _ptr(w), _ptr(bias), _ptr(residual),
                                             _ptr(out), _ptr(_dims(g, relu)),
                                             _threads(g, threads)), "forward")
    return out


def prepared_forward(w, g, threads, bias, relu, out):
    """forward's outputs into `out` ((N, O, Ho, Wo) float32, C-contiguous) prepared
    once: a function call(x, residual) that runs the kernel on x and the residual (None,
    or C-contiguous float32 of out's shape) and what w and bias (C-contiguous float32 of
    g's shapes, or None) hold then (minigraph.bound_run). call.transform: None (no
    filter transform to keep)."""
    lib, dims = _lib(), _dims(g, relu)
    rest = (_ptr(w), _ptr(bias))
    to, at, threads = _ptr(out), _ptr(dims), _threads(g, threads)

    def call(x, residual):
        _check(lib.conv_depthwise_forward(_ptr(x), *rest, _ptr(residual), to, at, threads),
               "forward")
    call.keep, call.transform = dims, None
    return call


def input_grad(w, d, g, threads):
    """dx (N, C, H, W) float32 of out = the depthwise conv of x with w, for dout `d`."""
    w = _float32(w, (g.o, 1, g.kh, g.kw), "filter")
    d = _float32(d, (g.n, g.o, g.ho, g.wo), "dout")
    dx = np.empty((g.n, g.c, g.h, g.w), dtype=np.float32)
    if not (g.o and g.ho and g.wo):
        dx.fill(0.0)
    elif dx.size:
        _check(_lib().conv_depthwise_input_grad(_ptr(w), _ptr(d), _ptr(dx), _ptr(_dims(g)),
                                                _threads(g, threads)), "input_grad")
    return dx


def filter_grad(x, d, g, threads):
    """dfilter (O, 1, kh, kw) float32 of out = the depthwise conv of x, for dout `d`
    (each channel's sum over images, rows and columns by one thread)."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    d = _float32(d, (g.n, g.o, g.ho, g.wo), "dout")
    dw = np.zeros((g.o, 1, g.kh, g.kw), dtype=np.float32)
    if g.n and g.o and g.ho and g.wo:
        _check(_lib().conv_depthwise_filter_grad(_ptr(x), _ptr(d), _ptr(dw), _ptr(_dims(g)),
                                                 min(_threads(g, threads), g.c)),
               "filter_grad")
    return dw


def forward_nhwc(x, w, g, threads, bias=None, residual=None, relu=False):
    """forward for channels-last x (N, H, W, C) and residual (N, Ho, Wo, O): out (N, Ho,
    Wo, O), forward's bits (multiplier 1: read as they lie; else x and the residual
    transposed to channels first, the result back)."""
    x = _float32(x, (g.n, g.h, g.w, g.c), "x")
    out_shape = (g.n, g.ho, g.wo, g.o)
    residual = None if residual is None else _float32(residual, out_shape, "residual")
    if g.o != g.c:
        if residual is not None:
            residual = _channels_first(residual, threads)
        return _channels_last(forward(_channels_first(x, threads), w, g, threads, bias=bias,
                                      residual=residual, relu=relu), threads)
    w = _float32(w, (g.o, 1, g.kh, g.kw), "filter")
    bias = None if bias is None else _float32(bias, (g.o,), "bias")
    out = np.empty(out_shape, dtype=np.float32)
    if out.size:
        _check(_lib().conv_depthwise_forward_nhwc(_ptr(x), _ptr(w), _ptr(bias),
                                                  _ptr(residual), _ptr(out),
                                                  _ptr(_dims(g, relu)), _threads(g, threads)),
               "forward_nhwc")
    return out


def input_grad_nhwc(w, d, g, threads):
    """input_grad for channels-last dout (N, Ho, Wo, O): dx (N, H, W, C), input_grad's
    bits."""
    d = _float32(d, (g.n, g.ho, g.wo, g.o), "dout")
    return _channels_last(input_grad(w, _channels_first(d, threads), g, threads), threads)


def filter_grad_nhwc(x, d, g, threads):
    """filter_grad for channels-last x (N, H, W, C) and dout (N, Ho, Wo, O): dfilter (O,
    1, kh, kw), filter_grad's bits."""
    x = _float32(x, (g.n, g.h, g.w, g.c), "x")
    d = _float32(d, (g.n, g.ho, g.wo, g.o), "dout")
    return filter_grad(_channels_first(x, threads), _channels_first(d, threads), g, threads)


def _channels_first(a, threads):
    """C-contiguous float32 a (N, H, W, C) as a new array (N, C, H, W)."""
    n, h, w, c = a.shape
    out = np.empty((n, c, h, w), np.float32)
    if out.size:
        _lib().conv_depthwise_transpose(_ptr(a), _ptr(out), n, h * w, c, max(1, threads))
    return out


def _channels_last(a, threads):
    """C-contiguous float32 a (N, C, H, W) as a new array (N, H, W, C)."""
    n, c, h, w = a.shape
    out = np.empty((n, h, w, c), np.float32)
    if out.size:
        _lib().conv_depthwise_transpose(_ptr(a), _ptr(out), n, c, h * w, max(1, threads))
    return out
