"""Launchers of the native CPU normalisation kernels (norm_native.c, built by native.py):
per row of a C-contiguous (rows, L) float32 or float64 array, the mean and biased
variance (stable on offset data), the normalisation with its affine in one pass,
and the gradient.

The affine index of value e of the flat array is a = (e / post) % A: layer_norm
has post 1 and A = L (one scale per position of a row), group_norm post = the
spatial size and A = C (one per channel). The op kernels (layer_norm.py,
group_norm.py) call these where `available()`, else their numpy engine (the
reference these are tested against).

Threads: `minigraph.kernels.cpu.blocks.get_num_threads()`, fewer for small arrays
(MIN_THREAD_VALUES values a thread); results are deterministic for a given count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

# values a thread must have to be worth waking: below this, handing a part to the pool's
# workers (watching for work between a step's ops) and waiting for them costs about what
# they save (layer_norm on rows of 128, 2 threads against 1: forward 23 against 36 us at
# 64Ki values, 41 against 70 at 128Ki; backward level at 64Ki, 109 against 152 at 128Ki)
MIN_THREAD_VALUES = 1 << 15

_P, _L, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_FORWARD = [_P] * 6 + [_L] * 4 + [_D, _L]
_BACKWARD = [_P] * 8 + [_L] * 4 + [_D, _L]
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_kernels = None            # dtype -> (forward, backward), once the library is loaded


def _load():
    """The C functions by dtype, typed once; {} where the library cannot be built."""
    global _kernels
    if _kernels is None:
        lib = native.library("norm_native")
        if lib is None:
            return {}
        found = {}
        for dtype, suffix in ((_F32, "f32"), (_F64, "f64")):
            forward, backward, packed = (getattr(lib, f"norm_{what}_{suffix}")
                                         for what in ("forward", "backward", "forward_packed"))
            forward.argtypes, backward.argtypes = _FORWARD, _BACKWARD
            packed.argtypes = [ctypes.POINTER(_L), ctypes.POINTER(_D)]
            found[dtype] = (forward, backward, packed)
        _kernels = found
    return _kernels


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and bool(_load())


def kernels(dtype):
    """(forward, backward, forward_packed) C functions for `dtype` (float32, float64), or None where
    the native kernels are off or cannot be built, or take no such dtype."""
    return (_kernels or _load()).get(dtype) if native.enabled() else None


def threads_for(values):
    """The threads a pass over `values` values runs on: at most get_num_threads()."""
    return blocks.threads_for(values, MIN_THREAD_VALUES)


_ptr = native.address


def _vector(a, dtype, size, name):
    """`a` as a C-contiguous vector of `size` values of `dtype`, copied only
    where needed."""
    a = np.ascontiguousarray(a, dtype)
    if a.shape != (size,):
        if a.size != size:
            raise ValueError(f"norm_native: {name} has shape {a.shape}, expected ({size},)")
        a = a.reshape(size)
    return a


def forward(x2, eps, scale=None, bias=None, post=1, size=None, want_y=True):
    """(y or None, stats) of each row of x2 (rows, L), float32 or float64: y = (x -
    mean) / sqrt(variance + eps) * scale[a] + bias[a], stats (2, rows) the rows' mean
    and variance, both in x2's dtype; None where the native kernels take no x2.
    scale, bias: `size` values (default L) or None; a = (e / post) % size for value
    e of the flat array."""
    fns = kernels(x2.dtype)
    if fns is None:
        return None
    x2 = np.ascontiguousarray(x2)
    rows, length = x2.shape
    dtype = x2.dtype
    if size is None:
        size = length
    if scale is not None:
        scale = _vector(scale, dtype, size, "scale")
    if bias is not None:
        bias = _vector(bias, dtype, size, "bias")
    y = np.empty((rows, length), dtype) if want_y else None
    stats = np.empty((2, rows), dtype)
    values = rows * length
    if values:
        at = _ptr(stats)
        if fns[0](_ptr(x2), _ptr(y), _ptr(scale), _ptr(bias),
                  at, at + rows * dtype.itemsize, rows, length, post, size, eps,
                  1 if values < 2 * MIN_THREAD_VALUES else threads_for(values)):
            raise MemoryError("norm_native.forward: the kernel's buffers could not be allocated")
    else:
        stats.fill(0)
    return y, stats


def prepared_forward(x, rows, length, eps, scale, bias, y, stats):
    """forward's call on x (C-contiguous, viewed as `rows` rows of `length`) into the
    arrays y (x's shape) and stats (2, rows), prepared once: a function of no arguments
    that runs it on what the arrays hold then (a bound form's, minigraph.bound_run).
    None where the native kernels take no x, or scale or bias (None, or `length` values)
    would need a copy: they are parameters, which an optimizer changes in place."""
    fns = kernels(x.dtype)
    dtype = x.dtype
    if fns is None or not x.size or not x.flags.c_contiguous or any(
            a is not None and not (a.dtype == dtype and a.size == length
                                   and a.flags.c_contiguous) for a in (scale, bias)):
        return None
    values, at = rows * length, _ptr(stats)
    ints = native.packed_ints((_ptr(x), _ptr(y), _ptr(scale), _ptr(bias), at,
                               at + rows * dtype.itemsize, rows, length, 1, length, 1))
    reals, packed = (ctypes.c_double * 1)(eps), fns[2]

    def call():
        ints[10] = 1 if values < 2 * MIN_THREAD_VALUES else threads_for(values)
        if packed(ints, reals):
            raise MemoryError("norm_native.forward: the kernel's buffers could not be "
                              "allocated")
    return call


def backward(x2, dy2, mean, var, eps, scale=None, post=1, size=None, want=("dx",)):
    """{dx, dscale, dbias} (those in `want`) of the normalisation of x2 (rows, L) with the
    saved mean and variance (rows,), for dy2 (x2's shape): dx = invstd (g - mean_row(g)
    - xhat mean_row(g xhat)) with g = dy scale[a]; dscale, dbias (`size`,) the sums of
    dy xhat and dy over the values of each affine index. x2's dtype throughout; None
    where the native kernels take no x2."""
    fns = kernels(x2.dtype)
    if fns is None:
        return None
    x2 = np.ascontiguousarray(x2)
    rows, length = x2.shape
    dtype = x2.dtype
    size = length if size is None else size
    dy2 = np.ascontiguousarray(dy2, dtype)
    if dy2.shape != x2.shape:
        raise ValueError(f"norm_native: dy has shape {dy2.shape}, expected {x2.shape}")
    mean, var = _vector(mean, dtype, rows, "mean"), _vector(var, dtype, rows, "variance")
    if scale is not None:
        scale = _vector(scale, dtype, size, "scale")
    out = {"dx": np.empty((rows, length), dtype)} if "dx" in want else {}
    for name in ("dscale", "dbias"):
        if name in want:
            out[name] = np.zeros(size, dtype)
    if rows and length:
        if fns[1](_ptr(x2), _ptr(dy2), _ptr(mean), _ptr(var), _ptr(scale), _ptr(out.get("dx")),
                  _ptr(out.get("dscale")), _ptr(out.get("dbias")), rows, length, post, size,
                  eps, threads_for(rows * length)):
            raise MemoryError("norm_native.backward: the kernel's buffers could not be "
                              "allocated")
    return out
