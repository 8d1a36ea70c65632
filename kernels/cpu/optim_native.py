"""Launchers of the native optimizer updates (optim_native.c, built by native.py):
sgd, momentum and adam over C-contiguous float32 or float64 arrays in one pass,
each value read once and written once.

`update_list(kind, ...)` makes the update of several parameters in one call, each as
`update` would make it (merged_momentum's kernel).

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
# the values from which the op kernels take the native update: below, numpy's few
# ufunc calls cost less than setting up the C call
MIN_VALUES = {"sgd": 16384, "momentum": 16384, "adam": 4096}


def worth_it(kind, param):
    """Whether an op kernel should try the native `kind` update on `param` (its size)."""
    return param.size >= MIN_VALUES[kind]
_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def _lib():
    lib = native.library("optim_native")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.optim_update.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P, _P, _L,
                                     ctypes.POINTER(ctypes.c_double), _I, _I, _I]
        lib.optim_update.restype = _I
        lib.optim_update_list.argtypes = [_I, _I, _L, _P, _P, ctypes.POINTER(ctypes.c_double),
                                          _I, _I, _I]
        lib.optim_update_list.restype = _I
        lib._typed = True
    return lib


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return _lib() is not None


_SCALARS = ctypes.c_double * 8
_ptr = native.address
_char, _address = ctypes.c_char.from_buffer, ctypes.addressof   # native.address's way


def _fits(arrays, dtype, shape):
    return all(a is None or (type(a) is np.ndarray and a.dtype == dtype and a.shape == shape
                             and a.flags.c_contiguous)
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
    if dtype != _F32 and dtype != _F64:
        return False
    if not _fits((param, grad, *state, *out), dtype, param.shape):
        return False
    lib = _lib()
    if lib is None:
        return False
    m, v = state
    po, mo, vo = out
    lib.optim_update(KINDS[kind], int(dtype == _F64), _ptr(param), _ptr(grad), _ptr(m),
                     _ptr(v), _ptr(po), _ptr(mo), _ptr(vo), param.size,
                     _SCALARS(lr, wd, mu, betas[0], betas[1], eps, *corrections),
                     int(bool(nesterov)), int(bool(decoupled)), int(threads))
    return True


def update_list(kind, params, grads, state, out, lr=0.0, wd=0.0, mu=0.0, nesterov=False,
                threads=1):
    """`update` of each parameter in the list `params` (one dtype, float32 or float64),
    in one native call. grads, and each entry of state ((velocities, None) for
    momentum) and out ((params, state 1, state 2) to write), are lists aligned with
    params, or None. Returns False, having changed nothing, where the kernels are not
    built or an array does not fit (then the caller updates each parameter itself)."""
    dtype = params[0].dtype if params else None
    if dtype != _F32 and dtype != _F64:
        return False
    lib = _lib()
    if lib is None:
        return False
    count = len(params)
    sizes = [p.size for p in params]
    columns = (params, grads, *state, *out)
    addresses = [0] * (7 * count)
    try:
        for j, column in enumerate(columns):
            if column is None:
                continue
            if [a.size for a in column] != sizes or any(a.dtype != dtype for a in column):
                return False
            addresses[j::7] = [_address(_char(a)) for a in column]
    except (TypeError, ValueError):     # not C-contiguous, read-only, or empty
        return False
    table = np.array(addresses + sizes, dtype=np.int64)   # the pointers, then the sizes
    at = _address(_char(table))
    if lib.optim_update_list(KINDS[kind], int(dtype == _F64), count, at, at + 8 * len(addresses),
                             _SCALARS(lr, wd, mu, 0.0, 0.0, 0.0, 0.0, 1.0),
                             int(bool(nesterov)), 0, int(threads)):
        raise MemoryError(f"optim_update_list: no memory for the offsets of {count} arrays")
    return True
