"""Launchers of swce_native.c (built by native.py): softmax_with_cross_entropy's
forward and its gradient with respect to the logits, float32, in one native pass a
row instead of the dozen numpy calls of kernels/cpu/softmax_with_cross_entropy.py
(the reference they are tested against; a small net's step ran those at several
times their warm cost, each call's code gone from the caches since the last step).

`forward(logits, label, eps)` gives {"softmax", "loss"} and `backward(sm, label,
dloss, eps)` {"dlogits"} for a gradient through the loss alone (the caller runs
numpy when one arrives through the softmax output too); both give None where the
native kernels do not apply: they are off or not built (native.reason says why), an
array is not C-contiguous or not float32 (labels: int64), or a label is outside
[0, K) (nothing written). The caller then runs numpy, whose check names the bad
label. Threads: `blocks.threads_for` the values, MIN_THREAD_VALUES a thread; results
do not depend on the count.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native
from minigraph.kernels.cpu.native import address

MIN_THREAD_VALUES = 1 << 15     # values (an exp and a log-softmax each) a thread

_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_double, ctypes.c_int]
_kernels = {}


def _load(symbol):
    """The typed C function `symbol`, or None where the library cannot be built."""
    if symbol not in _kernels:
        _kernels[symbol] = native.typed_function("swce_native", symbol, _ARGS, ctypes.c_int64)
    return _kernels[symbol]


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and _load("swce_forward") is not None


def _applies(rows, label, *floats):
    return (native.enabled() and label.dtype == np.int64 and label.flags.c_contiguous
            and label.shape == (rows,)
            and all(a.dtype == np.float32 and a.flags.c_contiguous for a in floats))


def forward(logits, label, eps):
    """{"softmax": (N, K), "loss": (N,)} of float32 logits (N, K), K >= 1, and int64
    labels (N,), or None (see the module doc)."""
    n, k = logits.shape
    fn = _load("swce_forward") if k and _applies(n, label, logits) else None
    if fn is None:
        return None
    softmax, loss = np.empty((n, k), np.float32), np.empty(n, np.float32)
    bad = fn(address(logits), address(label), address(softmax), address(loss), n, k,
             float(eps), blocks.threads_for(n * k, MIN_THREAD_VALUES))
    return None if bad >= 0 else {"softmax": softmax, "loss": loss}


def backward(sm, label, dloss, eps):
    """{"dlogits": (N, K)} = (sm - eps / K - (1 - eps) onehot(label)) * dloss[:, None]
    for float32 sm (N, K) and dloss (N,), int64 labels, or None (see the module doc)."""
    n, k = sm.shape
    fits = k and dloss.shape == (n,) and _applies(n, label, sm, dloss)
    fn = _load("swce_backward") if fits else None
    if fn is None:
        return None
    dlogits = np.empty((n, k), np.float32)
    bad = fn(address(sm), address(label), address(dloss), address(dlogits), n, k,
             float(eps), blocks.threads_for(n * k, MIN_THREAD_VALUES))
    return None if bad >= 0 else {"dlogits": dlogits}
