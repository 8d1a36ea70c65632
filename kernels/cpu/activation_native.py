"""Launcher of the native CPU kernels of float32 leaky_relu, sigmoid, tanh and silu and
their gradients (activation_native.c, built by native.py; the C file says how each is
computed): leaky_relu's bits are the numpy kernel's, the others within a few float32
ulps of the float64 numpy kernels (kernels/cpu/activation.py and silu.py, the
reference they are tested against; float64 stays there).

`forward` and `backward` return None where the native kernel does not apply: it is
off or not built (native.reason says why), or the arrays are not C-contiguous float32
arrays of one shape. The caller then runs the numpy kernel. Threads:
`blocks.get_num_threads()`, fewer for small arrays; results do not depend on the count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native

KINDS = {"leaky_relu": 0, "sigmoid": 1, "tanh": 2, "silu": 3}
# values a thread must have to be worth waking: leaky_relu reads and writes memory,
# the others spend ~20-40 flops a value
MIN_THREAD_VALUES = {"leaky_relu": 1 << 17, "sigmoid": 1 << 15, "tanh": 1 << 15,
                     "silu": 1 << 15}

_F32 = np.dtype(np.float32)
_kernel = None


def _load():
    global _kernel
    if _kernel is None:
        _kernel = native.typed_function(
            "activation_native", "activation_f32",
            [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_double, ctypes.c_int])
    return _kernel


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and _load() is not None


def _takes(*arrays):
    first = arrays[0]
    return (native.enabled() and all(a.dtype == _F32 and a.shape == first.shape
                                     and a.flags.c_contiguous for a in arrays)
            and _load() is not None)


def _run(kind, grad, v, dout, out, alpha):
    if out.size:
        _kernel(KINDS[kind], grad, v.ctypes.data, None if dout is None else dout.ctypes.data,
                out.ctypes.data, out.size, float(alpha),
                blocks.threads_for(out.size, MIN_THREAD_VALUES[kind]))
    return out


def forward(kind, x, alpha=0.0):
    """`kind`'s activation of float32 x (alpha: leaky_relu's slope) as a new array, or
    None where the native kernel does not apply."""
    if not _takes(x):
        return None
    return _run(kind, 0, x, None, np.empty(x.shape, _F32), alpha)


def prepared_forward(kind, x, out, alpha=0.0):
    """forward(kind, x, alpha)'s call from x into `out` (both C-contiguous float32 of
    one shape, not empty), prepared once: a function of no arguments that runs it on
    what x holds then (a bound form's, minigraph.bound_run); None where forward would
    return None."""
    if not (x.size and _takes(x, out)):
        return None
    args = (KINDS[kind], 0, native.address(x), None, native.address(out), x.size,
            float(alpha))
    least = MIN_THREAD_VALUES[kind]

    def call():
        _kernel(*args, blocks.threads_for(x.size, least))
    return call


def backward(kind, v, dout, alpha=0.0, into=None):
    """dx of `kind` for dout (v: the op's out for sigmoid and tanh, else its x), into
    `into` (dout's shape, float32, C-contiguous; it may be dout) or a new array; None
    where the native kernel does not apply."""
    out = np.empty(dout.shape, _F32) if into is None else into
    if not (_takes(v, dout, out) and out.flags.writeable):
        return None
    return _run(kind, 1, v, dout, out, alpha)
