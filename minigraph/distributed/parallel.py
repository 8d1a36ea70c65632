"""Data parallelism: the same net on every rank, each with its own slice of the batch.

`data_parallel(net)` broadcasts every persistable from rank 0 before the
first step and applies the data-parallel graph pass
(minigraph.passes.data_parallel: gradient averaging before the updates,
presummed sync-BN gradients divided by the world size). Checkpoints are
written by rank 0 (`save`).
"""
from __future__ import annotations

from pathlib import Path

from minigraph.distributed.world import get_comm
from minigraph.passes import data_parallel as dp_pass


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
    if dp_pass.NAME in net.applied:
        raise ValueError("data_parallel: this net is already data-parallel")
    broadcast_persistables(net, root=0, comm=comm)
    dp_pass.rewrite(net, batch_size_from)
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
