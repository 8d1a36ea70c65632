"""Launchers for kernels/cuda/fill.cu: fill_constant and the seeded random initialisers.

Plain functions on device arrays (PyCUDA GPUArrays): no graph needed.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu.fill import gaussian_random_cpu, uniform_random_cpu
from minigraph.kernels.cuda import loader

MODULE = "fill"
SIGNATURES = {"fill_u8": "PqI", "fill_u16": "PqI", "fill_u32": "PqI", "fill_u64": "PqQ",
              **{f"{kind}_{sfx}": "PqQdd" for kind in ("uniform", "gaussian")
                 for sfx in ("f32", "f64")}}
PER_CALL = {"f32": 4, "f64": 2}     # values per generator call (see fill.cu)


def _kernel(name):
    return loader.kernel(MODULE, name, SIGNATURES[name])


def _launch_flat(name, items, *args):
    loader.flat_go(MODULE, name, SIGNATURES[name], items)(*args)


_BITS = {}


def fill_constant(out, value):
    """Set every element of `out` (a contiguous device array of any 1, 2, 4 or
    8-byte dtype) to `value`, converted as numpy converts it (np.full). Returns out."""
    kind = type(value)
    key = (kind, value.hex() if kind is float else value, out.dtype)   # -0.0 is not 0.0
    try:
        name, bits = _BITS[key]
    except (KeyError, TypeError):
        dtype = np.dtype(out.dtype)
        if dtype.itemsize not in (1, 2, 4, 8):
            raise TypeError(f"fill_constant: unsupported dtype {dtype}") from None
        name = f"fill_u{8 * dtype.itemsize}"
        bits = int(np.array(value).astype(dtype).reshape(1).view(f"u{dtype.itemsize}")[0])
        if kind in (int, float, bool):              # a plain value: the same bits next time
            loader.cache_put(_BITS, key, (name, bits), 1024)
    if out.size:
        _launch_flat(name, out.size, loader.ptr(out, "fill_constant: out"), out.size, bits)
    return out


def full(shape, value, dtype):
    """A new device array of `shape` and `dtype` holding `value` everywhere."""
    return fill_constant(loader.empty(shape, dtype), value)


def _random(kind, out, a, b, seed):
    sfx = loader.suffix(out.dtype)
    if out.size:
        calls = -(-out.size // PER_CALL[sfx])
        _launch_flat(f"{kind}_{sfx}", calls, loader.ptr(out), out.size, int(seed) & (2**64 - 1),
                     float(a), float(b))
    return out


def uniform(out, low, high, seed):
    """Fill `out` (float32/64) with U[low, high) values from a counter-based
    generator (Philox4x32-10) keyed by `seed`: the same seed and size give the
    same values on every device and launch configuration (not numpy's stream).
    Returns out."""
    return _random("uniform", out, low, high, seed)


def gaussian(out, mean, std, seed):
    """Fill `out` (float32/64) with N(mean, std^2) values (Box-Muller over the
    same generator as `uniform`); deterministic in `seed`. Returns out."""
    return _random("gaussian", out, mean, std, seed)


def uniform_random(shape, dtype, low, high, seed):
    """A new device array of U[low, high) values (see `uniform`)."""
    return uniform(loader.empty(shape, dtype), low, high, seed)


def gaussian_random(shape, dtype, mean, std, seed):
    """A new device array of N(mean, std^2) values (see `gaussian`)."""
    return gaussian(loader.empty(shape, dtype), mean, std, seed)


# ---- op kernels -------------------------------------------------------------------

def fill_constant_gpu(op, ins, ctx):
    """out = a device array of `shape` and `dtype` holding `value`, filled on the device."""
    a = op.attrs
    return {"out": full(a["shape"], a["value"], a["dtype"])}


def uniform_random_gpu(op, ins, ctx):
    """The CPU kernel's values (same seed, same numbers), copied to the device once."""
    return {"out": loader.to_device(uniform_random_cpu(op, ins, ctx)["out"])}


def gaussian_random_gpu(op, ins, ctx):
    """The CPU kernel's values (same seed, same numbers), copied to the device once."""
    return {"out": loader.to_device(gaussian_random_cpu(op, ins, ctx)["out"])}
