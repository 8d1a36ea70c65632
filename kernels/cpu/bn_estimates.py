"""Launcher of bn_estimates.c (built by native.py): batch norm's new running
estimates after a training batch in one native call, bit for bit the numpy steps of
kernels/cpu/batch_norm.blended_estimates (the reference it is tested against). On
a small net those steps were a dozen numpy calls and two np.errstate blocks a batch
norm, each run once a step with its code long gone from the caches.

`blend(rule, mean, var, factor, est_mean, est_var)`: rule is
batch_norm.estimate_rule's (("batch", None), ("momentum", m) or ("average", w));
mean and var are the batch's float64 statistics, the unbiased variance var * factor.
Returns (new_mean, new_var, finite) - new arrays of the estimates' dtype, and
whether the statistics and new estimates are all finite - or None where the native
kernel does not apply: off or not built (native.reason says why), estimates not
float32 or float64 C-contiguous arrays of one dtype, or statistics not float64
C-contiguous arrays of their length. The caller then runs numpy.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import native
from minigraph.kernels.cpu.native import address

_RULES = {"batch": 0, "momentum": 1, "average": 2}
_TYPES = (np.dtype(np.float32), np.dtype(np.float64))
_F64 = np.dtype(np.float64)
_P, _L, _D, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
_kernel = None


def _load():
    """The typed C function bn_estimates, or None where the library cannot be built."""
    global _kernel
    if _kernel is None:
        _kernel = native.typed_function(
            "bn_estimates", "bn_estimates", [_L, _P, _P, _D, _I, _D, _D, _I, _P, _P, _P, _P])
    return _kernel


def available():
    """True when the native kernel is built and loaded (native.reason says why not)."""
    return native.enabled() and _load() is not None


def _contiguous(a, dtype, length):
    return a.dtype == dtype and a.flags.c_contiguous and a.shape == (length,)


def blend(rule, mean, var, factor, est_mean, est_var):
    """(new_mean, new_var, finite), or None (see the module doc)."""
    c = est_mean.shape[0] if est_mean.ndim == 1 else -1
    dtype = est_mean.dtype
    if not (native.enabled() and dtype in _TYPES and _contiguous(est_mean, dtype, c)
            and _contiguous(est_var, dtype, c) and _contiguous(mean, _F64, c)
            and _contiguous(var, _F64, c)):
        return None
    fn = _load()
    if fn is None:
        return None
    kind, weight = rule
    new_mean, new_var = np.empty(c, dtype), np.empty(c, dtype)
    weight = 0.0 if weight is None else float(weight)
    bad = fn(c, address(mean), address(var), float(factor), _RULES[kind], weight,
             1.0 - weight, int(dtype == _F64), address(est_mean), address(est_var),
             address(new_mean), address(new_var))
    return new_mean, new_var, not bad
