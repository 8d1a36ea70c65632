"""Launcher of the native CPU relu gradient (relu_native.c, built by native.py):
dx = dout where out > 0, else +0.0, in one pass, bit for bit the numpy kernel's
(kernels/cpu/activation.py, the reference it is tested against).

`relu_grad` returns False where the native kernel does not apply: it is off or not
built (native.reason says why), or the arrays are not C-contiguous float32/float64
arrays of one shape and dtype. The caller then runs the numpy kernel. Threads:
`blocks.get_num_threads()`, fewer for small arrays (MIN_THREAD_VALUES values a
thread); results do not depend on the count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_THREAD_VALUES = 1 << 17      # values a thread must have to be worth waking

_TYPES = (np.dtype(np.float32), np.dtype(np.float64))
_kernel = None


def _load():
    """The typed C function relu_grad, or None where the library cannot be built."""
    global _kernel
    if _kernel is None:
        _kernel = native.typed_function(
            "relu_native", "relu_grad",
            [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_int])
    return _kernel


def available():
    """True when the native kernel is built and loaded (native.reason says why not)."""
    return native.enabled() and _load() is not None


def relu_grad(out, dout, dx):
    """dx[...] = dout where out > 0, else +0.0 (dx may be dout): True, or False (nothing
    written) where the native kernel does not apply (see the module doc)."""
    if not (native.enabled() and out.dtype in _TYPES and out.dtype == dout.dtype == dx.dtype
            and out.shape == dout.shape == dx.shape and out.flags.c_contiguous
            and dout.flags.c_contiguous and dx.flags.c_contiguous and dx.flags.writeable
            and _load() is not None):
        return False
    if out.size:
        _kernel(int(out.dtype == np.float64), out.ctypes.data, dout.ctypes.data,
                dx.ctypes.data, out.size, blocks.threads_for(out.size, MIN_THREAD_VALUES))
    return True
