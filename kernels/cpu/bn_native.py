"""Launchers of the native CPU batch-norm kernels (bn_native.c, built by native.py):
the four primitives of batch_norm_stats on (R, C, I) views of C-contiguous float32
or float64 arrays (NCHW: I = H * W; NHWC and (N, C): I = 1), and two fused passes
that do a channel's sums and then its outputs while it is in cache.
batch_norm_relu: `relu=True` clamps the forward's output to max(y, 0) as the relu op
does, and `mask3` (its forward output y) makes the gradient passes count dy only
where y > 0, as relu's gradient does.

Numerics are batch_norm_stats': the statistics are sums of x minus a per-channel
shift near the mean (the mean of the channel's first values), the gradient sums
and the outputs use x minus the mean rounded to x's dtype, with the rounding
folded into their constants; sums are taken in vectors of x's dtype over about a
thousand values, then added in double; per-channel results are float64.

Every function returns None (or False) where the native kernels do not apply: they
are off or not built (native.reason says why), or an array is not float32/float64
or not C-contiguous, or the arrays disagree in dtype or shape. The caller then
runs the numpy engine, which is the reference these are tested against.

Threads: `minigraph.kernels.cpu.blocks.get_num_threads()`, fewer for small arrays
(MIN_THREAD_VALUES values a thread). With I > 1 threads split the channels and
results do not depend on their number; with I = 1 they split the rows and the
per-thread sums are added in thread order: deterministic for a given count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

# values a thread must have to be worth waking: below this, waking the pool's workers
# and waiting for them costs about what they save
MIN_THREAD_VALUES = 1 << 17

_P, _L, _D, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
_ARGTYPES = {"stats": [_P, _P, _L, _L, _L, _P, _P, _D, _P, _P, _L, _I],
             "grad": [_P, _P, _P, _L, _L, _L, _P, _P, _P, _P, _P, _L, _P],
             "apply": [_P, _P, _P, _L, _L, _L, _P, _P, _P, _P, _L, _I, _P]}
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_kernels = None            # dtype -> {name: C function}, once the library is loaded


def _load():
    """The C functions by dtype, typed once; {} where the library cannot be built."""
    global _kernels
    if _kernels is None:
        lib = native.library("bn_native")
        if lib is None:
            return {}
        found = {}
        for dtype, suffix in ((_F32, "f32"), (_F64, "f64")):
            found[dtype] = {}
            for name, argtypes in _ARGTYPES.items():
                fn = getattr(lib, f"bn_{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
                found[dtype][name] = fn
        _kernels = found
    return _kernels


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and bool(_load())


def _kernel(name, what, x3, **arrays):
    """The C function `name` where x3 and `arrays` (None: absent) share one float32 or
    float64 dtype and are C-contiguous, else None. A ValueError naming `what` and the
    argument when x3 is not 3-D or an array's shape is not x3's."""
    if x3.ndim != 3:
        raise ValueError(f"bn_native.{what}: x has shape {x3.shape}, expected a 3-D "
                         "(rows, channels, inner) view")
    for arg, a in arrays.items():
        if a is not None and a.shape != x3.shape:
            raise ValueError(f"bn_native.{what}: {arg} has shape {a.shape}, expected "
                             f"{x3.shape} (x's)")
    if not native.enabled():
        return None
    dtype = x3.dtype
    if not x3.flags.c_contiguous or any(
            a is not None and (a.dtype != dtype or not a.flags.c_contiguous)
            for a in arrays.values()):
        return None
    fns = (_kernels or _load()).get(dtype)
    return None if fns is None else fns[name]


def threads_for(values, channels, inner):
    """The threads a pass over `values` values runs on: at most get_num_threads(), one
    per MIN_THREAD_VALUES values, and (channels split, inner > 1) one per channel."""
    threads = blocks.threads_for(values, MIN_THREAD_VALUES)
    return min(threads, channels) if inner > 1 else threads


_ptr = native.address


def _channels(v, c, what, name):
    """v (a scalar or C values) as a C-contiguous float64 vector of C values; a
    ValueError naming `what` and `name` for any other size."""
    v = np.ascontiguousarray(v, np.float64)
    if v.shape == (c,):
        return v
    if v.size not in (1, c):
        raise ValueError(f"bn_native.{what}: {name} has shape {v.shape}, expected ({c},) "
                         "(one value per channel)")
    return np.full(c, v.reshape(-1)[0]) if v.size == 1 else v.reshape(c)


def _call(fn, what, *args):
    """fn(*args) with arrays passed by address (kept alive until it returns)."""
    if fn(*[_ptr(a) if isinstance(a, np.ndarray) else a for a in args]):
        raise MemoryError(f"bn_native.{what}: the kernel's buffers could not be allocated")


def local_stats(x3, eps=None, scale=None, bias=None, out3=None, relu=False):
    """(n, mean, M2) per channel of x3 (R, C, I) in float64, or None where the native
    kernels do not apply. With out3 (x3's shape and dtype), the fused training forward:
    also out3 = (x - mean) / sqrt(M2 / n + eps) * scale + bias (scale, bias: C values),
    then max(out3, 0) with relu, each channel normalised while it is in cache."""
    fn = _kernel("stats", "local_stats", x3, out=out3)
    if fn is None:
        return None
    R, C, I = x3.shape
    n = R * I
    mean, m2 = np.zeros(C), np.zeros(C)
    if n == 0:
        return 0, mean, m2
    fused = out3 is not None
    affine = ((_channels(scale, C, "local_stats", "scale"),
               _channels(bias, C, "local_stats", "bias")) if fused else (None, None))
    _call(fn, "local_stats", x3, out3, R, C, I, *affine, float(eps) if fused else 0.0, mean,
          m2, threads_for(x3.size, C, I), int(bool(relu)))
    return n, mean, m2


def grad_sums(x3, dy3, mean, invstd=None, scale=None, out3=None, mask3=None):
    """(n, Σdy, Σdy·(x−mean)) per channel of x3, dy3 (R, C, I) in float64, or None where
    the native kernels do not apply. With out3 (x3's shape and dtype; it may be dy3),
    the fused training backward: also out3 = dx = k_dy dy + k_x (x - mean) + k_c with
    k_dy = scale invstd, k_x = -scale invstd³ Σdy(x−mean) / n, k_c = -scale invstd Σdy / n,
    each channel's dx written while it is in cache. With mask3 (batch_norm_relu's y),
    dy counts only where mask3 > 0."""
    fn = _kernel("grad", "grad_sums", x3, dy=dy3, out=out3, mask=mask3)
    if fn is None:
        return None
    R, C, I = x3.shape
    n = R * I
    s_dy, s_dyx = np.zeros(C), np.zeros(C)
    if n == 0:
        return 0, s_dy, s_dyx
    fused = out3 is not None
    consts = [_channels(mean, C, "grad_sums", "mean")]
    consts += ([_channels(v, C, "grad_sums", name) for v, name in ((invstd, "invstd"),
                                                                  (scale, "scale"))]
               if fused else [None, None])
    _call(fn, "grad_sums", x3, dy3, out3, R, C, I, *consts, s_dy, s_dyx,
          threads_for(x3.size, C, I), mask3)
    return n, s_dy, s_dyx


def normalize(x3, mean, k, c, out3, relu=False):
    """out3 = (x - mean) * k + c per channel of x3 (R, C, I) (float64 arguments of C
    values), then max(out3, 0) with relu; False (nothing written) where the native
    kernels do not apply."""
    fn = _kernel("apply", "normalize", x3, out=out3)
    if fn is None:
        return False
    R, C, I = x3.shape
    consts = [_channels(v, C, "normalize", name) for v, name in ((mean, "mean"), (k, "k"),
                                                                  (c, "c"))]
    _call(fn, "normalize", x3, None, out3, R, C, I, consts[0], None, *consts[1:],
          threads_for(x3.size, C, I), int(bool(relu)), None)
    return True


def input_grad(x3, dy3, mean, k_dy, k_x, k_c, out3, mask3=None):
    """out3 = k_dy*dy + k_x*(x - mean) + k_c per channel, or k_dy*dy when k_x is None
    (float64 arguments of C values), dy counting only where mask3 > 0 when given; out3
    may be dy3. False (nothing written) where the native kernels do not apply."""
    fn = _kernel("apply", "input_grad", x3, dy=dy3, out=out3, mask=mask3)
    if fn is None:
        return False
    R, C, I = x3.shape
    if k_x is None:
        consts = (None, _channels(k_dy, C, "input_grad", "k_dy"), None, None)
    else:
        consts = tuple(_channels(v, C, "input_grad", name) for v, name in (
            (mean, "mean"), (k_dy, "k_dy"), (k_x, "k_x"), (k_c, "k_c")))
    _call(fn, "input_grad", x3, dy3, out3, R, C, I, *consts, threads_for(x3.size, C, I), 0,
          mask3)
    return True
