"""sync_batch_norm: batch_norm over the union of every rank's batch.

Same slots, attributes and semantics as batch_norm (ops/batch_norm.py); in
training the statistics are those of the concatenation of all ranks'
batches (uneven per-rank sizes and ranks with zero rows included), so y
slices, gradients, running estimates and the counter equal a one-process
batch_norm on the whole batch, and the estimates stay identical on every
rank. "n == 1" is judged on the global count.

Communication (float64, O(C) bytes per rank whatever the number of ranks):
  forward:  ONE allreduce_stats of each rank's stable local (n, mean_c, M2_c),
            merged with Chan's formula (comm.chan_merge: a user-defined MPI op on
            MPI; an allgather and a rank-order merge on the device with NCCL), never
            through sums of squares: offset data (|mean|/std = 1e6) keeps its
            variance to ~1e-6 relative, and every rank gets the same bits.
  backward: ONE allreduce of (n, Σdy, Σdy·(x−μ)); dscale and dbias are then the
            whole batch's gradients, identical on every rank. With the grad op's
            `average_ranks` (set by data_parallel) they are divided by the world
            size in the same kernel (the data-parallel average of a presummed
            gradient), instead of by a c_avg_presummed op after it.
The infer copy and use_global_est make no collective. In a world of one
rank nothing is communicated.

Kernels: kernels/cpu/batch_norm.py and kernels/cuda/batch_norm_op.py, batch
norm's drivers with the statistics combined by the communicator of the kernel's
context. On a GPU the vectors are made and used on the device
(kernels/cuda/batch_norm_sync.py); the communicator combines them - NCCL on the
device, or MPI staged through the host. A rank reads the combined vector back (a
small synchronising copy) only when it holds at most one value per channel
itself, the one case where the global count can be too small for training.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import batch_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import batch_norm_op as cuda
from minigraph.ops.batch_norm import (
    batch_norm_examples,
    batch_statistics,
    bn_grad_schema,
    bn_schema,
)
from minigraph.schema import examples, kernel, register
from minigraph.validators import bool_attr

# the grad op's attribute that divides its presummed dscale and dbias by the world size
AVERAGE_RANKS = bool_attr("average_ranks", False)


def presummed_grads(op):
    """dscale and dbias are the whole batch's sums over every rank (identical on
    each) when the statistics came from the batch."""
    return () if op.attrs["use_global_est"] else ("dscale", "dbias")


def _channels(op):
    """The channel count of the op's x as declared (None when not known yet)."""
    shape = op.inputs["x"].shape
    if shape is None:
        return None
    c = shape[1] if op.attrs["data_layout"] == "NCHW" else shape[-1]
    return None if c < 0 else int(c)


def forward_collectives(op, comm):
    """The forward's collectives (OpSchema.collectives): one allreduce_stats of 2C+1
    float64 when it normalises with batch statistics over more than one rank."""
    if comm.size == 1 or not batch_statistics(op):
        return []
    c = _channels(op)
    return None if c is None else [("allreduce_stats", cpu.forward_label(op), (2 * c + 1,),
                                    np.float64)]


def backward_collectives(op, comm):
    """The grad op's collectives: one allreduce of 2C+1 float64 (batch statistics, more
    than one rank)."""
    if comm.size == 1 or op.attrs["use_global_est"]:
        return []
    c = _channels(op)
    return None if c is None else [("allreduce", cpu.backward_label(op), (2 * c + 1,),
                                    np.float64)]


register(bn_schema("sync_batch_norm", collectives=forward_collectives))
register(bn_grad_schema("sync_batch_norm", extra_attrs=(AVERAGE_RANKS,),
                        presummed=presummed_grads, presummed_average="average_ranks",
                        collectives=backward_collectives))
kernel("sync_batch_norm", "cpu", cpu.sync_batch_norm_cpu)
kernel("sync_batch_norm_grad", "cpu", cpu.sync_batch_norm_grad_cpu)
kernel("sync_batch_norm", "gpu", cuda.sync_batch_norm_gpu, dtypes=GPU_FLOATS)
kernel("sync_batch_norm_grad", "gpu", cuda.sync_batch_norm_grad_gpu, dtypes=GPU_FLOATS)
examples("sync_batch_norm", batch_norm_examples)        # a world of one: batch_norm's values
