"""Launcher of the native CPU dropout forward (dropout_native.c, built by native.py):
the Philox keep mask and the scaled output in one pass, bit for bit the numpy
kernel's (kernels/cpu/dropout.py, the reference it is tested against).

`forward` returns None where the native kernel does not apply: it is off or not
built (native.reason says why), or x is not a C-contiguous float32/float64 array.
The caller then runs the numpy kernel. Threads: `blocks.get_num_threads()`, fewer
for small arrays (MIN_THREAD_VALUES values a thread); results do not depend on
the count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_THREAD_VALUES = 1 << 13      # values a thread must have to be worth waking (a Philox
                                 # call per 4 values: 31Ki take 116 us on 2 threads, 144 on 1)

_TYPES = (np.dtype(np.float32), np.dtype(np.float64))
_kernel = None


def _load():
    """The typed C function dropout_forward, or None where the library cannot be built."""
    global _kernel
    if _kernel is None:
        _kernel = native.typed_function(
            "dropout_native", "dropout_forward",
            [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_double, ctypes.c_double, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int])
    return _kernel


def available():
    """True when the native kernel is built and loaded (native.reason says why not)."""
    return native.enabled() and _load() is not None


def forward(x, p, factor, seed64, stream):
    """(out, keep) of dropout's training forward: keep (uint8, x's shape) from the Philox
    words of `stream` under `seed64` (keep_i = u_i >= p), out = x * (keep * factor) in
    x's dtype (factor: 1 / (1 - p) as a float). None where the native kernel does not
    apply."""
    if not (native.enabled() and x.dtype in _TYPES and x.flags.c_contiguous
            and _load() is not None):
        return None
    out = np.empty_like(x)
    keep = np.empty(x.shape, np.uint8)
    if x.size:
        threads = blocks.threads_for(x.size, MIN_THREAD_VALUES)
        _kernel(int(x.dtype == np.float64), x.ctypes.data, out.ctypes.data, keep.ctypes.data,
                x.size, float(p), float(factor), int(seed64) & 0xFFFFFFFFFFFFFFFF,
                int(stream), threads)
    return out, keep
