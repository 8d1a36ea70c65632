"""The communicator interface every backend implements, and the one-process backend.

A communicator works on the arrays of its place: numpy arrays on a CPU
place, GPUArrays (anything with `__cuda_array_interface__`) on a GPU place.

    comm.rank, comm.size, comm.local_rank, comm.place
    comm.allreduce(x)          -> sum over ranks (a new array; x is unchanged)
    comm.allreduce_stats(v)    -> per-rank (n, mean_c, M2_c) merged over ranks (Chan)
    comm.allgather(x)          -> array of shape (size, *x.shape), rank order
    comm.broadcast(x, root=0)  -> root's x on every rank (same shape everywhere)
    comm.barrier()

Every collective takes `what=`, a short description of the caller (e.g.
"sync_batch_norm forward bn1.y"). It labels the call in statistics and in
the optional order check: with `check_order` on, each rank first gathers a
hash of (call index, kind, what, shape, dtype) from every rank and raises
CollectiveMismatchError on every rank when they differ, instead of letting
mismatched collectives hang or mix unrelated buffers.
"""
from __future__ import annotations

import hashlib
import os
import sys

import numpy as np


class CollectiveMismatchError(RuntimeError):
    """Ranks reached different collectives: they do not run the same ops in the same order."""


class Communicator:
    """Base class: rank bookkeeping, call statistics and the order check.

    Backends implement _allreduce, _allgather, _broadcast, _barrier (on the
    place's arrays), _gather_ints / _gather_objects (small host-side gathers
    used by the order check) and abort.
    """

    backend = "base"

    def __init__(self, rank, size, local_rank, place, check_order=False):
        self.rank = int(rank)
        self.size = int(size)
        self.local_rank = int(local_rank)
        self.place = place
        self.check_order = bool(check_order)
        self.calls = 0
        self.stats = {}          # kind -> [number of calls, bytes sent by this rank]
        self.trace = None        # a list to append (kind, what, nbytes) to, when set

    # ---- the interface ---------------------------------------------------------

    def allreduce(self, x, what=""):
        """The elementwise sum of `x` over all ranks, a new array on x's place."""
        self._enter("allreduce", what, x)
        return self._allreduce(x)

    def allreduce_stats(self, x, what=""):
        """Batch statistics of the union of every rank's values, a new array on
        x's place. `x` is this rank's float64 vector of 2C+1 numbers (n,
        mean_c..., M2_c...): the count of values per channel (the same for
        every channel), their means and their sums of squared deviations. The
        ranks' vectors are merged with Chan's pairwise formula, never through
        sums of squares, so offset data (|mean| >> std) keeps its variance; one
        collective, O(C) bytes on MPI, the same bits on every rank."""
        self._enter("allreduce_stats", what, x)
        return self._allreduce_stats(x)

    def _allreduce_stats(self, x):
        """Default: allgather, then merge in rank order on the host."""
        rows = self._allgather(x)
        host = rows if is_host_array(rows) else rows.get()
        merged = merge_rows(host)
        return merged if is_host_array(x) else self.place.to_device(merged)

    def allgather(self, x, what=""):
        """Every rank's `x` stacked in rank order: shape (size, *x.shape).
        Every rank must pass the same shape and dtype."""
        self._enter("allgather", what, x)
        return self._allgather(x)

    def broadcast(self, x, root=0, what=""):
        """Rank `root`'s `x`, on every rank (a new array). Every rank passes an
        array of the same shape and dtype; only root's values are used."""
        self._enter(f"broadcast(root={root})", what, x)
        return self._broadcast(x, root)

    def barrier(self, what=""):
        """Return once every rank has reached the barrier."""
        self._enter("barrier", what, None)
        self._barrier()

    def abort(self, code=1):
        """End every rank of the job with exit status `code` (never returns)."""
        raise NotImplementedError

    def reset_stats(self):
        """Forget the call statistics (not the call index the order check uses)."""
        self.stats = {}

    # ---- bookkeeping -----------------------------------------------------------

    def _enter(self, kind, what, x):
        nbytes = 0 if x is None else int(x.nbytes)
        entry = self.stats.setdefault(kind.split("(")[0], [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        if self.trace is not None:
            self.trace.append((kind, what, nbytes))
        index = self.calls
        self.calls += 1
        if self.check_order and self.size > 1:
            shape = None if x is None else tuple(x.shape)
            dtype = None if x is None else str(np.dtype(x.dtype))
            self.verify_same_call(f"#{index} {kind} [{what}] shape={shape} dtype={dtype}")

    def verify_same_call(self, description):
        """Raise CollectiveMismatchError on every rank unless all ranks pass the
        same `description` (compared by hash; the texts go into the message)."""
        digest = hashlib.blake2b(description.encode(), digest_size=8).digest()
        mine = np.frombuffer(digest, dtype=np.int64).copy()
        every = self._gather_ints(mine)
        if np.all(every == every[0]):
            return
        texts = self._gather_objects(description)
        lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
        raise CollectiveMismatchError(
            "minigraph.distributed: ranks reached different collectives (checked because "
            "MINIGRAPH_CHECK_ORDER=1):\n" + lines + "\nEvery rank must run the same ops in the "
            "same order: build the same net on every rank and make the same train/infer calls.")

    def _gather_ints(self, arr):
        raise NotImplementedError

    def _gather_objects(self, obj):
        raise NotImplementedError

    def __repr__(self):
        return (f"<{type(self).__name__} rank {self.rank} of {self.size} "
                f"(local rank {self.local_rank}) on {self.place!r}>")


class LocalComm(Communicator):
    """The world of one process: every collective is a copy. Used when no MPI
    library is installed and the process was not started by a launcher."""

    backend = "local"

    def __init__(self, place, check_order=False):
        super().__init__(0, 1, 0, place, check_order)

    def _allreduce(self, x):
        return x.copy()

    def _allgather(self, x):
        return x.reshape((1,) + tuple(x.shape)).copy()

    def _allreduce_stats(self, x):
        return x.copy()

    def _broadcast(self, x, root):
        if root != 0:
            raise ValueError(f"broadcast: root {root} does not exist in a world of one rank")
        return x.copy()

    def _barrier(self):
        pass

    def _gather_ints(self, arr):
        return arr.reshape(1, -1).copy()

    def _gather_objects(self, obj):
        return [obj]

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def is_host_array(x):
    """True for numpy arrays (host memory); False for device arrays."""
    return isinstance(x, np.ndarray)


def chan_merge(a, b):
    """The (n, mean_c..., M2_c...) vector of two disjoint sets of values from
    theirs (float64, 2C+1 each; see Communicator.allreduce_stats), by Chan's
    formula: mean = m1 + d * n2 / n, M2 = M1 + M2' + d^2 * n1 * n2 / n with
    d = m2 - m1. Per channel the operands are first put in a canonical order
    (by n, then mean, then M2), so chan_merge(a, b) and chan_merge(b, a) are
    the same bits: MPI may combine the ranks in any order on any rank."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    c = (a.shape[0] - 1) // 2
    na, nb = a[0], b[0]
    if na == 0 or nb == 0:
        return (b if na == 0 else a).copy() if na or nb else np.zeros_like(a)
    ma, mb, qa, qb = a[1:c + 1], b[1:c + 1], a[c + 1:], b[c + 1:]
    if na != nb:
        swap = np.full(c, nb < na)
    else:
        swap = (mb < ma) | ((mb == ma) & (qb < qa))
    n1 = np.where(swap, nb, na)
    n2 = np.where(swap, na, nb)
    m1, m2 = np.where(swap, mb, ma), np.where(swap, ma, mb)
    q1, q2 = np.where(swap, qb, qa), np.where(swap, qa, qb)
    n = na + nb
    d = m2 - m1
    out = np.empty_like(a)
    out[0] = n
    out[1:c + 1] = m1 + d * (n2 / n)
    out[c + 1:] = (q1 + q2) + d * d * (n1 * n2 / n)
    return out


def merge_rows(rows):
    """chan_merge over the rows of a (K, 2C+1) array, in rank order."""
    rows = np.asarray(rows, dtype=np.float64)
    total = rows[0].copy()
    for row in rows[1:]:
        total = chan_merge(total, row)
    return total
