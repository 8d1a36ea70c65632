"""Launchers of the native optimizer updates (optim_native.c, built by native.py):
sgd, momentum and adam over C-contiguous float32 or float64 arrays in one pass,
each value read once and written once.

`update(kind, ...)` returns False where the native kernels are not available or do
not take the arrays (another dtype, not contiguous, mixed dtypes): the caller then
runs its numpy kernel, which is the reference the native one is tested against.
Outputs may be the input arrays themselves (in place) or other arrays of the same
shape and dtype (out of place).
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import native

KINDS = {"sgd": 0, "momentum": 1, "adam": 2}
_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _lib():
    lib = native.library("optim_native")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.optim_update.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _P, _L,
                                     ctypes.POINTER(ctypes.c_double), _I, _I, _I]
        lib.optim_update.restype = _I
        lib._typed = True
    return lib


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return _lib() is not None


def _fits(arrays, dtype):
    return all(a is None or (type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous)
               for a in arrays)


def update(kind, param, grad, state=(None, None), out=(None, None, None), lr=0.0, wd=0.0,
           mu=0.0, betas=(0.0, 0.0), eps=0.0, corrections=(0.0, 1.0), nesterov=False,
           decoupled=False, threads=1):
    """One update of `kind` ("sgd", "momentum" or "adam") in the arrays' dtype.

    state: (velocity, None) for momentum, (moment1, moment2) for adam; out: (param,
    state 1, state 2) to write (the inputs themselves for an update in place);
    corrections: adam's (lr / (1 - beta1^t), sqrt(1 - beta2^t)). Returns True when
    the native kernel ran, False when the caller must run its numpy kernel."""
    dtype = param.dtype
    if dtype not in (np.float32, np.float64) or grad.shape != param.shape:
        return False
    arrays = (param, grad, *state, *out)
    if not _fits(arrays, dtype) or any(a is not None and a.shape != param.shape
                                       for a in arrays):
        return False
    lib = _lib()
    if lib is None:
        return False
    scalars = (ctypes.c_double * 8)(lr, wd, mu, betas[0], betas[1], eps, *corrections)
    m, v = state
    po, mo, vo = out
    lib.optim_update(KINDS[kind], int(dtype == np.float64), param.ctypes.data,
                     grad.ctypes.data, None if m is None else m.ctypes.data,
                     None if v is None else v.ctypes.data, po.ctypes.data,
                     None if mo is None else mo.ctypes.data,
                     None if vo is None else vo.ctypes.data, param.size, scalars,
                     int(bool(nesterov)), int(bool(decoupled)), int(threads))
    return True
