"""Launcher of wgrad_native.c (built by native.py): the product of a weight gradient,
float32 x.T @ d for x (R, K) and d (R, M), on the native pool's threads.

OpenBLAS runs such a product (few outputs over a long sum: a linear layer's weight
gradient over a batch of tokens) on two threads hardly faster than on one: (1024,
128).T @ (1024, 128) at 118 GFLOP/s on two threads, 128 on one, on a 2-core AVX-512
machine where the kernel ran 194-224. Each output is one thread's, summed over the
rows in order with one multiply-add each, so the results do not depend on the number
of threads. mul's and matmul's weight gradients run whichever of it and BLAS was the
faster for the shape on this machine (choices.py, kind "fc_dw"); BLAS where nothing is
timed.

`supports(x, d)` says whether it takes a product: both float32 matrices of the same
number of rows, at least MIN_WORK multiply-adds, the native kernels on and the library
built (native.reason says why not).
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_WORK = 1 << 18              # multiply-adds from which the product is worth a choice
MIN_THREAD_WORK = 1 << 20       # multiply-adds a thread must have to be worth waking

_P, _L = ctypes.c_void_p, ctypes.c_int64
_F32 = np.dtype(np.float32)
_kernel = []                    # the typed C function, once loaded (None: not built)


def _fn():
    if not _kernel:
        _kernel.append(native.typed_function("wgrad_native", "wgrad_f32",
                                             [_P, _P, _P] + [_L] * 4))
    return _kernel[0]


def supports(x, d):
    """True when product takes x.T @ d (see the module doc)."""
    return (x.dtype == _F32 and d.dtype == _F32 and x.ndim == 2 and d.ndim == 2
            and x.shape[0] == d.shape[0] and x.size * d.shape[1] >= MIN_WORK
            and native.enabled() and _fn() is not None)


def product(x, d):
    """x.T @ d, (K, M) float32, for x (R, K) and d (R, M) as supports() takes them."""
    x, d = np.ascontiguousarray(x), np.ascontiguousarray(d)
    (r, k), m = x.shape, d.shape[1]
    out = np.empty((k, m), dtype=np.float32)
    threads = blocks.threads_for(r * k * m, MIN_THREAD_WORK)
    _fn()(native.address(x), native.address(d), native.address(out), r, k, m, threads)
    return out
