"""Threads per rank: each rank's share of its host's cores, unless set explicitly.

K ranks on one host that each run as many threads as the host has cores
oversubscribe it K times over: the CPU kernels' threads and numpy's BLAS
threads of every rank fight for the same cores. `init()` therefore gives each
rank `cores // local ranks` threads (at least 1), as launchers such as
torchrun default to, where

- cores: the CPUs this process may run on (its affinity mask), and
- local ranks: the ranks on this host, read from the launcher's environment
  (LOCAL_RANK_COUNT_ENV: MPICH/Hydra and Intel MPI, Open MPI, MVAPICH2,
  Cray PALS, torchrun and generic names; the first one set counts).

An explicit setting wins: `mg.set_num_threads(n)` (before or after init), or
the environment variable MINIGRAPH_NUM_THREADS=n, which init applies on every
rank. Without a launcher count (or with one rank on the host) init leaves
the threads alone.
"""
from __future__ import annotations

import os

from minigraph.kernels.cpu import blocks

THREADS_ENV = "MINIGRAPH_NUM_THREADS"
LOCAL_RANK_COUNT_ENV = (
    "MPI_LOCALNRANKS",               # MPICH's Hydra (and Intel MPI)
    "OMPI_COMM_WORLD_LOCAL_SIZE",    # Open MPI
    "MV2_COMM_WORLD_LOCAL_SIZE",     # MVAPICH2
    "PALS_LOCAL_SIZE",               # Cray PALS
    "LOCAL_WORLD_SIZE",              # torchrun
    "LOCAL_SIZE",                    # generic
)

_explicit = False


def set_num_threads(n):
    """Use `n` threads (an integer >= 1) in minigraph's CPU kernels and numpy's BLAS
    (minigraph.kernels.cpu.blocks.set_num_threads), and remember that the choice was
    explicit: init() then leaves it alone. A bad `n` is a ValueError and changes nothing."""
    global _explicit
    blocks.set_num_threads(n)
    _explicit = True


def is_explicit():
    """True once set_num_threads has been called in this process."""
    return _explicit


def host_cores():
    """The number of CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_rank_count(environ=None):
    """The number of ranks on this host according to the launcher's environment
    (LOCAL_RANK_COUNT_ENV, the first one set to an integer >= 1), or None."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_COUNT_ENV:
        text = environ.get(name, "").strip()
        if text.isdigit() and int(text) >= 1:
            return int(text)
    return None


def explicit_threads(environ=None):
    """MINIGRAPH_NUM_THREADS as an integer >= 1, or None when unset; any other value
    is a ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    text = environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{THREADS_ENV} must be an integer >= 1 (threads per rank), "
                         f"got {text!r}")
    return int(text)


def default_threads(environ=None, cores=None):
    """This rank's share of the host's cores: cores // local ranks, at least 1
    (all the cores when the launcher says nothing)."""
    cores = host_cores() if cores is None else cores
    ranks = local_rank_count(environ) or 1
    return max(1, cores // ranks)


def apply_rank_threads(environ=None):
    """Called by init(): set this rank's threads unless set_num_threads was called
    (MINIGRAPH_NUM_THREADS, else default_threads() when the launcher reports more
    than one rank on this host). Returns the threads it set, or None."""
    if _explicit:
        return None
    n = explicit_threads(environ)
    if n is None:
        if (local_rank_count(environ) or 1) <= 1:
            return None
        n = default_threads(environ)
    blocks.set_num_threads(n)
    return n
