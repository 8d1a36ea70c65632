"""Deadlines on MPI collectives, and finding out which rank is missing.

An MPIComm posts every collective nonblocking and waits for it with
`Waiter.wait`: a short spin (yielding the core), then sleeps of a tenth of
the time waited so far, up to MAX_PAUSE_S, so a waiting rank uses almost no
CPU and a late peer adds little latency. The wait gives up when

  * the collective has not completed `timeout_s` seconds after this rank
    entered it (the deadline: init(timeout=...) or the environment variable
    MINIGRAPH_COLLECTIVE_TIMEOUT, in seconds; 60 by default, "inf" for none);
  * another rank gave up (its status record arrived, see below);
  * the launcher reported a failed process (mpich's hydra sends SIGUSR1 to
    the other processes when one dies, if started with -disable-auto-cleanup;
    by default hydra ends the whole job itself at once); or
  * MPI reported an error for the collective.

Giving up: the rank sends its status record - the collective it waits in
(index, label, seconds waited) and the last one it completed - to every other
rank, over a duplicate of the communicator used for nothing else, and
collects theirs for a short grace period. Every rank that waits in a
collective answers within milliseconds (each poll looks for records, and a
record makes that rank give up too); a rank that does not answer has exited,
was killed, stalls, or computes outside any collective. The records become
one message naming the ranks that did not arrive and where each rank is,
raised as CollectiveTimeoutError on every rank still alive. The communicator
is then broken (every later collective raises the same error) and an
uncaught error ends the job (world.init's excepthook calls MPI_Abort).

Records travel as JSON (nothing is pickled).
Starting and leaving (init's own deadline, the settings handshake, os._exit):
minigraph/distributed/startup.py.
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import numpy as np

from minigraph.distributed.comm import CollectiveTimeoutError

TIMEOUT_ENV = "MINIGRAPH_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
SPIN_S = 1e-3             # poll (yielding the core) this long first: most collectives end here
PAUSE_SHARE = 0.1         # then sleep a tenth of the time waited so far between polls...
MAX_PAUSE_S = 2e-3        # ...but never longer than this
LAUNCHER_GRACE_S = 0.05
STATUS_TAG = 17
TIMEOUT, PEER, LAUNCHER = "timeout", "peer", "launcher"

_launcher_reported = threading.Event()


def resolve_timeout(timeout=None):
    """The deadline in seconds: `timeout` when given, else MINIGRAPH_COLLECTIVE_TIMEOUT,
    else 60. A positive number; math.inf (or "inf") waits forever."""
    where = "init(timeout=...)"
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        where = TIMEOUT_ENV
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{where} must be a number of seconds > 0 or 'inf', "
                             f"got {text!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"{where} must be a number of seconds > 0 or math.inf, "
                         f"got {timeout!r}")
    return float(timeout)


def grace_s(timeout_s, why):
    """How long a rank that gave up collects the others' records: short when the
    launcher reported a dead process (it may end the job at any moment)."""
    return LAUNCHER_GRACE_S if why == LAUNCHER else min(2.0, max(0.5, timeout_s / 10))


def watch_launcher():
    """Treat SIGUSR1 from mpich's hydra launcher (a process of the job died) as a
    reason to give up at once. Installed only under hydra, from the main thread,
    and only where SIGUSR1 still has its default action (which kills silently)."""
    if "HYDI_CONTROL_FD" not in os.environ or threading.current_thread() is not \
            threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, lambda signum, frame: _launcher_reported.set())


class Waiter:
    """Waits for the nonblocking collectives of one MPIComm (see the module doc)."""

    def __init__(self, comm):
        self.comm = comm
        self.MPI = comm.MPI
        self.ctl = comm.mpi_comm.Dup()      # the side channel for status records
        self.records = {}                   # rank -> the record it sent
        self.kept = []                      # abandoned requests and sends, with buffers

    def wait(self, request):
        """Return once `request` (the MPI part of the collective in progress) has
        completed; raise CollectiveTimeoutError instead of waiting past the deadline."""
        try:
            why = self._poll(request)
        except self.MPI.Exception as e:
            why = f"MPI reported: {e.Get_error_string()}"
        if why:
            self.kept.append(request)
            self.give_up(why)

    def _poll(self, request):
        """None once `request` has completed, else why the wait stops. For the first
        SPIN_S it polls, yielding the core between polls (ranks may outnumber
        cores); then it sleeps between polls, each pause a tenth of the time
        waited so far (at most MAX_PAUSE_S): a late peer costs at most ~10% more
        wait, and a long wait almost no CPU."""
        if request.Test():
            return None
        start = time.monotonic()
        current = self.comm.progress.current
        limit = (current[2] if current else start) + self.comm.timeout_s
        while not request.Test():
            waited = time.monotonic() - start
            if waited < SPIN_S:
                os.sched_yield()
                continue
            why = self._reason(start + waited, limit)
            if why:
                return why
            time.sleep(min(MAX_PAUSE_S, PAUSE_SHARE * waited))
        return None

    def _reason(self, now, limit):
        if self.ctl.Iprobe(source=self.MPI.ANY_SOURCE, tag=STATUS_TAG):
            return PEER
        if _launcher_reported.is_set():
            return LAUNCHER
        return TIMEOUT if now >= limit else None

    def give_up(self, why):
        """Send this rank's record to every other rank, collect theirs for a grace
        period, break the communicator and raise the message (CollectiveTimeoutError)."""
        progress = self.comm.progress
        if progress.broken is not None:
            raise type(progress.broken)(str(progress.broken))
        mine = self.record(why)
        data = np.frombuffer(json.dumps(mine).encode(), dtype=np.uint8)
        for r in range(self.comm.size):
            if r != self.comm.rank:
                try:
                    self.kept.append((self.ctl.Isend([data, self.MPI.BYTE], dest=r,
                                                     tag=STATUS_TAG), data))
                except self.MPI.Exception:
                    pass                     # that rank is gone: it will not answer
        end = time.monotonic() + grace_s(self.comm.timeout_s, why)
        try:
            while len(self.records) < self.comm.size - 1 and time.monotonic() < end:
                if not self._receive():
                    time.sleep(1e-3)
        except self.MPI.Exception:
            pass                             # report what has arrived
        error = CollectiveTimeoutError(describe(self.comm.rank, self.comm.size, mine,
                                                self.records, self.comm.timeout_s))
        progress.broken = error
        raise error

    def record(self, why):
        """This rank's status record (JSON-able; times relative, clocks differ)."""
        now = time.monotonic()
        current, last = self.comm.progress.current, self.comm.progress.last
        return {"rank": self.comm.rank, "why": why,
                "at": None if current is None else [current[0], current[1], now - current[2]],
                "last": None if last is None else [last[0], last[1], now - last[2]]}

    def _receive(self):
        """Take one waiting record off the side channel; False when there is none."""
        status = self.MPI.Status()
        if not self.ctl.Iprobe(source=self.MPI.ANY_SOURCE, tag=STATUS_TAG, status=status):
            return False
        source = status.Get_source()
        buf = np.empty(status.Get_count(self.MPI.BYTE), dtype=np.uint8)
        self.ctl.Recv([buf, self.MPI.BYTE], source=source, tag=STATUS_TAG)
        try:
            rec = json.loads(buf.tobytes().decode())
            rec = {"why": str(rec["why"]), "at": _position(rec.get("at")),
                   "last": _position(rec.get("last"))}
        except (ValueError, KeyError, TypeError, IndexError):
            rec = {"why": "an unreadable status record", "at": None, "last": None}
        self.records[source] = {**rec, "rank": source}
        return True


def _position(p):
    return None if p is None else [int(p[0]), str(p[1]), float(p[2])]


def describe(rank, size, mine, records, timeout_s):
    """The error of a collective that did not complete, as rank `rank` sees it:
    `mine` is its record, `records` {rank: record} the ones that answered."""
    at = mine["at"]
    here = "a collective" if at is None else f"collective #{at[0]} '{at[1]}'"
    missing = [r for r in range(size) if r != rank and r not in records]
    everyone = {rank: mine, **records}
    same = sorted(r for r, rec in everyone.items() if _where(rec) == _where(mine))
    parts = []
    timed_out = any(rec["why"] == TIMEOUT for rec in everyone.values())
    within = f" within {timeout_s:g} s" if timed_out else ""
    last = mine["last"]
    for r in missing:
        seen = (f"rank {r} last reached #{last[0]} '{last[1]}' {last[2]:.1f} s ago"
                if last else f"rank {r} completed no collective yet")
        parts.append(f"rank {r} did not reach {here}{within} ({seen}) and does not answer: "
                     "it exited, was killed, stalls, or computes outside any collective.")
    for r in sorted(set(everyone) - set(same)):
        rec = everyone[r]
        where = ("is in no collective" if rec["at"] is None else
                 f"waits in collective #{rec['at'][0]} '{rec['at'][1]}' instead")
        parts.append(f"rank {r} {where} (out of step).")
    waits = ", ".join(f"{everyone[r]['at'][2]:.1f} s" if everyone[r]["at"] else "-"
                      for r in same)
    parts.append(f"{_ranks(same)} {'waits' if len(same) == 1 else 'wait'} in {here} "
                 f"({waits}).")
    if any(rec["why"] == LAUNCHER for rec in everyone.values()):
        parts.append("The launcher reported that a process of the job died.")
    for r, rec in sorted(everyone.items()):
        if rec["why"].startswith("MPI reported"):
            parts.append(f"On rank {r}, {rec['why']}.")
    if not missing and len(same) == size:
        parts.append("Every rank reached it: the collective itself did not complete.")
    return (f"minigraph.distributed: rank {rank} of {size}: " + " ".join(parts) +
            " Every rank must make the same collectives in the same order; a rank that "
            "legitimately works longer between two collectives needs a longer deadline: "
            f"init(timeout=...) or {TIMEOUT_ENV} (seconds).")


def _where(rec):
    return None if rec["at"] is None else tuple(rec["at"][:2])


def _ranks(ranks):
    return f"Rank {ranks[0]}" if len(ranks) == 1 else "Ranks " + ", ".join(map(str, ranks))
