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
            whole batch's gradients, identical on every rank.
The infer copy and use_global_est make no collective. In a world of one
rank nothing is communicated.

On a GPU the vectors are made and used on the device (kernels/batch_norm_sync.py:
local_stats, forward_train_from_sums, backward_sums, backward_from_sums); the
communicator combines them - NCCL on the device, or MPI staged through the host.
A rank reads the combined vector back (a small synchronising copy) only when it
holds at most one value per channel itself, the one case where the global
count can be too small for training.

The communicator comes from minigraph.distributed.world, imported inside
the kernels: this module imports only the schema and batch_norm's drivers
(ops/batch_norm.py) and GPU bindings (ops/batch_norm_gpu.py) at load time.
"""
from __future__ import annotations

import numpy as np

from minigraph.ops.batch_norm import backward_cpu, bn_grad_schema, bn_schema, forward_cpu
from minigraph.ops.batch_norm_gpu import backward_gpu, forward_gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import kernel, register


def forward_label(op):
    """The `what=` of the forward's allreduce_stats (the same on every rank): it
    names the op and its input in the order check and in deadline errors."""
    return f"{op.type} forward x={op.inputs['x'].name}"


def backward_label(op):
    """The `what=` of the backward's allreduce ("sync_batch_norm_grad x=...")."""
    return f"{op.type} x={op.inputs['x'].name}"


def pack_stats(n, mean, m2):
    """The forward's message: float64 (n, mean_c..., M2_c...), 2C+1 numbers (the GPU
    kernel bn_local_stats writes the same vector on the device). A rank with no
    values sends zeros."""
    c = mean.shape[0]
    buf = np.zeros(2 * c + 1)
    if n:
        buf[0] = n
        buf[1:c + 1] = mean
        buf[c + 1:] = m2
    return buf


def unpack_stats(total):
    """(n, mean, M2) of the whole batch from the merged pack_stats vector."""
    c = (total.shape[0] - 1) // 2
    return int(round(total[0])), total[1:c + 1].copy(), total[c + 1:].copy()


def stats_combiner(op, comm):
    """combine(n, mean, m2) -> the whole batch's (n, mean, m2), one allreduce_stats."""
    def combine(n, mean, m2):
        return unpack_stats(comm.allreduce_stats(pack_stats(n, mean, m2),
                                                 what=forward_label(op)))
    return combine


def grad_combiner(op, comm):
    """combine(n, s_dy, s_dyxmu) -> sums over every rank, with one allreduce."""
    def combine(n, s_dy, s_dyxmu):
        c = s_dy.shape[0]
        buf = np.concatenate(([float(n)], s_dy, s_dyxmu))
        total = comm.allreduce(buf, what=backward_label(op))
        return int(round(total[0])), total[1:c + 1], total[c + 1:]
    return combine


def sync_batch_norm_cpu(op, ins, ctx):
    """CPU forward: batch_norm's with the statistics combined over ranks."""
    training = not (op.attrs["is_infer"] or op.attrs["use_global_est"])
    comm = ctx.comm if training else None
    combine = stats_combiner(op, comm) if training and comm.size > 1 else None
    return forward_cpu(op, ins, combine=combine)


def sync_batch_norm_grad_cpu(op, ins, ctx):
    """CPU grad: batch_norm_grad with Σdy and Σdy·(x−μ) summed over ranks (dx into dy's
    array when it is handed over)."""
    comm = ctx.comm
    combine = grad_combiner(op, comm) if comm.size > 1 else None
    return backward_cpu(op, ins, combine=combine, donated=ctx.donated)


def device_allreduce(comm, what):
    """allreduce(v) -> v: the sum over ranks of a float64 device vector."""
    return lambda v: comm.allreduce(v, what=what)


def device_stats_merge(comm, what):
    """merge(v) -> v: the whole batch's (n, mean, M2) from every rank's float64
    device vector of kernels.batch_norm_sync.local_stats (comm.allreduce_stats)."""
    return lambda v: comm.allreduce_stats(v, what=what)


def sync_batch_norm_gpu(op, ins, ctx):
    """GPU forward: batch_norm's binding with ONE allreduce_stats of the 2C+1 local
    (n, mean, M2) (training with more than one rank); otherwise exactly batch_norm."""
    comm = ctx.comm
    return forward_gpu(op, ins, allreduce=device_stats_merge(comm, forward_label(op))
                          if comm.size > 1 else None)


def sync_batch_norm_grad_gpu(op, ins, ctx):
    """GPU grad: ONE allreduce of (n, Σdy, Σdy·(x−μ)) when the statistics came from
    the batch and there is more than one rank; then dx with the global n."""
    comm = ctx.comm
    return backward_gpu(op, ins, allreduce=device_allreduce(comm, backward_label(op))
                               if comm.size > 1 else None)


def presummed_grads(op):
    """dscale and dbias are the whole batch's sums over every rank (identical on
    each) when the statistics came from the batch."""
    return () if op.attrs["use_global_est"] else ("dscale", "dbias")


register(bn_schema("sync_batch_norm"))
register(bn_grad_schema("sync_batch_norm", presummed=presummed_grads))
kernel("sync_batch_norm", "cpu")(sync_batch_norm_cpu)
kernel("sync_batch_norm_grad", "cpu")(sync_batch_norm_grad_cpu)
kernel("sync_batch_norm", "gpu", dtypes=GPU_FLOATS)(sync_batch_norm_gpu)
kernel("sync_batch_norm_grad", "gpu", dtypes=GPU_FLOATS)(sync_batch_norm_grad_gpu)
