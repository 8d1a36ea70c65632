"""Launcher of the native CPU gelu and its gradient for float32 (gelu_native.c, built
by native.py): x Phi(x) and dout (Phi(x) + x phi(x)), Phi from an erfc of fractional
error 1.2e-7 in float, 16 lanes at a time (8 without AVX-512), within a few float32
ulps of the float64 numpy kernels (kernels/cpu/activation.py, the reference they are
tested against; float64 stays there).

`forward` and `backward` return None where the native kernel does not apply: it is
off or not built (native.reason says why), or the arrays are not C-contiguous float32
arrays of one shape. The caller then runs the numpy kernel. Threads:
`blocks.get_num_threads()`, fewer for small arrays; results do not depend on the count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

MIN_THREAD_VALUES = 1 << 15          # values a thread (gelu costs ~40 flops a value)

_F32 = np.dtype(np.float32)
_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_kernels = {}


_ptr = native.address           # None for an empty array: never passed one here


def _load(symbol):
    if symbol not in _kernels:
        args = {"gelu_forward_f32": [_P, _P, _L, _I], "gelu_backward_f32": [_P, _P, _P, _L, _I],
                "gelu_forward_f32_packed": [ctypes.POINTER(_L)]}[symbol]
        _kernels[symbol] = native.typed_function("gelu_native", symbol, args)
    return _kernels[symbol]


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and _load("gelu_forward_f32") is not None


def _applies(*arrays):
    return (native.enabled() and all(a.dtype == _F32 and a.flags.c_contiguous
                                     and a.shape == arrays[0].shape for a in arrays))


def forward(x):
    """gelu(x) as a new float32 array, or None (see the module doc)."""
    if x.dtype != _F32 or not x.flags.c_contiguous or not native.enabled():
        return None
    fn = _load("gelu_forward_f32")
    if fn is None:
        return None
    out = np.empty_like(x)
    if x.size:
        fn(_ptr(x), _ptr(out), x.size, blocks.threads_for(x.size, MIN_THREAD_VALUES))
    return out


def prepared_forward(x, out):
    """forward's call from x into `out` (both C-contiguous float32 of one shape),
    prepared once: a function of no arguments that runs it on what x holds then (a
    bound form's, minigraph.bound_run); None where forward would return None."""
    fn = _load("gelu_forward_f32") if x.size and _applies(x, out) else None
    if fn is None:
        return None
    ints = native.packed_ints((_ptr(x), _ptr(out), x.size,
                               blocks.threads_for(x.size, MIN_THREAD_VALUES)))
    packed = _load("gelu_forward_f32_packed")

    def call():
        ints[3] = blocks.threads_for(x.size, MIN_THREAD_VALUES)
        packed(ints)
    return call


def backward(x, dout, dx=None):
    """dout (Phi(x) + x phi(x)) into dx (a new array unless given; it may be dout), or None
    (see the module doc)."""
    fn = _load("gelu_backward_f32") if _applies(x, dout) else None
    if fn is None:
        return None
    dx = np.empty_like(dout) if dx is None else dx
    if x.size:
        fn(_ptr(x), _ptr(dout), _ptr(dx), x.size, blocks.threads_for(x.size, MIN_THREAD_VALUES))
    return dx
