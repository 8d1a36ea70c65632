"""The launcher of the native CPU conv kernel (conv2d_cpu.c, built by native.py):
float32 NCHW convolutions of one group, any kernel size, stride, padding and
dilation.

`available()` says whether they can run here; ops/conv_cpu.py calls them for
float32 convs where they can, else runs its numpy engine (the reference).
Both take the same sizes as minigraph.ops.conv_cpu.Geometry (duck-typed: n c
h w o kh kw sh sw ph pw dh dw ho wo).
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels import native

MR = 4                       # the forward tile's output channels (conv2d_cpu.c)

_P, _L = ctypes.c_void_p, ctypes.c_long


def _lib():
    lib = native.library("conv2d_cpu")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.conv2d_forward_f32.argtypes = [_P, _P, _P, _P, _P, _P, _L]
        lib._typed = True
    return lib


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return _lib() is not None


def supports(g, dtype):
    """True when the kernels take this conv: float32, one group."""
    return g.groups == 1 and np.dtype(dtype) == np.float32 and available()


def _dims(g, relu=False):
    return np.array([g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                     g.ho, g.wo, int(bool(relu))], dtype=np.int64)


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


def forward(x, w, g, threads, bias=None, residual=None, relu=False):
    """out (N, O, Ho, Wo) float32 = conv(x, w) (+ bias[o]) (+ residual) (then max(., 0)),
    on `threads` threads; the epilogue runs on each tile of outputs in registers."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    packed = pack_filter(_float32(w, (g.o, g.c, g.kh, g.kw), "filter"), g)
    bias = None if bias is None else _float32(bias, (g.o,), "bias")
    out = np.empty((g.n, g.o, g.ho, g.wo), dtype=np.float32)
    residual = None if residual is None else _float32(residual, out.shape, "residual")
    if g.n and g.o and g.ho and g.wo:
        failed = _lib().conv2d_forward_f32(_ptr(x), _ptr(packed), _ptr(bias), _ptr(residual),
                                           _ptr(out), _ptr(_dims(g, relu)), int(threads))
        if failed:
            raise MemoryError("conv2d_cpu.forward: the kernel's buffers could not be allocated")
    return out

