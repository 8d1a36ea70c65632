"""Launchers for kernels/collective.cu: device arrays packed into one flat buffer
and back, times a factor - the bucketed allreduce of data-parallel gradients
(pack, one allreduce, unpack_scaled by 1 / world size) and scaled copies.

Up to PACK_ARITY arrays per launch; every buffer comes from the device's pool.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels import launch, loader

MODULE = "collective"
PACK_ARITY = 8                      # collective.cu's PACK_ARITY
_TABLE = "P" * PACK_ARITY + "q" * PACK_ARITY
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES[f"pack_{_t}"] = "Pqi" + _TABLE
    SIGNATURES[f"unpack_scaled_{_t}"] = "Pqid" + _TABLE


class _Bucket:
    """The launches over one list of array shapes of one dtype, PACK_ARITY arrays
    at a time: `size` values in all; per launch (first, end, byte offset in the
    flat buffer, total values, count, zero pointers padding the table, ends of
    the runs padded to PACK_ARITY) over the non-empty arrays keep[first:end]."""

    def __init__(self, dtype, shapes):
        sizes = [math.prod(s) for s in shapes]
        self.dtype, self.size = dtype, sum(sizes)
        self.keep = [i for i, n in enumerate(sizes) if n]
        self.chunks, self._gos = [], {}
        start = 0
        for lo in range(0, len(self.keep), PACK_ARITY):
            part = self.keep[lo:lo + PACK_ARITY]
            ends, total = [], 0
            for i in part:
                total += sizes[i]
                ends.append(total)
            pad = PACK_ARITY - len(part)
            self.chunks.append((lo, lo + len(part), start, total, len(part), (0,) * pad,
                                (*ends, *(total,) * pad)))
            start += total * dtype.itemsize

    def go(self, name, total):
        """The prepared launch of kernel `name` over `total` values."""
        found = self._gos.get((name, total))
        if found is None:
            k = loader.kernel(MODULE, name, SIGNATURES[name])
            dev = loader.device()
            threads = launch.block_threads(dev)
            found = self._gos[name, total] = k.prepared(
                (launch.flat_grid(total, dev, threads, k.resources), 1, 1), (threads, 1, 1))
        return found

    def run(self, what, stem, flat, arrays, *head):
        """Launch `stem`_<f32|f64> over `arrays` and the matching runs of `flat`."""
        start = loader.ptr(flat, f"{what}: flat")
        pointers = _pointers(what, arrays, self.dtype)
        keep, name = self.keep, f"{stem}_{loader.suffix(self.dtype)}"
        for lo, hi, offset, total, count, zeros, ends in self.chunks:
            chunk = [pointers[i] for i in keep[lo:hi]]
            self.go(name, total)(start + offset, total, count, *head, *chunk, *zeros, *ends)


def _pointers(what, arrays, dtype):
    """The device pointers of `arrays`, each checked to be `dtype` and C-contiguous
    (a ValueError naming `what` and the array's place)."""
    found = []
    for i, a in enumerate(arrays):
        if a.dtype != dtype:
            raise ValueError(f"{what}: array {i} is {np.dtype(a.dtype)}, expected {dtype}")
        if a.gpudata is None:
            found.append(0)
        elif a.flags.c_contiguous:
            found.append(int(a.gpudata))
        else:
            launch.check_contiguous(what, *arrays)
    return found


def _bucket(dtype, shapes):
    """The _Bucket of `shapes` (a tuple of shape tuples) and `dtype`, once per device."""
    plans = loader.cached("collective.buckets", dict)
    found = plans.get((dtype, shapes))
    if found is None:
        if len(plans) >= 1024:
            plans.clear()
        found = plans[dtype, shapes] = _Bucket(np.dtype(dtype), shapes)
    return found


def pack(arrays):
    """A new flat device array holding the values of `arrays` (one dtype,
    float32 or float64, any shapes) one after another, in order."""
    if not arrays:
        raise ValueError("pack: needs at least one array")
    dtype = arrays[0].dtype
    bucket = _bucket(dtype, tuple(a.shape for a in arrays))
    flat = loader.empty((bucket.size,), dtype)
    bucket.run("pack", "pack", flat, arrays)
    return flat


def unpack_scaled(flat, shapes, factor=1.0, outs=None):
    """Device arrays of `shapes` holding consecutive runs of `flat` (read as 1-D)
    times `factor` (computed in double, rounded to flat's dtype): the inverse of
    `pack`, scaled. New arrays, or written into `outs` (flat's dtype, those shapes)."""
    dtype = flat.dtype
    shapes = tuple(tuple(s) for s in shapes)
    if outs is None:
        outs = [loader.empty(s, dtype) for s in shapes]
    else:
        for i, (o, s) in enumerate(zip(outs, shapes, strict=True)):
            if o.shape != s or o.dtype != dtype:
                launch.check_array(f"unpack_scaled: outs[{i}]", o, s, dtype)
    bucket = _bucket(dtype, shapes)
    if flat.size != bucket.size:
        raise ValueError(f"unpack_scaled: flat holds {flat.size} values, the shapes need "
                         f"{bucket.size}")
    if bucket.size:
        bucket.run("unpack_scaled", "unpack_scaled", flat, outs, float(factor))
    return outs


def scaled(x, factor):
    """x * factor as a new device array of x's shape and dtype (one launch)."""
    (out,) = unpack_scaled(x, [tuple(x.shape)], factor)
    return out
