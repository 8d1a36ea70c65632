"""The communicator interface every backend implements, and the one-process backend.

A communicator works on the arrays of its place: numpy arrays on a CPU
place, GPUArrays (anything with `__cuda_array_interface__`) on a GPU place.

    comm.rank, comm.size, comm.local_rank, comm.place, comm.timeout_s
    comm.allreduce(x)          -> sum over ranks (a new array; x is unchanged)
    comm.allreduce_stats(v)    -> per-rank (n, mean_c, M2_c) merged over ranks (Chan)
    comm.allgather(x)          -> array of shape (size, *x.shape), rank order
    comm.allgather_text(s)     -> every rank's string, rank order
    comm.broadcast(x, root=0)  -> root's x on every rank (same shape everywhere)
    comm.barrier()

Every collective takes `what=`, a short description of the caller (e.g.
"sync_batch_norm forward bn1.y"), and gets the next call index (#0, #1, ...
on every rank alike). Both label the call in statistics, in the order check
and in the errors of a collective that does not complete (`Progress`).

The order check (on by default, `check_order`): the ranks exchange a hash of
(call index, kind, what, shape, dtype) of their collectives and raise
CollectiveMismatchError on every rank when they differ, naming each rank's
call, instead of letting mismatched collectives hang or mix unrelated buffers.
A step of the Executor announces the collectives its ops will make
(`begin_step`, from OpSchema.collectives): its first collective then checks them
all in ONE exchange, before any data moves, and the rest are only compared with
the announcement on this rank. A collective nobody announced (a checkpoint's
broadcast, the exit check, a step whose ops cannot say) is checked on its own,
with an exchange of its own.
Backends with more than one rank put a deadline on every collective
(`timeout_s`): see minigraph/distributed/deadline.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np


class CollectiveError(RuntimeError):
    """A collective could not complete alike on every rank; the communicator is unusable."""


class CollectiveMismatchError(CollectiveError):
    """Ranks reached different collectives: they do not run the same ops in the same order."""


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the deadline, or another rank gave up on one."""


@dataclass
class Progress:
    """Where this rank is in the job's sequence of collectives (one object shared
    by a NCCL communicator and the MPI communicator it bootstraps from).

    calls: the number of collectives entered (the next one's index).
    current: (index, label, monotonic time entered) of the collective in progress.
    last: (index, label, monotonic time completed) of the last one completed.
    broken: the error that broke the communicator; every later collective raises it.
    """

    calls: int = 0
    current: tuple | None = None
    last: tuple | None = None
    broken: CollectiveError | None = None


class Communicator:
    """Base class: rank bookkeeping, call statistics and the order check.

    Backends implement _allreduce, _allgather, _broadcast, _barrier (on the
    place's arrays; _allgather also on small numpy arrays, which the order
    check and allgather_text use) and abort.
    """

    backend = "base"

    def __init__(self, rank, size, local_rank, place, check_order=True, timeout_s=math.inf):
        self.rank = int(rank)
        self.size = int(size)
        self.local_rank = int(local_rank)
        self.place = place
        self.check_order = bool(check_order)
        self.timeout_s = float(timeout_s)
        self.progress = Progress()
        self.stats = {}          # kind -> [number of calls, bytes sent by this rank]
        self.trace = None        # a list to append (kind, what, nbytes) to, when set
        self.order_checks = 0    # exchanges the order check made
        self._script = None      # the step's announced calls (texts without "#index")
        self._script_at = 0      # how many of them were made
        self._script_checked = False

    @property
    def calls(self):
        """The number of collectives entered so far."""
        return self.progress.calls

    # ---- the interface ---------------------------------------------------------

    def allreduce(self, x, what=""):
        """The elementwise sum of `x` over all ranks, a new array on x's place."""
        with self._collective("allreduce", what, x):
            return self._allreduce(x)

    def allreduce_stats(self, x, what=""):
        """Batch statistics of the union of every rank's values, a new array on
        x's place. `x` is this rank's float64 vector of 2C+1 numbers (n,
        mean_c..., M2_c...): the count of values per channel (the same for
        every channel), their means and their sums of squared deviations. The
        ranks' vectors are merged with Chan's pairwise formula, never through
        sums of squares, so offset data (|mean| >> std) keeps its variance; one
        collective, O(C) bytes on MPI, the same bits on every rank."""
        with self._collective("allreduce_stats", what, x):
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
        with self._collective("allgather", what, x):
            return self._allgather(x)

    def allgather_text(self, text, what=""):
        """Every rank's string, in rank order (strings of any lengths: one
        allgather of the lengths, one of the UTF-8 bytes padded to the longest)."""
        with self._collective("allgather_text", what, None):
            return self._gather_text(text)

    def broadcast(self, x, root=0, what=""):
        """Rank `root`'s `x`, on every rank (a new array). Every rank passes an
        array of the same shape and dtype; only root's values are used."""
        with self._collective(f"broadcast(root={root})", what, x):
            return self._broadcast(x, root)

    def barrier(self, what=""):
        """Return once every rank has reached the barrier."""
        with self._collective("barrier", what, None):
            self._barrier()

    def exit_check(self):
        """The collective every rank makes when its script ends (world.init registers
        it at exit while the order check is on): a rank that ends while others
        still wait in a collective gets CollectiveMismatchError on every rank."""
        with self._collective("exit", "the script ended", None):
            pass

    def abort(self, code=1):
        """End every rank of the job with exit status `code` (never returns)."""
        raise NotImplementedError

    def begin_step(self, calls):
        """Announce the collectives the coming step makes, in order: a list of
        (kind, what, shape, dtype), or None when a step cannot say. With the order
        check on and more than one rank, the first announced call checks the whole
        list on every rank in one exchange; later ones are compared with it here
        only. end_step() forgets what is left."""
        self._script = None
        if not calls or not self.check_order or self.size <= 1:
            return
        self._script = [call_text(*call) for call in calls]
        self._script_at, self._script_checked = 0, False

    def end_step(self):
        """The step is over: later collectives are checked on their own again."""
        self._script = None

    def reset_stats(self):
        """Forget the call statistics (not the call index the order check uses)."""
        self.stats = {}

    # ---- bookkeeping -----------------------------------------------------------

    @contextlib.contextmanager
    def _collective(self, kind, what, x):
        """Count the call, label it (Progress) and run the order check; the body
        makes the backend's collective."""
        progress = self.progress
        if progress.broken is not None:
            raise type(progress.broken)(str(progress.broken))
        nbytes = 0 if x is None else int(x.nbytes)
        entry = self.stats.setdefault(kind.split("(")[0], [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        if self.trace is not None:
            self.trace.append((kind, what, nbytes))
        index = progress.calls
        progress.calls += 1
        label = what or kind
        progress.current = (index, label, time.monotonic())
        if self.check_order and self.size > 1:
            self._check_order(index, call_text(kind, what, None if x is None else x.shape,
                                               None if x is None else x.dtype))
        yield
        progress.last = (index, label, time.monotonic())
        progress.current = None

    def _check_order(self, index, call):
        """The order check of collective #index (see the module doc)."""
        script = self._script
        if script is not None and self._script_at < len(script) and \
                script[self._script_at] == call:
            if not self._script_checked:        # the step's first: all of them, at once
                self.verify_same_calls([f"#{index + i} {c}" for i, c in
                                        enumerate(script[self._script_at:])])
                self._script_checked = True
            self._script_at += 1
            return
        self._script = None      # not what the step announced: each is checked on its own
        self.verify_same_call(f"#{index} {call}")

    def verify_same_call(self, description):
        """Raise CollectiveMismatchError on every rank unless all ranks pass the
        same `description` (compared by hash; the texts go into the message)."""
        self.verify_same_calls([description])

    def verify_same_calls(self, descriptions):
        """Raise CollectiveMismatchError on every rank unless all ranks pass the same
        list of call descriptions (one exchange of a hash; the lists travel only when
        they differ, and the message names each rank's first differing call)."""
        text = "\n".join(descriptions)
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        self.order_checks += 1
        if self._exchange_digest(digest) == digest * self.size:
            return
        lists = [t.split("\n") for t in self._gather_text(text)]
        first = next((k for k in range(max(map(len, lists)))
                      if len({tuple(x[k:k + 1]) for x in lists}) > 1), 0)
        error = CollectiveMismatchError(mismatch_message(
            [x[first] if first < len(x) else "(no such collective in its step)" for x in lists]))
        self.progress.broken = error
        raise error

    def _exchange_digest(self, digest):
        """Every rank's 8 bytes, concatenated in rank order (the order check's exchange)."""
        return self._allgather(np.frombuffer(digest, dtype=np.uint8).copy()).tobytes()

    def _gather_text(self, text):
        data = np.frombuffer(text.encode(), dtype=np.uint8)
        lengths = self._allgather(np.array([data.size], dtype=np.int64))[:, 0]
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[:data.size] = data
        rows = self._allgather(padded)
        return [bytes(row[:n]).decode("utf-8", "replace")
                for row, n in zip(rows, lengths, strict=True)]

    def __repr__(self):
        return (f"<{type(self).__name__} rank {self.rank} of {self.size} "
                f"(local rank {self.local_rank}) on {self.place!r}>")


_dtype_names = {}


def call_text(kind, what, shape=None, dtype=None):
    """How the order check describes a collective: "kind 'what' shape=(..) dtype=..",
    without shape and dtype for a call with no array."""
    if shape is None:
        return f"{kind} '{what}'"
    return f"{kind} '{what}' shape={tuple(int(d) for d in shape)} dtype={_dtype_name(dtype)}"


def _dtype_name(dtype):
    """str(np.dtype(dtype)), memoised (it is made before every collective)."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(np.dtype(dtype))
    return name


def mismatch_message(texts):
    """The order check's error: each rank's call (texts in rank order), and why
    ranks make different calls."""
    lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
    calls = {t.split(" shape=")[0] for t in texts}
    if len(calls) == 1:
        hint = ("The ranks make the same call with different sizes or dtypes: their nets "
                "differ (a channel count, an image size, a dtype). Every rank must build "
                "the same net.")
    else:
        hint = ("Every rank must run the same ops in the same order: build the same net on "
                "every rank and make the same train/infer calls (a rank that skipped a step "
                "or ended early is out of step).")
    return ("minigraph.distributed: ranks reached different collectives (the order check; "
            "MINIGRAPH_CHECK_ORDER=0 turns it off):\n" + lines + "\n" + hint)


class LocalComm(Communicator):
    """The world of one process: every collective is a copy. Used when no MPI
    library is installed and the process was not started by a launcher."""

    backend = "local"

    def __init__(self, place, check_order=False, timeout_s=math.inf):
        super().__init__(0, 1, 0, place, check_order, timeout_s)

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
