"""Starting and leaving a job of several ranks without hanging or a false success.

Starting (`startup`, around world.init's making of the communicator): MPI's
own start-up waits for every rank with no deadline, so a rank that raised,
exited or stalls before init() used to leave the others waiting forever. A
watchdog thread ends a rank still starting once the deadline (plus the grace
of a collective) has passed, with a message naming it and init, and exit
status 1 (the launcher then ends the rest). The settings are read without
raising; the new MPI communicator's first exchange (`handshake`, under the
deadline, without the order check) compares them across ranks, so a setting
only one rank rejects (MINIGRAPH_COLLECTIVE_TIMEOUT=abc) or one that differs
(MINIGRAPH_CHECK_ORDER) is a ValueError on every rank naming the rank and the
setting.

Leaving (`guard_exit`): once a job of several ranks runs, os._exit(0) on a
rank's own process ends it with status 1 and a message: it skips the exit
check and MPI's finalize, and mpiexec would otherwise end the other ranks at
once and report the job as a success.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field

from minigraph.distributed.deadline import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT,
    TIMEOUT_ENV,
    grace_s,
    resolve_timeout,
)

INIT_WAIT = "not every rank reached init within the deadline"
_RANK_ENV = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
             ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
_starting = []            # the Startup of the init in progress (its settings' problems)
_real_exit = []           # os._exit as it was before guard_exit


@dataclass
class Startup:
    """The settings init starts with: `timeout_s`, `check_order`, and the problems
    found reading them (texts), which `handshake` reports on every rank."""

    timeout_s: float
    check_order: bool
    problems: list = field(default_factory=list)


@contextlib.contextmanager
def startup(timeout, check_order, order_default):
    """Read init's settings (`timeout`, `check_order`; `order_default()` reads the
    environment's order check) without raising, and run the body (making the
    communicator) under the start-up watchdog (see the module doc). Yields the
    Startup. A problem no MPI handshake reported (a world of one) is raised as a
    ValueError when the body is done; in a launched job of several ranks the
    handshake raises it on every rank."""
    problems = []
    try:
        timeout_s = resolve_timeout(timeout)
    except ValueError as e:
        problems.append(str(e))
        timeout_s = DEFAULT_TIMEOUT_S
    if check_order is None:
        try:
            check_order = order_default()
        except ValueError as e:
            problems.append(str(e))
            check_order = True
    settings = Startup(timeout_s, bool(check_order), problems)
    rank, size = launcher_rank_size()
    if problems and size <= 1:
        raise ValueError("; ".join(problems))
    watcher = None
    if size > 1 and math.isfinite(timeout_s):
        watcher = _start_watcher(timeout_s + grace_s(timeout_s, TIMEOUT) + 1.0, timeout_s,
                                 rank, size)
    _starting.append(settings)
    try:
        yield settings
    finally:
        _starting.remove(settings)
        if watcher is not None:
            _stop_watcher(watcher)
    if settings.problems:               # no handshake took them (not an MPI world)
        raise ValueError("; ".join(settings.problems))


def launcher_rank_size():
    """(rank, size) as the launcher announced them in the environment; (0, 1) when
    no launcher did."""
    for rank_name, size_name in _RANK_ENV:
        rank, size = os.environ.get(rank_name, ""), os.environ.get(size_name, "")
        if rank.isdigit() and size.isdigit():
            return int(rank), int(size)
    return 0, 1


# The watcher is a process of its own: MPI's start-up holds the interpreter's lock
# while it waits (no Python thread of the rank runs meanwhile). It ends the rank
# unless its stdin closes (init got past the start-up, or the rank ended) in time.
_WATCHER = """
import os, select, sys
limit, pid, message = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if not select.select([0], [], [], limit)[0]:
    os.write(2, message.encode())
    os.kill(pid, 9)
"""


def _start_watcher(limit, timeout_s, rank, size):
    """The watcher process of this rank's start-up (see _WATCHER), or None when one
    cannot be started (then init waits as MPI does)."""
    message = (f"minigraph.distributed.init: rank {rank} of {size} waited {timeout_s:g} s in "
               f"init(): {INIT_WAIT} (a rank raised, exited or stalls before init(), or "
               "could not start). Ending this rank; the launcher ends the others. A rank "
               "that legitimately needs longer before init() needs a longer deadline: "
               f"init(timeout=...) or {TIMEOUT_ENV} (seconds).\n")
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHER, repr(limit),
                                 str(os.getpid()), message], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, close_fds=True)
    except OSError:
        return None


def _stop_watcher(watcher):
    try:
        watcher.stdin.close()
        watcher.wait(10)
    except (OSError, subprocess.SubprocessError):
        watcher.kill()


def handshake(comm):
    """The first exchange of a new MPI communicator: every rank's order-check
    setting and the problems its start-up found (the Startup in progress), compared
    without the order check and under the deadline. A ValueError on every rank,
    naming each problem's rank, unless all is well."""
    settings = _starting[-1] if _starting else None
    mine = {"check_order": comm.check_order,
            "problems": list(settings.problems) if settings is not None else []}
    if settings is not None:
        settings.problems.clear()          # reported here, on every rank
    if comm.size == 1:
        if mine["problems"]:
            raise ValueError("; ".join(mine["problems"]))
        return
    ranks = []
    for text in comm._gather_text(json.dumps(mine)):
        try:
            rec = json.loads(text)
            ranks.append((bool(rec["check_order"]), [str(p) for p in rec["problems"]]))
        except (ValueError, KeyError, TypeError):
            ranks.append((None, ["an unreadable start-up record"]))
    errors = [f"rank {r}: {p}" for r, (_, problems) in enumerate(ranks) for p in problems]
    if len({order for order, _ in ranks}) > 1:
        each = ", ".join(f"rank {r}: {'on' if order else 'off'}"
                         for r, (order, _) in enumerate(ranks))
        errors.append(f"MINIGRAPH_CHECK_ORDER differs between ranks ({each}); every rank "
                      "must use the same setting (or pass the same init(check_order=...))")
    if errors:
        raise ValueError(f"minigraph.distributed.init: rank {comm.rank} of {comm.size}: the "
                         f"ranks cannot start together: {'; '.join(errors)}. Every rank "
                         "stops here.")


def guard_exit(rank, size, live):
    """Make os._exit(0), called on this (the rank's) process while `live()` (the job's
    MPI is running), end the rank with status 1 and a message instead: it skips the
    exit check and MPI's finalize, so mpiexec would end the other ranks at once and
    report the job as a success. Forked children keep the plain os._exit. Installed
    once."""
    if _real_exit:
        return
    _real_exit.append(os._exit)
    pid = os.getpid()

    def _exit(code):
        if code == 0 and os.getpid() == pid:
            try:
                if live():
                    os.write(2, (f"minigraph.distributed: rank {rank} of {size} called "
                                 "os._exit(0) while the job runs: that skips the exit check "
                                 "and MPI's finalize, so the other ranks cannot tell it "
                                 "finished; ending with status 1 instead (return or call "
                                 "sys.exit to end a rank normally)\n").encode())
                    code = 1
            except BaseException:           # noqa: BLE001 - leaving regardless
                code = 1
        _real_exit[0](code)

    os._exit = _exit
