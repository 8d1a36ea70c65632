"""Launcher of the native sum over rows of a bias gradient (rows_native.c, built by
native.py): `sum_rows(a)` for a (R, C) float32 gives the same bits as
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
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_THREAD_VALUES = 1 << 16          # values a thread (one add and a convert each)

_F32 = np.dtype(np.float32)
_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_kernel = []


def _load():
    if not _kernel:
        _kernel.append(native.typed_function("rows_native", "rows_sum_f32",
                                             [_P, _P, _L, _L, _I]))
    return _kernel[0]


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
