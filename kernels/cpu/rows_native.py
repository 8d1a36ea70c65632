"""Launchers of rows_native.c (built by native.py): the sum over rows of a bias
gradient, adds on several threads, a sum of squares, and a product by a scalar.

`add(a, b, out)` (out = a + b, one shape) splits the values over the threads for
arrays of at least 2 * MIN_THREAD_ADD values; `add_bias(x, bias, out)` (bias added
to each row of x) and `add_channel_bias(x, bias, axis, out)` (bias[c] added to
every value of channel c along `axis`: a conv's bias on NCHW) take arrays of
MIN_THREAD_ADD values and more, on one thread too (numpy's broadcast add runs its
inner loop once a row: three times as long on 1024 x 128, and 3-4x as long as a
same-shape add on 64x32x28x28 with a bias per channel). Float32 or float64,
C-contiguous, out possibly a or x; each value is one IEEE add, so the bits are
numpy's. They return None elsewhere (smaller arrays, other dtypes or layouts,
native kernels off): numpy adds then, on one thread.

`sum_rows(a)` for a (R, C) float32 gives the same bits as
np.add.reduce(a, axis=0, dtype=np.float64).astype(np.float32), which is what
elementwise_add_grad computes (version-1 checkpoints resume bit for bit).

That equality rests on numpy's order, checked in numpy's source and by the tests
(tests/test_rows_native.py, against numpy over many shapes): add.reduce starts each
output at add's identity (+0.0, so a column of -0.0 sums to +0.0) and, for a
C-contiguous 2-D array reduced over axis 0, its iterator keeps the columns as the
inner loop (the output's stride there is not 0), so the inner loop is an element-wise
add of each row into the outputs in row order; the cast to float64 is buffered, which
changes no order. With one column the reduced axis becomes the inner loop and
numpy sums it pairwise instead: `sum_rows` returns None there, as it does for
anything but a C-contiguous float32 2-D array or where the native kernels are off or
not built (native.reason says why). The caller then runs numpy.

`sum_squares(a)` (clipping's norm) and `scale(x, s)` (scale without a bias) each
take their own docstring's contract.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_THREAD_VALUES = 1 << 16          # values a thread (one add and a convert each)
MIN_THREAD_ADD = 1 << 16             # values a thread of the adds
MIN_SCALE = 1 << 12                  # values from which the C pass beats numpy (16Ki: 7 us vs 18)

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_FLOATS = (_F32, _F64)
_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"rows_sum_f32": ([_P, _P, _L, _L, _I], ctypes.c_int),
               "rows_add": ([_I, _I, _P, _P, _P, _L, _L, _L, _I], ctypes.c_int),
               "rows_sum_squares": ([_I, _P, _L, _I], ctypes.c_double),
               "rows_scale": ([_I, _P, _P, _L, ctypes.c_double, _I], ctypes.c_int)}
_kernel = {}                         # symbol -> its typed C function (None: not built)


def _load():
    """The typed C functions, loaded once; the first (None where the library is not at
    hand, when all are)."""
    if not _kernel:
        for symbol, (args, result) in _SIGNATURES.items():
            _kernel[symbol] = native.typed_function("rows_native", symbol, args, result)
    return _kernel["rows_sum_f32"]


def add(a, b, out=None):
    """out (returned; None: a new array) = a + b on the threads, or None (see the
    module doc)."""
    return _add(a, b, out, 0, a.size, 1)


def add_bias(x, bias, out=None):
    """out (returned; None: a new array) = x + bias on its last axis (bias: x.shape[-1]
    values) on the threads, or None (see the module doc)."""
    cols = x.shape[-1] if x.ndim else 1
    if bias.shape != (cols,) or cols == 0:
        return None
    return _add(x, bias, out, 1, x.size // cols, cols)


def add_channel_bias(x, bias, axis, out=None):
    """out (returned; None: a new array) = x + bias[c] for every value of x whose index
    along `axis` is c (bias: x.shape[axis] values; axis below x's last dim), on the
    threads, or None (see the module doc)."""
    channels = x.shape[axis] if 0 <= axis < x.ndim - 1 else 0
    if channels == 0 or bias.shape != (channels,) or x.size == 0:
        return None
    cols = x.size // math.prod(x.shape[:axis + 1])
    return _add(x, bias, out, 2, x.size // cols, cols, channels)


def _add(a, b, out, bias, n, cols, channels=1):
    threads = blocks.threads_for(a.size, MIN_THREAD_ADD)
    too_few = a.size < MIN_THREAD_ADD if bias else threads < 2
    if (too_few or a.dtype not in _FLOATS or b.dtype != a.dtype
            or (not bias and b.shape != a.shape)
            or not (a.flags.c_contiguous and b.flags.c_contiguous)
            or (out is not None and not (out.dtype == a.dtype and out.shape == a.shape
                                         and out.flags.c_contiguous and out.flags.writeable))
            or not native.enabled() or _load() is None):
        return None
    if out is None:
        out = np.empty(a.shape, a.dtype)
    _kernel["rows_add"](int(a.dtype == _F64), bias, native.address(a), native.address(b),
                        native.address(out), n, cols, channels, threads)
    return out


def sum_rows(a):
    """The float32 (C,) sum over the rows of a (R, C), numpy's bits (see the module
    doc), or None where the native kernel does not apply."""
    if not (native.enabled() and a.ndim == 2 and a.dtype == _F32 and a.flags.c_contiguous
            and a.shape[1] >= 2):
        return None
    fn = _load()
    if fn is None:
        return None
    out = np.zeros(a.shape[1], dtype=np.float32)
    if a.shape[0]:
        fn(native.address(a), native.address(out), a.shape[0], a.shape[1],
           blocks.threads_for(a.size, MIN_THREAD_VALUES))
    return out


def sum_squares(a):
    """The float64 sum of the squares of a's values (float32 or float64, C-contiguous;
    each squared in float64), or None where the native kernel does not apply (another
    dtype or layout, no values, the native kernels off or not built). On the threads
    from 2 * MIN_THREAD_VALUES values, in contiguous ranges whose sums are added in
    order: the same result for a given thread count, within float64 rounding of any
    other order."""
    if (a.dtype not in _FLOATS or not a.flags.c_contiguous or a.size == 0
            or not native.enabled() or _load() is None):
        return None
    return _kernel["rows_sum_squares"](int(a.dtype == _F64), native.address(a), a.size,
                                       blocks.threads_for(a.size, MIN_THREAD_VALUES))


def scale(x, s):
    """A new array x * s with the bits of numpy's (x.astype(float64) * s + 0.0) cast back
    to x's dtype (float32 or float64, C-contiguous, at least MIN_SCALE values): one pass
    in C on the threads, instead of four passes and three temporaries; None elsewhere
    (or with the native kernels off or not built)."""
    if (x.dtype not in _FLOATS or not x.flags.c_contiguous or x.size < MIN_SCALE
            or not native.enabled() or _load() is None):
        return None
    out = np.empty(x.shape, x.dtype)
    _kernel["rows_scale"](int(x.dtype == _F64), native.address(x), native.address(out),
                          x.size, float(s), blocks.threads_for(x.size, MIN_THREAD_ADD))
    return out
