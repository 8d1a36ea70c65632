"""Collective ops for data-parallel training (no gradients of their own).

c_allreduce_avg(x=[...], out=[...]):  out_i = (Σ over ranks of x_i) / world size.
    Every x_i is reduced in one allreduce per dtype (the arrays travel
    packed: on a GPU, packed into one pooled flat buffer on the device, reduced
    there and unpacked scaled, with no host wait). `out` may be the x
    Variables themselves (in place).
c_avg_presummed(x=[...], out=[...]):  out_i = x_i / world size, no communication:
    for values that are already the sum over ranks and identical on every
    rank (sync_batch_norm's dscale and dbias).
c_scale_by_batch_share(x, batch, out):  out = x * size * B_r / ΣB, B_r the
    leading dimension of `batch` on this rank (one scalar allreduce): scales
    the loss gradient so that averaging per-rank gradients weights each rank
    by its share of the global batch (exactly 1 when all B_r are equal).

The communicator comes from minigraph.distributed.world, imported inside the
kernels, so this module imports only the schema, ops/device.py and the GPU
launchers (which import nothing from pycuda) at load time.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import collective as gpu_collective
from minigraph.kernels import elementwise as gpu_elementwise
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpError, OpSchema, Slot, kernel, register
from minigraph.validators import check_float


def _infer_pairs(op_type):
    def infer(ins, attrs):
        for i, m in enumerate(ins["x"]):
            check_float(op_type, f"x[{i}]", m)
        return {"out": [Meta(m.shape, m.dtype) for m in ins["x"]]}
    return infer


def _validate_pairs(op):
    if len(op.inputs["x"]) != len(op.outputs["out"]):
        raise OpError(f"{op.type}: 'x' has {len(op.inputs['x'])} Variables but 'out' has "
                      f"{len(op.outputs['out'])}; they pair up one to one")


def _label(op):
    names = [v.name for v in op.inputs["x"]]
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    return f"{op.type} [{shown}]"


register(OpSchema(
    type="c_allreduce_avg",
    inputs=(Slot("x", duplicable=True),),
    outputs=(Slot("out", duplicable=True),),
    infer=_infer_pairs("c_allreduce_avg"),
    validate=_validate_pairs,
    doc=__doc__,
))

register(OpSchema(
    type="c_avg_presummed",
    inputs=(Slot("x", duplicable=True),),
    outputs=(Slot("out", duplicable=True),),
    infer=_infer_pairs("c_avg_presummed"),
    validate=_validate_pairs,
    replication="always",
    doc=__doc__,
))


def _infer_share(ins, attrs):
    check_float("c_scale_by_batch_share", "x", ins["x"])
    if len(ins["batch"].shape) == 0:
        raise OpError("c_scale_by_batch_share: input 'batch' must have a leading batch "
                      "dimension, got a scalar")
    return {"out": Meta(ins["x"].shape, ins["x"].dtype)}


register(OpSchema(
    type="c_scale_by_batch_share",
    inputs=(Slot("x"), Slot("batch")),
    outputs=(Slot("out"),),
    infer=_infer_share,
    doc=__doc__,
))


def scaled(x, factor):
    """x * factor as a new array of x's kind and dtype (0-d numpy arrays stay arrays;
    device arrays get one launch into a pooled array)."""
    if isinstance(x, np.ndarray):
        out = np.empty_like(x)
        np.multiply(x, factor, out=out, casting="same_kind")
        return out
    return gpu_collective.scaled(x, factor)


def copied(x):
    """A copy of x on its place (device arrays: a device copy into a pooled array)."""
    return x.copy() if isinstance(x, np.ndarray) else gpu_elementwise.copy(x)


def by_dtype(xs):
    """{dtype: [index, ...]} of the arrays, in first-seen order."""
    groups = {}
    for i, x in enumerate(xs):
        groups.setdefault(np.dtype(x.dtype), []).append(i)
    return groups


@kernel("c_allreduce_avg", "cpu")
def allreduce_avg_cpu(op, ins, ctx):
    """Pack the arrays of each dtype into one buffer, allreduce it once, unpack."""
    comm = ctx.comm
    xs = ins["x"]
    if comm.size == 1:
        return {"out": [x.copy() for x in xs]}
    outs = [None] * len(xs)
    for dtype, idx in by_dtype(xs).items():
        packed = np.concatenate([xs[i].reshape(-1) for i in idx])
        total = comm.allreduce(packed, what=_label(op))
        total /= comm.size
        start = 0
        for i in idx:
            size = xs[i].size
            outs[i] = total[start:start + size].reshape(xs[i].shape).astype(dtype, copy=False)
            start += size
    return {"out": outs}


@kernel("c_allreduce_avg", "gpu", dtypes=GPU_FLOATS)
def allreduce_avg_gpu(op, ins, ctx):
    """As the CPU kernel, on the device: per dtype, the arrays packed into one
    pooled flat buffer (a copy kernel), ONE allreduce of it, then unpacked
    scaled by 1 / size on the way (one kernel) - into the x arrays themselves
    when `out` is `x` (data_parallel's in-place average), else into new ones."""
    comm = ctx.comm
    xs = ins["x"]
    if comm.size == 1:
        return {"out": [copied(x) for x in xs]}
    in_place = all(o is i for o, i in zip(op.outputs["out"], op.inputs["x"], strict=True))
    outs = [None] * len(xs)
    label = _label(op)
    for idx in by_dtype(xs).values():
        group = [xs[i] for i in idx]
        done = gpu_collective.allreduce_scaled(
            group, lambda flat: comm.allreduce(flat, what=label), 1.0 / comm.size, in_place)
        for i, out in zip(idx, done, strict=True):
            outs[i] = out
    return {"out": outs}


def avg_presummed(op, ins, ctx):
    """x / size on the place (numpy arrays and GPUArrays alike)."""
    size = ctx.comm.size
    return {"out": [scaled(x, 1.0 / size) if size > 1 else copied(x) for x in ins["x"]]}


kernel("c_avg_presummed", "cpu")(avg_presummed)
kernel("c_avg_presummed", "gpu", dtypes=GPU_FLOATS)(avg_presummed)


def scale_by_batch_share(op, ins, ctx):
    """x * size * B_r / ΣB; the counts are reduced on the host (one scalar)."""
    comm = ctx.comm
    mine = ins["batch"].shape[0]
    if comm.size == 1:
        return {"out": copied(ins["x"])}
    what = f"{op.type} batch={op.inputs['batch'].name}"
    total = comm.allreduce(np.array([float(mine)]), what=what)
    if total[0] == 0:
        raise OpError(f"{op.type}: every rank's batch is empty")
    return {"out": scaled(ins["x"], comm.size * mine / total[0])}


kernel("c_scale_by_batch_share", "cpu")(scale_by_batch_share)
kernel("c_scale_by_batch_share", "gpu", dtypes=GPU_FLOATS)(scale_by_batch_share)
