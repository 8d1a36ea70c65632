"""Launchers for kernels/collective.cu: device arrays packed into one flat buffer
and back, times a factor - the bucketed allreduce of data-parallel gradients
(pack, one allreduce, unpack_scaled by 1 / world size) and scaled copies.

Up to PACK_ARITY arrays per launch; every buffer comes from the device's pool.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import launch, loader

MODULE = "collective"
PACK_ARITY = 8                      # collective.cu's PACK_ARITY
_TABLE = "P" * PACK_ARITY + "q" * PACK_ARITY
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES[f"pack_{_t}"] = "Pqi" + _TABLE
    SIGNATURES[f"unpack_scaled_{_t}"] = "Pqid" + _TABLE


def _check_same_dtype(what, arrays, dtype):
    for i, a in enumerate(arrays):
        if np.dtype(a.dtype) != dtype:
            raise ValueError(f"{what}: array {i} is {np.dtype(a.dtype)}, expected {dtype}")


def _launches(what, flat, arrays, name, *head):
    """Launch `name` over `arrays` (and the matching runs of `flat`), PACK_ARITY at a time."""
    launch.check_contiguous(f"{what}: flat", flat)
    launch.check_contiguous(what, *arrays)
    itemsize = np.dtype(flat.dtype).itemsize
    parts = [a for a in arrays if a.size]
    start = loader.ptr(flat)
    configs = loader.cached("collective.grids", dict)
    for lo in range(0, len(parts), PACK_ARITY):
        chunk = parts[lo:lo + PACK_ARITY]
        pointers, ends, total = [], [], 0
        for a in chunk:
            pointers.append(loader.ptr(a))
            total += a.size
            ends.append(total)
        found = configs.get((name, total))
        if found is None:
            k = loader.kernel(MODULE, name, SIGNATURES[name])
            dev = loader.device()
            threads = launch.block_threads(dev)
            found = configs[(name, total)] = (
                k, (launch.flat_grid(total, dev, threads, k.resources), 1, 1), (threads, 1, 1))
        k, grid, block = found
        pad = PACK_ARITY - len(chunk)
        k.launch(grid, block, start, total, len(chunk), *head, *pointers, *[0] * pad, *ends,
                 *[total] * pad)
        start += total * itemsize


def pack(arrays):
    """A new flat device array holding the values of `arrays` (one dtype,
    float32 or float64, any shapes) one after another, in order."""
    if not arrays:
        raise ValueError("pack: needs at least one array")
    dtype = np.dtype(arrays[0].dtype)
    _check_same_dtype("pack", arrays, dtype)
    flat = loader.empty((sum(a.size for a in arrays),), dtype)
    _launches("pack", flat, arrays, f"pack_{loader.suffix(dtype)}")
    return flat


def unpack_scaled(flat, shapes, factor=1.0, outs=None):
    """Device arrays of `shapes` holding consecutive runs of `flat` (read as 1-D)
    times `factor` (computed in double, rounded to flat's dtype): the inverse of
    `pack`, scaled. New arrays, or written into `outs` (flat's dtype, those shapes)."""
    dtype = np.dtype(flat.dtype)
    if outs is None:
        outs = [loader.empty(tuple(s), dtype) for s in shapes]
    else:
        for i, (o, s) in enumerate(zip(outs, shapes, strict=True)):
            if tuple(o.shape) != tuple(s) or o.dtype != dtype:
                launch.check_array(f"unpack_scaled: outs[{i}]", o, tuple(s), dtype)
    need = sum(o.size for o in outs)
    if flat.size != need:
        raise ValueError(f"unpack_scaled: flat holds {flat.size} values, the shapes need {need}")
    if need:
        _launches("unpack_scaled", flat, outs, f"unpack_scaled_{loader.suffix(dtype)}",
                  float(factor))
    return outs


def scaled(x, factor):
    """x * factor as a new device array of x's shape and dtype (one launch)."""
    (out,) = unpack_scaled(x, [tuple(x.shape)], factor)
    return out
