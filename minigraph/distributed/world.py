"""The process's communicator: one slot, set by `init`, read by `get_comm`.

This module is the meeting point between ops and the distributed runtime.
Collective op kernels (ops/sync_batch_norm.py, ops/collective.py) import
`get_comm` from here lazily, inside the kernel, so the op modules keep
importing nothing but `minigraph.schema` at import time, and this module
imports no backend (mpi4py, pycuda, nccl4py) until a communicator is made.
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback

CHECK_ORDER_ENV = "MINIGRAPH_CHECK_ORDER"
BACKENDS = ("auto", "mpi", "nccl", "local")
_LAUNCHER_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")

_comm = None
_previous_excepthook = None


def init(backend="auto", place=None, check_order=None, timeout=None):
    """Start (once) and return the communicator of this process.

    backend: "auto" picks NCCL on a GPU place when nccl4py is installed and
      every rank has a GPU of its own (NCCL refuses two ranks on one GPU),
      MPI otherwise (a world of one process when started without mpiexec);
      "local" is a world of one process without MPI (also what "auto" falls
      back to when mpi4py is missing and no launcher started the process).
    place: None or "cpu" for CPUPlace(); "gpu" for GPUPlace(local_rank %
      device_count); or a place object, used as given. The communicator's
      `place` is the place to build the net on.
    check_order: verify before every collective that all ranks make the same
      call (default: on, unless the environment variable MINIGRAPH_CHECK_ORDER
      is 0). The same on every rank.
    timeout: the deadline of every collective, in seconds from the moment a
      rank enters it (default: the environment variable
      MINIGRAPH_COLLECTIVE_TIMEOUT, else 60; math.inf for none). Past it,
      every rank still alive raises CollectiveTimeoutError naming the ranks
      that did not arrive and the collective (minigraph/distributed/deadline.py).

    init itself is under the deadline: a rank that never arrives (it raised,
    exited or stalls before init) ends every other rank once the deadline has
    passed, and a setting one rank rejects or that differs between ranks is a
    ValueError on every rank (minigraph/distributed/startup.py).

    With more than one rank, an uncaught exception on any rank prints its
    traceback and ends the whole job (MPI_Abort) with a non-zero status, and
    os._exit(0) on a rank ends it with status 1 (it skips the exit check).
    The first call sets this rank's threads to its share of the host's cores
    unless they were set explicitly (minigraph/distributed/threads.py).
    Calling init again returns the same communicator (check_order and timeout,
    when given, replace the old settings); asking for a different backend or
    place then is an error.
    """
    global _comm
    if backend not in BACKENDS:
        raise ValueError(f"init: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from minigraph.distributed.deadline import resolve_timeout

    if _comm is not None:
        _check_compatible(_comm, backend, place)
        for comm in (_comm, getattr(_comm, "host", None)):
            if comm is not None and check_order is not None:
                comm.check_order = bool(check_order)
            if comm is not None and timeout is not None:
                comm.timeout_s = resolve_timeout(timeout)
        return _comm
    from minigraph.distributed import startup
    from minigraph.distributed.threads import apply_rank_threads

    apply_rank_threads()                   # this rank's share of the host's cores
    with startup.startup(timeout, check_order, _order_check_default) as settings:
        comm = _make(backend, place, settings.check_order, settings.timeout_s)
    _comm = comm
    if _comm.size > 1:
        from minigraph.distributed.deadline import watch_launcher
        from minigraph.distributed.mpi import running

        _install_excepthook()
        watch_launcher()
        atexit.register(_at_exit)
        startup.guard_exit(_comm.rank, _comm.size, running)
    return _comm


def _order_check_default():
    text = os.environ.get(CHECK_ORDER_ENV, "1").strip().lower()
    if text in ("0", "false", "no", "off"):
        return False
    if text in ("", "1", "true", "yes", "on"):
        return True
    raise ValueError(f"{CHECK_ORDER_ENV} must be 1 or 0, got {text!r}")


def get_comm():
    """The communicator `init` made; calls `init()` (backend "auto", CPU) if none yet."""
    return _comm if _comm is not None else init()


def is_initialized():
    """True once `init` has made the communicator."""
    return _comm is not None


def rank():
    """This process's rank (0 in a world of one)."""
    return get_comm().rank


def world_size():
    """The number of ranks."""
    return get_comm().size


# ---- making a communicator ---------------------------------------------------------

def _make(backend, place, check_order, timeout_s):
    want_gpu = _wants_gpu(place)
    if backend == "local" or (backend == "auto" and not _has_mpi4py()):
        launched = _launcher_size()
        if backend == "auto" and launched > 1:
            raise RuntimeError(f"minigraph.distributed.init: started as one of {launched} ranks "
                               "but mpi4py is not installed (pip install mpi4py mpich)")
        from minigraph.distributed.comm import LocalComm

        return LocalComm(_resolve_place(place, 0), check_order, timeout_s)
    if not _has_mpi4py():
        raise RuntimeError(f"init: backend={backend!r} needs mpi4py (pip install mpi4py mpich)")
    from minigraph.distributed.mpi import MPIComm

    host = MPIComm(None, check_order, timeout_s=timeout_s)
    host.place = _resolve_place(place, host.local_rank)
    if backend == "mpi" or (backend == "auto" and not want_gpu):
        return host
    from minigraph.distributed.nccl import NCCLComm, nccl_available

    if host.place.kind != "gpu":
        raise ValueError("init: backend='nccl' needs a GPU place (place='gpu')")
    if not nccl_available():
        if backend == "auto":
            return host                    # GPU place, no nccl4py: MPI staged through the host
        raise RuntimeError("init: backend='nccl' needs nccl4py (pip install 'minigraph[gpu]')")
    shared = _shared_gpus(host)
    if shared:
        if backend == "auto":
            return host                    # NCCL refuses two ranks on one GPU: MPI instead
        raise RuntimeError(f"init: backend='nccl' needs a GPU of its own for every rank, but "
                           f"{shared} (NCCL refuses that: 'Duplicate GPU detected'). Start at "
                           "most as many ranks per host as it has GPUs, or use backend='mpi' "
                           "(backend='auto' picks it)")
    return NCCLComm(host.place, host, check_order, timeout_s)


_GPU_ID_BYTES = 128


def _shared_gpus(host):
    """'' when every rank's place is a GPU of its own, else which ranks share one
    (more ranks on a host than it has GPUs, or places given so): each rank's
    host name and PCI bus id, gathered over the MPI communicator `host`."""
    import socket

    import numpy as np

    ident = f"{socket.gethostname()}/{host.place.device.pci_bus_id()}".encode()[:_GPU_ID_BYTES]
    mine = np.zeros(_GPU_ID_BYTES, np.uint8)
    mine[:len(ident)] = np.frombuffer(ident, np.uint8)
    rows = np.asarray(host._allgather(mine)).reshape(host.size, _GPU_ID_BYTES)
    owner, shared = {}, []
    for rank, row in enumerate(rows):
        gpu = row.tobytes().rstrip(b"\0").decode(errors="replace")
        if gpu in owner:
            shared.append(f"ranks {owner[gpu]} and {rank} share GPU {gpu}")
        owner.setdefault(gpu, rank)
    return "; ".join(shared)


def _wants_gpu(place):
    if place is None or isinstance(place, str):
        if place not in (None, "cpu", "gpu"):
            raise ValueError(f"init: place must be 'cpu', 'gpu' or a place object, got {place!r}")
        return place == "gpu"
    return getattr(place, "kind", None) == "gpu"


def _resolve_place(place, local_rank):
    from minigraph.place import CPUPlace, GPUPlace

    if place is None or place == "cpu":
        return CPUPlace()
    if place == "gpu":
        return GPUPlace(local_rank % _gpu_count())
    return place


def _gpu_count():
    from minigraph.place import GPUError

    try:
        import pycuda.driver as drv

        drv.init()
        count = drv.Device.count()
    except Exception as e:
        raise GPUError(f"init(place='gpu'): no usable GPU ({e})") from e
    if count == 0:
        raise GPUError("init(place='gpu'): the CUDA driver found no GPU")
    return count


def _has_mpi4py():
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def _launcher_size():
    for name in _LAUNCHER_SIZE_ENV:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 1


def _check_compatible(comm, backend, place):
    if backend not in ("auto", comm.backend):
        raise ValueError(f"init: already initialised with backend {comm.backend!r}, "
                         f"asked for {backend!r}")
    if place is not None and not isinstance(place, str) and place != comm.place:
        raise ValueError(f"init: already initialised on {comm.place!r}, asked for {place!r}")
    if isinstance(place, str) and place != comm.place.kind:
        raise ValueError(f"init: already initialised on {comm.place!r}, asked for {place!r}")


# ---- failing loudly instead of hanging ----------------------------------------------

def _install_excepthook():
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook
    sys.excepthook = _abort_on_exception


def _abort_on_exception(kind, value, tb):
    """Print the error and its traceback, then end every rank: the others may be
    waiting in a collective this rank will never reach. A CollectiveError's
    message comes first (the launcher may end the job at any moment)."""
    from minigraph.distributed.comm import CollectiveError

    try:
        sys.stderr.write(f"minigraph.distributed: rank {_comm.rank} of {_comm.size} raised an "
                         "uncaught exception; aborting all ranks.\n")
        if issubclass(kind, CollectiveError):
            sys.stderr.write(f"{kind.__name__}: {value}\n")
            sys.stderr.flush()
            sys.stderr.write("Traceback (most recent call last):\n" +
                             "".join(traceback.format_tb(tb)))
        else:
            (_previous_excepthook or sys.__excepthook__)(kind, value, tb)
    finally:
        _comm.abort(1)


def _at_exit():
    """At exit: end the job if a collective failed (another rank may stall
    forever); with the order check on, make sure no rank still waits in a
    collective this one skipped (Communicator.exit_check)."""
    if _comm.progress.broken is not None:
        _comm.abort(1)
    if not _comm.check_order:
        return
    try:
        _comm.exit_check()
    except Exception:
        traceback.print_exc()
        _comm.abort(1)
