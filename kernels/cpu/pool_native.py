"""Launchers of the native CPU pooling kernels (pool_native.c, built by native.py):
pool2d_grad with pool_type "max" (not global) and the forward of 2x2 windows at
stride 2 that tile the plane, on C-contiguous NCHW or NHWC (pool_native_nhwc.h:
vectorized over channels) float32 or float64 arrays, with the numpy kernels'
semantics (kernels/cpu/pool2d.py, the reference they are tested against; the C
files say them in full); and global average pooling of float32 NCHW arrays, the
float64 mean of each plane rounded once.

Each returns None where the native kernel does not apply: it is off or
not built (native.reason says why), or an array is not float32/float64 or not
C-contiguous, or x and dout disagree in dtype. The caller then runs the numpy
kernel. Threads: `minigraph.kernels.cpu.blocks.get_num_threads()`, fewer for small
arrays (MIN_THREAD_VALUES values a thread); a plane (NHWC: an image) is one thread's,
so results do not depend on the count.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_THREAD_VALUES = 1 << 17      # values a thread must have to be worth waking

_P, _L = ctypes.c_void_p, ctypes.c_int64
_TYPES = (np.dtype(np.float32), np.dtype(np.float64))
_kernel = _tiles = _kernel_nhwc = _tiles_nhwc = _global_avg = _avg = None


def _load():
    """The typed C function max_pool_grad (and max_pool_tiles, and their NHWC
    versions), or None where the library cannot be built."""
    global _kernel, _tiles, _kernel_nhwc, _tiles_nhwc, _global_avg, _avg
    if _kernel is None:
        lib = native.library("pool_native")
        if lib is None:
            return None
        lib.max_pool_tiles.argtypes = [ctypes.c_int, _P, _P, _L, _L, ctypes.c_int]
        lib.max_pool_tiles.restype = ctypes.c_int
        lib.max_pool_tiles_nhwc.argtypes = [ctypes.c_int, _P, _P, _L, _L, _L]
        lib.max_pool_tiles_nhwc.restype = ctypes.c_int
        _tiles, _tiles_nhwc = lib.max_pool_tiles, lib.max_pool_tiles_nhwc
        lib.avg_pool_f32.argtypes = [ctypes.c_int, _P, _P, _P, _L, _L, _L,
                                     ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.avg_pool_f32.restype = ctypes.c_int
        lib.global_avg_pool.argtypes = [_P, _P, _L, _L, ctypes.c_int]
        lib.global_avg_pool.restype = ctypes.c_int
        _global_avg, _avg = lib.global_avg_pool, lib.avg_pool_f32
        lib.max_pool_grad_nhwc.argtypes = [ctypes.c_int, _P, _P, _P, _L, _L, _L, _L,
                                           ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.max_pool_grad_nhwc.restype = ctypes.c_int
        _kernel_nhwc = lib.max_pool_grad_nhwc
        lib.max_pool_grad.argtypes = [ctypes.c_int, _P, _P, _P, _L, _L, _L,
                                      ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        lib.max_pool_grad.restype = ctypes.c_int
        _kernel = lib.max_pool_grad
    return _kernel


def tiles_shape(x, layout="NCHW"):
    """The shape of max_pool_tiles(x, layout)'s result, or None where the native kernel
    does not take x."""
    nhwc = layout == "NHWC"
    if not (x.ndim == 4 and native.enabled() and x.dtype in _TYPES and x.flags.c_contiguous
            and _load() is not None):
        return None
    h, w = x.shape[1:3] if nhwc else x.shape[2:4]
    if h % 2 or w % 2:
        return None
    return (x.shape[0], h // 2, w // 2, x.shape[3]) if nhwc else x.shape[:2] + (h // 2, w // 2)


def max_pool_tiles(x, layout="NCHW"):
    """The max of every 2x2 window of x (N, C, H, W), or (N, H, W, C) in NHWC, H and W
    even, at stride 2: (N, C, H / 2, W / 2) (or (N, H / 2, W / 2, C)). None where the
    native kernel does not apply."""
    shape = tiles_shape(x, layout)
    if shape is None:
        return None
    out = np.empty(shape, x.dtype)
    if out.size:
        prepared_max_tiles(x, out, layout)()
    return out


def prepared_max_tiles(x, out, layout="NCHW"):
    """max_pool_tiles(x, layout) into `out` (C-contiguous, of tiles_shape(x, layout) and
    x's dtype, not empty) prepared once: a function of no arguments that runs it on what
    x holds then (minigraph.bound_run)."""
    f64, at, to = int(x.dtype == np.float64), native.address(x), native.address(out)
    if layout == "NHWC":
        n, h, w, c = x.shape
        return functools.partial(_tiles_nhwc, f64, at, to, n * h // 2, w, c)
    n, c, h, w = x.shape

    def call():
        if _tiles(f64, at, to, n * c * h // 2, w, blocks.threads_for(x.size, MIN_THREAD_VALUES)):
            raise MemoryError("pool_native.max_pool_tiles: the row buffer could not be "
                              "allocated")
    return call


def global_avg(x):
    """The mean of each plane of a float32 NCHW x (N, C, H, W): (N, C, 1, 1), summed in
    float64 (pool_native.c says in which order). None where the native kernel does not
    apply."""
    if not global_avg_takes(x):
        return None
    out = np.empty(x.shape[:2] + (1, 1), np.float32)
    if out.size:
        prepared_global_avg(x, out)()
    return out


def global_avg_takes(x):
    """True when global_avg's native kernel takes x: float32 NCHW, C-contiguous, planes
    of at least one value, the kernels built."""
    return (native.enabled() and x.dtype == np.float32 and x.ndim == 4
            and x.flags.c_contiguous and x.shape[2] * x.shape[3] > 0 and _load() is not None)


def prepared_global_avg(x, out):
    """global_avg(x) into `out` ((N, C, 1, 1) float32, C-contiguous, not empty) prepared
    once, as prepared_max_tiles."""
    n, c, h, w = x.shape
    args = (native.address(x), native.address(out), n * c, h * w)

    def call():
        _global_avg(*args, blocks.threads_for(x.size, MIN_THREAD_VALUES))
    return call


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and _load() is not None


def max_pool_grad(x, dout, attrs, hw, layout="NCHW"):
    """dx of max pooling: dout (N, C, Ho, Wo), hw = (Ho, Wo), routed to each window's
    first max in x (N, C, H, W) (NHWC: dout (N, Ho, Wo, C), x (N, H, W, C)); attrs: the
    op's resolved ksize, strides, paddings. None where the native kernel does not
    apply."""
    dtype, nhwc = x.dtype, layout == "NHWC"
    if x.ndim != 4:
        return None
    want = (x.shape[0], *hw, x.shape[3]) if nhwc else x.shape[:2] + tuple(hw)
    if not (native.enabled() and dtype in _TYPES and _load() is not None
            and dout.dtype == dtype and dout.shape == want
            and x.flags.c_contiguous and dout.flags.c_contiguous):
        return None
    dx = np.empty_like(x)
    if dx.size:
        geometry = (ctypes.c_int64 * 8)(*hw, *attrs["ksize"], *attrs["strides"],
                                        *attrs["paddings"])
        threads = blocks.threads_for(x.size, MIN_THREAD_VALUES)
        f64 = int(dtype == np.float64)
        if nhwc:
            n, h, w, c = x.shape
            if _kernel_nhwc(f64, x.ctypes.data, dout.ctypes.data, dx.ctypes.data, n, h, w, c,
                            geometry, threads):
                raise MemoryError("pool_native.max_pool_grad: the kernel's buffers could "
                                  "not be allocated")
            return dx
        n, c, h, w = x.shape
        _kernel(f64, x.ctypes.data, dout.ctypes.data, dx.ctypes.data, n * c, h, w, geometry,
                threads)
    return dx


def avg_pool(x, attrs, hw, dout=None):
    """Average pooling of float32 NCHW x (N, C, H, W) over the real elements of each
    window (attrs: the op's resolved ksize, strides, paddings; hw = (Ho, Wo)), or, given
    dout (N, C, Ho, Wo), its gradient dx (N, C, H, W); the numpy kernel's bits
    (pool_avg.h); the gradient reads only x's shape (x may be a stand-in: the executor's
    for a value dropped). None where the native kernel does not apply."""
    if not avg_pool_takes(x, gradient=dout is not None):
        return None
    n, c, h, w = x.shape
    if dout is not None and not (dout.dtype == np.float32 and dout.flags.c_contiguous
                                 and dout.shape == (n, c, *hw)):
        return None
    out = np.empty(x.shape if dout is not None else (n, c, *hw), np.float32)
    if out.size:
        prepared_avg_pool(x, out, attrs, hw, dout)()
    return out


def avg_pool_takes(x, gradient=False):
    """True when avg_pool's native kernel takes x: float32 NCHW, C-contiguous (for the
    forward pass), the kernels built."""
    return (native.enabled() and x.ndim == 4 and x.dtype == np.float32
            and (gradient or x.flags.c_contiguous) and _load() is not None)


def prepared_avg_pool(x, out, attrs, hw, dout=None):
    """avg_pool(x, attrs, hw, dout) into `out` (C-contiguous float32 of its shape, not
    empty; x and dout as avg_pool takes them) prepared once: a function of no arguments
    that runs it on what x (dout) holds then (minigraph.bound_run)."""
    n, c, h, w = x.shape
    geometry = (ctypes.c_int64 * 8)(*hw, *attrs["ksize"], *attrs["strides"],
                                    *attrs["paddings"])
    args = (int(dout is not None), None if dout is not None else native.address(x),
            native.address(dout),
            native.address(out), n * c, h, w, geometry)

    def call():
        if _avg(*args, blocks.threads_for(x.size, MIN_THREAD_VALUES)):
            raise MemoryError("pool_native.avg_pool: the kernel's buffers could not be "
                              "allocated")
    return call
