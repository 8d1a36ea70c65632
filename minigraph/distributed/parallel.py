"""Data parallelism: the same net on every rank, each with its own slice of the batch.

`data_parallel(net)` first checks that every rank built the same net (the
persistables' names, shapes and dtypes), then broadcasts every persistable
from rank 0 and applies the data-parallel graph pass
(minigraph.passes.data_parallel: gradient averaging before the updates,
presummed sync-BN gradients divided by the world size). Checkpoints are
written by rank 0 (`save`).

A rank may hold no rows: its loss (a mean over nothing) is 0 and its
gradients are zeros. With `batch_size_from` each rank's gradient is weighted
by its share of the global batch, so such a step equals one process on the
other ranks' rows; without it every rank counts equally (right only when all
ranks hold the same number of rows).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from minigraph.distributed.world import get_comm
from minigraph.passes import data_parallel as dp_pass


class NetMismatchError(ValueError):
    """The ranks built different nets: a persistable's name, shape or dtype differs."""


def broadcast_persistables(net, root=0, comm=None):
    """Give every persistable of `net` rank `root`'s value (initialising first
    those that have none yet). Call it after loading a checkpoint on one rank.
    Raises NetMismatchError on every rank, before anything is sent, when the
    ranks' persistables differ (check_same_persistables)."""
    _broadcast(net, root, comm or get_comm(), "broadcast_persistables")


def _broadcast(net, root, comm, who):
    net.initialize()
    check_same_persistables(net, comm, who)
    for var in net.persistables():
        var.set(comm.broadcast(var.value, root=root, what=f"broadcast {var.name}"))


def check_same_persistables(net, comm, who="check_same_persistables"):
    """Raise NetMismatchError on every rank unless every rank's `net` has the same
    persistables (name, shape, dtype, in the same order). One allgather of a
    hash; the descriptions travel only when the hashes differ, and the error
    names the first differing variable and its shape on each rank."""
    if comm.size == 1:
        return
    text = "\n".join(f"{v.name}\t{tuple(v.value.shape)}\t{np.dtype(v.value.dtype)}"
                     for v in net.persistables())
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    every = comm.allgather(np.frombuffer(digest, dtype=np.int64).copy(),
                           what=f"{who}: compare persistables")
    if np.all(every == every[0]):
        return
    texts = comm.allgather_text(text, what=f"{who}: describe persistables")
    raise NetMismatchError(first_difference(who, [t.split("\n") if t else [] for t in texts]))


def first_difference(who, per_rank):
    """The error for ranks whose persistables differ: per_rank[r] lists rank r's
    "name\tshape\tdtype" lines in its net's order."""
    tables = [dict(line.split("\t", 1) for line in lines) for lines in per_rank]
    names = list(dict.fromkeys(line.split("\t", 1)[0] for lines in per_rank for line in lines))
    for name in names:
        values = [t.get(name) for t in tables]
        if len(set(values)) > 1:
            each = "; ".join(f"rank {r}: " + ("no such variable" if v is None else
                                              "shape {} {}".format(*v.split("\t")))
                             for r, v in enumerate(values))
            return (f"{who}: the ranks built different nets: persistable {name!r} differs "
                    f"({each}). Every rank must build the same net (the same layers, sizes "
                    "and dtypes).")
    orders = "; ".join(f"rank {r}: " + ", ".join(line.split("\t", 1)[0] for line in lines[:6])
                       for r, lines in enumerate(per_rank))
    return (f"{who}: the ranks built their nets' persistables in different orders ({orders}). "
            "Every rank must build the same net, layer by layer in the same order.")


def data_parallel(net, comm=None, batch_size_from=None):
    """Make `net` train data-parallel over `comm`'s ranks (see the module doc).

    Call after an optimizer's minimize() (and after convert_sync_batchnorm,
    or build with layers.batch_norm(..., sync=True)). batch_size_from: a data
    Variable (or its name) whose leading dimension is the local batch size;
    give it when ranks may hold different numbers of rows (zero included).
    Raises NetMismatchError on every rank when the ranks' nets differ (see
    check_same_persistables). Returns the net.
    """
    comm = comm or get_comm()
    if net.optimizer is None or net.loss is None:
        raise ValueError("data_parallel: call an optimizer's minimize(net, loss) first; the "
                         "gradient averaging goes between the backward and the update ops")
    if dp_pass.NAME in net.applied:
        raise ValueError("data_parallel: this net is already data-parallel")
    _broadcast(net, 0, comm, "data_parallel")
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
