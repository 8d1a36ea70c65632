"""Data parallelism: the same net on every rank, each with its own slice of the batch.

`data_parallel(net)` first checks that every rank built the same net (the
persistables' names, shapes and dtypes, and every op's type, attributes and
wiring: `check_same_net`), then broadcasts every persistable
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

from minigraph.distributed.merge import average_merged, mark_same
from minigraph.distributed.world import get_comm
from minigraph.passes import data_parallel as dp_pass

# attributes that may differ between ranks building the same net (a seed drawn per
# process, as mg.Net(seed=None) does, only changes which dropout masks a rank draws)
RANK_LOCAL_ATTRS = ("seed",)
OP_SECTIONS = ("trunk", "train", "infer", "backward", "update")    # not init: broadcast


class NetMismatchError(ValueError):
    """The ranks built different nets: a persistable's name, shape or dtype, or an
    op's type, attributes or wiring differs."""


def broadcast_persistables(net, root=0, comm=None):
    """Give every persistable of `net` rank `root`'s value (initialising first
    those that have none yet). Call it after loading a checkpoint on one rank.
    Raises NetMismatchError on every rank, before anything is sent, when the
    ranks' nets differ (check_same_net)."""
    _broadcast(net, root, comm or get_comm(), "broadcast_persistables")


def _broadcast(net, root, comm, who):
    net.initialize()
    check_same_net(net, comm, who)
    for var in net.persistables():
        var.set(comm.broadcast(var.value, root=root, what=f"broadcast {var.name}"))
    mark_same(net)


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


def check_same_net(net, comm, who="check_same_net"):
    """Raise NetMismatchError on every rank unless every rank's `net` has the same
    persistables (as check_same_persistables) and the same ops in every section but
    init: type, attributes (but RANK_LOCAL_ATTRS) and the names of the Variables each
    slot binds. One allgather of a hash; the descriptions travel only when the
    hashes differ, and the error names the first differing persistable or op."""
    if comm.size == 1:
        return
    persistables, ops = _persistables_text(net), _ops_text(net)
    digest = hashlib.blake2b(f"{persistables}\0{ops}".encode(), digest_size=8).digest()
    every = comm.allgather(np.frombuffer(digest, dtype=np.int64).copy(),
                           what=f"{who}: compare nets")
    if np.all(every == every[0]):
        return
    texts = comm.allgather_text(persistables, what=f"{who}: describe persistables")
    if len(set(texts)) > 1:
        raise NetMismatchError(first_difference(who, [t.split("\n") if t else []
                                                      for t in texts]))
    texts = comm.allgather_text(ops, what=f"{who}: describe ops")
    raise NetMismatchError(first_op_difference(who, [t.split("\n") if t else []
                                                     for t in texts]))


def _persistables_text(net):
    return "\n".join(f"{v.name}\t{tuple(v.value.shape)}\t{np.dtype(v.value.dtype)}"
                     for v in net.persistables())


def _ops_text(net):
    """One line per op of OP_SECTIONS: "section #i<TAB>type attrs slot=names -> slot=names"."""
    lines = []
    for section in OP_SECTIONS:
        for i, op in enumerate(net.section(section)):
            attrs = [f"{k}={v!r}" for k, v in sorted(op.attrs.items())
                     if k not in RANK_LOCAL_ATTRS]
            ins = [f"{slot}={_names(v)}" for slot, v in op.inputs.items() if v is not None]
            outs = [f"{slot}={_names(v)}" for slot, v in op.outputs.items() if v is not None]
            lines.append(f"{section} #{i}\t" + " ".join([op.type, *attrs, *ins, "->", *outs]))
    return "\n".join(lines)


def _names(bound):
    return ",".join(v.name for v in bound) if isinstance(bound, list) else bound.name


def first_op_difference(who, per_rank):
    """The error for ranks whose ops differ: per_rank[r] lists rank r's op lines
    ("section #i<TAB>description")."""
    tables = [dict(line.split("\t", 1) for line in lines) for lines in per_rank]
    places = list(dict.fromkeys(line.split("\t", 1)[0] for lines in per_rank for line in lines))
    for place in places:
        values = [t.get(place) for t in tables]
        if len(set(values)) > 1:
            section, index = place.split(" ")
            each = "; ".join(f"rank {r}: " + ("no such op" if v is None else v)
                             for r, v in enumerate(values))
            return (f"{who}: the ranks built different nets: op {index} of section "
                    f"{section!r} differs ({each}). Every rank must build the same net (the "
                    "same layers with the same arguments, in the same order).")
    return f"{who}: the ranks built different nets (their ops differ)."


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
    check_same_net). Returns the net.
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
    until it is complete: every rank returns the path once the file exists.
    Every rank must call it. A net minimised by GradientMerge and saved
    mid-accumulation first has its merged gradients averaged over the ranks, in
    place on every rank (minigraph.distributed.merge), so the file holds the
    whole job's state and a run resumed from it (loaded on rank 0, then
    broadcast_persistables) repeats the run that saved and went on, bit for bit."""
    from minigraph.io import save as save_file

    comm = comm or get_comm()
    average_merged(net, comm)
    if comm.rank == 0:
        save_file(net, path)
    comm.barrier(what=f"save {Path(path).name}")
    return Path(path)


def is_writer(comm=None):
    """True on the one rank that writes files (rank 0)."""
    return (comm or get_comm()).rank == 0
