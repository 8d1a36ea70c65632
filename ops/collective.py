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

The kernels (kernels/cpu/collective.py, kernels/cuda/collective.py) get the
communicator from their KernelContext (`ctx.comm`), made on first use.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import collective as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import collective as cuda
from minigraph.schema import Meta, OpError, OpSchema, Slot, kernel, register
from minigraph.validators import check_float

NOT_EXPORTED = "a collective of data-parallel training (an inference graph has none)"


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


def _avg_collectives(op, comm):
    """c_allreduce_avg's collectives: one allreduce per dtype of x (first-seen order)
    of all its values, packed; None while a shape is not known."""
    if comm.size == 1:
        return []
    sizes = {}
    for v in op.inputs["x"]:
        if v.shape is None or v.dtype is None or any(d < 0 for d in v.shape):
            return None
        sizes[np.dtype(v.dtype)] = sizes.get(np.dtype(v.dtype), 0) + math.prod(v.shape)
    return [("allreduce", cpu.label(op), (n,), dtype) for dtype, n in sizes.items()]


def _share_collectives(op, comm):
    """c_scale_by_batch_share's collective: one float64 allreduce of the batch size."""
    return [] if comm.size == 1 else [("allreduce", cpu.share_label(op), (1,), np.float64)]


register(OpSchema(
    type="c_allreduce_avg",
    inputs=(Slot("x", duplicable=True),),
    outputs=(Slot("out", duplicable=True),),
    infer=_infer_pairs("c_allreduce_avg"),
    validate=_validate_pairs,
    no_export=NOT_EXPORTED,
    collectives=_avg_collectives,
    doc=__doc__,
))

register(OpSchema(
    type="c_avg_presummed",
    inputs=(Slot("x", duplicable=True),),
    outputs=(Slot("out", duplicable=True),),
    infer=_infer_pairs("c_avg_presummed"),
    validate=_validate_pairs,
    replication="always",
    no_export=NOT_EXPORTED,
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
    no_export=NOT_EXPORTED,
    collectives=_share_collectives,
    doc=__doc__,
))


kernel("c_allreduce_avg", "cpu", cpu.allreduce_avg_cpu)
kernel("c_avg_presummed", "cpu", cpu.avg_presummed_cpu)
kernel("c_scale_by_batch_share", "cpu", cpu.scale_by_batch_share_cpu)
kernel("c_allreduce_avg", "gpu", cuda.allreduce_avg_gpu, dtypes=GPU_FLOATS)
kernel("c_avg_presummed", "gpu", cuda.avg_presummed_gpu, dtypes=GPU_FLOATS)
kernel("c_scale_by_batch_share", "gpu", cuda.scale_by_batch_share_gpu, dtypes=GPU_FLOATS)
