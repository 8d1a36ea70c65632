"""Launchers for kernels/cuda/collective.cu: device arrays packed into one flat buffer
and back, times a factor - the bucketed allreduce of data-parallel gradients
(pack, one allreduce, unpack_scaled by 1 / world size) and scaled copies.

Up to PACK_ARITY arrays per launch; every buffer comes from the device's pool.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu.collective import batch_share, by_dtype, label
from minigraph.kernels.cuda import elementwise, launch, loader

MODULE = "collective"
PACK_ARITY = 8                      # collective.cu's PACK_ARITY
_TABLE = "P" * PACK_ARITY + "q" * PACK_ARITY
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES[f"pack_{_t}"] = "Pqi" + _TABLE
    SIGNATURES[f"unpack_scaled_{_t}"] = "Pqid" + _TABLE


class Bucket:
    """The launches over one list of array shapes of one dtype, PACK_ARITY arrays
    at a time (made by `bucket`, once per device, dtype and shapes): `size`
    values in all; per launch (first, end, byte offset in the flat buffer, total
    values, count, zero pointers padding the table, ends of the runs padded to
    PACK_ARITY) over the non-empty arrays keep[first:end]."""

    def __init__(self, dtype, shapes):
        sizes = [math.prod(s) for s in shapes]
        self.dtype, self.shapes, self.size = dtype, shapes, sum(sizes)
        self.keep = [i for i, n in enumerate(sizes) if n]
        self.chunks, self._gos = [], {}
        self._names = {stem: f"{stem}_{loader.suffix(dtype)}" for stem in ("pack",
                                                                           "unpack_scaled")}
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

    def pack(self, arrays):
        """A new flat device array of `size` values: `arrays` (of this bucket's
        shapes and dtype) one after another."""
        self._check_shapes("pack", arrays)
        flat = loader.empty((self.size,), self.dtype)
        self._run("pack", flat, arrays)
        return flat

    def unpack_scaled(self, flat, factor=1.0, outs=None):
        """Arrays of this bucket's shapes holding consecutive runs of `flat` times
        `factor` (see the module function): new ones, or written into `outs`."""
        if outs is None:
            outs = [loader.empty(s, self.dtype) for s in self.shapes]
        else:
            self._check_shapes("unpack_scaled: outs", outs)
        if flat.size != self.size:
            raise ValueError(f"unpack_scaled: flat holds {flat.size} values, the shapes need "
                             f"{self.size}")
        if flat.dtype is not self.dtype and flat.dtype != self.dtype:
            raise ValueError(f"unpack_scaled: flat is {flat.dtype}, expected {self.dtype}")
        if self.size:
            self._run("unpack_scaled", flat, outs, float(factor))
        return outs

    def _check_shapes(self, what, arrays):
        if tuple(a.shape for a in arrays) != self.shapes:
            if len(arrays) != len(self.shapes):
                raise ValueError(f"{what}: {len(arrays)} arrays for {len(self.shapes)} shapes")
            for i, (a, s) in enumerate(zip(arrays, self.shapes, strict=True)):
                launch.check_array(f"{what}[{i}]", a, s, self.dtype)

    def _go(self, name, total):
        """The prepared launch of kernel `name` over `total` values."""
        found = self._gos.get((name, total))
        if found is None:
            k = loader.kernel(MODULE, name, SIGNATURES[name])
            dev = loader.device()
            threads = launch.block_threads(dev)
            found = self._gos[name, total] = k.prepared(
                (launch.flat_grid(total, dev, threads, k.resources), 1, 1), (threads, 1, 1))
        return found

    def _run(self, what, flat, arrays, *head):
        """Launch pack or unpack_scaled (`what`) over `arrays` and the matching runs
        of `flat`."""
        self._launch(what, loader.ptr(flat, f"{what}: flat"),
                     _pointers(what, arrays, self.dtype), *head)

    def _launch(self, what, start, pointers, *head):
        """_run with the device pointers of the flat buffer and of the arrays."""
        keep, name = self.keep, self._names[what]
        for lo, hi, offset, total, count, zeros, ends in self.chunks:
            chunk = [pointers[i] for i in keep[lo:hi]]
            self._go(name, total)(start + offset, total, count, *head, *chunk, *zeros, *ends)


def _pointers(what, arrays, dtype):
    """The device pointers of `arrays`, each checked to be `dtype` and C-contiguous
    (a ValueError naming `what` and the array's place)."""
    found = []
    for i, a in enumerate(arrays):
        if a.dtype is not dtype and a.dtype != dtype:
            raise ValueError(f"{what}: array {i} is {np.dtype(a.dtype)}, expected {dtype}")
        if a.gpudata is None:
            found.append(0)
        elif a.flags.c_contiguous:
            found.append(int(a.gpudata))
        else:
            launch.check_contiguous(what, *arrays)
    return found


def bucket(arrays, dtype=None):
    """The Bucket of the shapes of `arrays` (a non-empty list of device arrays, or
    a list of shapes with `dtype` given) and their dtype (arrays[0]'s unless given): made
    once per device, dtype and shapes. The arrays' dtypes are checked when the
    bucket packs or unpacks them."""
    if dtype is None:
        if not arrays:
            raise ValueError("pack: needs at least one array")
        dtype, shapes = arrays[0].dtype, tuple(a.shape for a in arrays)
    else:
        shapes = tuple(tuple(int(d) for d in s) for s in arrays)
    plans = loader.cached("collective.buckets", dict)
    found = plans.get((dtype, shapes))
    if found is None:
        if len(plans) >= 1024:
            plans.clear()
        found = plans[dtype, shapes] = Bucket(np.dtype(dtype), shapes)
    return found


def allreduce_scaled(arrays, allreduce, factor, in_place=False):
    """`arrays` (device arrays of one dtype) combined by `allreduce` and scaled:
    packed into one new flat buffer, `allreduce(flat)` (a device array of the
    same size and dtype: the communicator's sum over ranks), unpacked times
    `factor` - into the arrays themselves when `in_place`, else into new ones.
    Returns the results in order. pack, allreduce and unpack_scaled in one: the
    bucket is looked up and each array's pointer checked once."""
    plan = bucket(arrays)
    pointers = _pointers("pack", arrays, plan.dtype)
    flat = loader.empty((plan.size,), plan.dtype)
    plan._launch("pack", loader.address(flat), pointers)
    total = allreduce(flat)
    if total.size != plan.size or total.dtype != plan.dtype:
        raise ValueError(f"allreduce_scaled: the allreduce returned {total.dtype}"
                         f"{tuple(total.shape)} for {plan.dtype}({plan.size},)")
    if in_place:
        outs = arrays
    else:
        outs = [loader.empty(s, plan.dtype) for s in plan.shapes]
        pointers = [loader.address(o) for o in outs]
    if plan.size:
        plan._launch("unpack_scaled", loader.ptr(total, "unpack_scaled: flat"), pointers,
                     float(factor))
    return outs


def pack(arrays):
    """A new flat device array holding the values of `arrays` (one dtype,
    float32 or float64, any shapes) one after another, in order."""
    return bucket(arrays).pack(arrays)


def unpack_scaled(flat, shapes, factor=1.0, outs=None):
    """Device arrays of `shapes` holding consecutive runs of `flat` (read as 1-D)
    times `factor` (computed in double, rounded to flat's dtype): the inverse of
    `pack`, scaled. New arrays, or written into `outs` (flat's dtype, those shapes)."""
    return bucket(list(shapes), flat.dtype).unpack_scaled(flat, factor, outs)


def scaled(x, factor):
    """x * factor as a new device array of x's shape and dtype (one launch)."""
    (out,) = unpack_scaled(x, [tuple(x.shape)], factor)
    return out


# ---- op kernels -------------------------------------------------------------------

def allreduce_avg_gpu(op, ins, ctx):
    """As the CPU kernel, on the device: per dtype, the arrays packed into one
    pooled flat buffer (a copy kernel), ONE allreduce of it, then unpacked
    scaled by 1 / size on the way (one kernel) - into the x arrays themselves
    when `out` is `x` (data_parallel's in-place average), else into new ones."""
    comm = ctx.comm
    xs = ins["x"]
    if comm.size == 1:
        return {"out": [elementwise.copy(x) for x in xs]}
    in_place = all(o is i for o, i in zip(op.outputs["out"], op.inputs["x"], strict=True))
    outs = [None] * len(xs)
    what = label(op)
    for idx in by_dtype(xs).values():
        group = [xs[i] for i in idx]
        done = allreduce_scaled(group, lambda flat: comm.allreduce(flat, what=what),
                                1.0 / comm.size, in_place)
        for i, out in zip(idx, done, strict=True):
            outs[i] = out
    return {"out": outs}


def avg_presummed_gpu(op, ins, ctx):
    """out_i = x_i / size on the device (no communication)."""
    size = ctx.comm.size
    return {"out": [scaled(x, 1.0 / size) if size > 1 else elementwise.copy(x)
                    for x in ins["x"]]}


def scale_by_batch_share_gpu(op, ins, ctx):
    """out = x * size * B_r / sum of B on the device (the counts reduced on the host)."""
    comm = ctx.comm
    if comm.size == 1:
        return {"out": elementwise.copy(ins["x"])}
    return {"out": scaled(ins["x"], batch_share(op, ins, comm))}
