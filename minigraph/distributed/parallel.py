"""Data parallelism: the same net on every rank, each with its own slice of the batch.

`data_parallel(net)` makes K ranks train like one process on the K slices
together (with sync_batch_norm for the batch statistics):
  * every persistable is broadcast from rank 0 before the first step;
  * before the update ops, one `c_allreduce_avg` (per dtype) replaces each
    parameter gradient by its average over ranks. With the loss a mean over
    the local batch and equal per-rank batch sizes, that average is the
    gradient of the mean loss over the whole batch. For uneven sizes pass
    `batch_size_from`: the loss gradient is then scaled by size·B_r/ΣB
    first, which weights each rank by its share of the batch;
  * sync_batch_norm_grad's dscale and dbias are already the sums over every
    rank (the op is a batch norm of the whole batch): they are divided by the
    world size where they are made (`c_avg_presummed`, no communication),
    and a gradient made only of such parts needs no allreduce at all.
"""
from __future__ import annotations

import weakref
from pathlib import Path

from minigraph.distributed.world import get_comm
from minigraph.operator import Operator

_done = weakref.WeakSet()


def broadcast_persistables(net, root=0, comm=None):
    """Give every persistable of `net` rank `root`'s value (initialising first
    those that have none yet). Call it after loading a checkpoint on one rank."""
    comm = comm or get_comm()
    net.initialize()
    for var in net.persistables():
        var.set(comm.broadcast(var.value, root=root, what=f"broadcast {var.name}"))


def data_parallel(net, comm=None, batch_size_from=None):
    """Make `net` train data-parallel over `comm`'s ranks (see the module doc).

    Call after an optimizer's minimize() (and after convert_sync_batchnorm,
    or build with layers.batch_norm(..., sync=True)). batch_size_from: a data
    Variable (or its name) whose leading dimension is the local batch size;
    give it when ranks may hold different numbers of rows. Returns the net.
    """
    comm = comm or get_comm()
    if net.optimizer is None or net.loss is None:
        raise ValueError("data_parallel: call an optimizer's minimize(net, loss) first; the "
                         "gradient averaging goes between the backward and the update ops")
    if net in _done:
        raise ValueError("data_parallel: this net is already data-parallel")
    _done.add(net)
    broadcast_persistables(net, root=0, comm=comm)
    if batch_size_from is not None:
        _weight_loss_grad(net, batch_size_from)
    _divide_presummed(net)
    producers = _producers(net.backward_ops)
    partial = {}
    for op in net.update_ops:
        grad = op.inputs.get("grad")
        if grad is None or grad in _flat(partial.values()) or _replicated(grad, producers):
            continue
        partial.setdefault(grad.dtype, []).append(grad)
    for grads in partial.values():
        net.backward_ops.append(Operator("c_allreduce_avg", x=grads, out=grads))
    net.ops_changed()
    return net


def save(net, path, comm=None):
    """Write `net`'s checkpoint from rank 0 only (minigraph.io.save), then wait
    until it is complete: every rank returns the path once the file exists."""
    from minigraph.io import save as save_file

    comm = comm or get_comm()
    if comm.rank == 0:
        save_file(net, path)
    comm.barrier(what=f"save {Path(path).name}")
    return Path(path)


def is_writer(comm=None):
    """True on the one rank that writes files (rank 0)."""
    return (comm or get_comm()).rank == 0


# ---- helpers ------------------------------------------------------------------------

def _weight_loss_grad(net, batch_size_from):
    batch = batch_size_from
    if isinstance(batch, str):
        if batch not in net.data_vars:
            raise KeyError(f"data_parallel: {batch!r} is not a data variable of this net; data: "
                           f"{', '.join(net.data_vars)}")
        batch = net.data_vars[batch]
    dloss = net.grads.get(net.loss.name)
    for i, op in enumerate(net.backward_ops):
        if dloss is not None and dloss in op.output_vars():
            net.backward_ops.insert(i + 1, Operator("c_scale_by_batch_share", x=dloss,
                                                    batch=batch, out=dloss))
            return
    raise ValueError("data_parallel: could not find the op that seeds d(loss)")


def _divide_presummed(net):
    """After each sync_batch_norm_grad (statistics from the batch), divide its
    dscale/dbias, which are sums over ranks, by the world size."""
    ops = net.backward_ops
    i = 0
    while i < len(ops):
        op = ops[i]
        i += 1
        if op.type != "sync_batch_norm_grad" or op.attrs["use_global_est"]:
            continue
        grads = [op.outputs[s] for s in ("dscale", "dbias") if op.outputs.get(s) is not None]
        if grads:
            ops.insert(i, Operator("c_avg_presummed", x=grads, out=grads))
            i += 1


def _producers(ops):
    """id(var) -> the last op writing it."""
    last = {}
    for op in ops:
        for v in op.output_vars():
            last[id(v)] = op
    return last


def _replicated(var, producers):
    """True when `var` is made only of c_avg_presummed outputs (and sums of them):
    the same value on every rank, already averaged."""
    op = producers.get(id(var))
    if op is None:
        return False
    if op.type == "c_avg_presummed":
        return True
    if op.type == "sum":
        return all(_replicated(v, producers) for v in op.input_vars())
    return False


def _flat(lists):
    for xs in lists:
        yield from xs
