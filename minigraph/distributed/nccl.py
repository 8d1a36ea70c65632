"""The NCCL backend (nccl4py) for GPU arrays, bootstrapped over MPI.

Rank 0 makes an NCCL unique id and broadcasts it over MPI; every rank then
joins the NCCL communicator on its own GPU (the place's device, which is
current because GPUPlace pushes its primary context). Buffers go to NCCL as
objects with `__cuda_array_interface__` (PyCUDA's GPUArray has it); host
(numpy) arrays are staged through the device.

Every collective is enqueued on the default stream and then waited for
with a deadline (MINIGRAPH_NCCL_TIMEOUT seconds, default 300): past it the
NCCL communicator is aborted and the whole job ends through MPI_Abort, so
a rank that died or took another path never leaves the others hanging.

Nothing here imports pycuda or nccl4py until an NCCLComm is made.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from minigraph.distributed.comm import Communicator, is_host_array

DEFAULT_TIMEOUT_S = 300.0


def nccl_available():
    """True when nccl4py can be imported (`nccl.core`)."""
    try:
        import nccl.core  # noqa: F401
    except Exception:      # ImportError, or a library that fails to load
        return False
    return True


class NCCLComm(Communicator):
    """Collectives on GPUArrays through NCCL; `host` is the MPIComm used to
    bootstrap, for the order check and for aborting the job."""

    backend = "nccl"

    def __init__(self, place, host, check_order=False, timeout_s=None):
        from nccl.core import SUM, Communicator, UniqueId, get_unique_id

        super().__init__(host.rank, host.size, host.local_rank, place, check_order)
        self.host = host
        self.SUM = SUM
        self.timeout_s = float(timeout_s if timeout_s is not None else
                               os.environ.get("MINIGRAPH_NCCL_TIMEOUT", DEFAULT_TIMEOUT_S))
        uid = get_unique_id().as_bytes if host.rank == 0 else None
        uid = host.mpi_comm.bcast(uid, root=0)
        self.nccl = Communicator.init(nranks=host.size, rank=host.rank,
                                      unique_id=UniqueId.from_bytes(uid))

    # ---- collectives on device arrays -----------------------------------------

    def _allreduce(self, x):
        dev, host_in = self._device(x)
        out = _empty_like(dev)
        self.nccl.allreduce(dev, out, self.SUM, stream=None)
        self._wait("allreduce")
        return out.get() if host_in else out

    def _allgather(self, x):
        dev, host_in = self._device(x)
        import pycuda.gpuarray as gpuarray

        out = gpuarray.empty((self.size,) + tuple(dev.shape), dtype=dev.dtype)
        self.nccl.allgather(dev, out, stream=None)
        self._wait("allgather")
        return out.get() if host_in else out

    def _broadcast(self, x, root):
        dev, host_in = self._device(x)
        out = dev.copy()
        self.nccl.broadcast(out, out, root, stream=None)
        self._wait("broadcast")
        return out.get() if host_in else out

    def _barrier(self):
        import pycuda.driver as drv

        drv.Context.synchronize()
        self.host.mpi_comm.Barrier()

    def _gather_ints(self, arr):
        return self.host._gather_ints(arr)

    def _gather_objects(self, obj):
        return self.host._gather_objects(obj)

    def abort(self, code=1):
        try:
            self.nccl.abort()
        finally:
            self.host.abort(code)

    # ---- helpers ----------------------------------------------------------------

    def _device(self, x):
        """(device array, whether x was a host array that must go back to the host)."""
        if is_host_array(x):
            return self.place.to_device(np.ascontiguousarray(x)), True
        return x, False

    def _wait(self, kind):
        """Block until the enqueued collective is done; abort the job past the deadline."""
        import pycuda.driver as drv

        done = drv.Event()
        done.record()
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-5
        while not done.query():
            if time.monotonic() > deadline:
                sys.stderr.write(
                    f"minigraph.distributed: rank {self.rank}: NCCL {kind} did not finish within "
                    f"{self.timeout_s:g} s (MINIGRAPH_NCCL_TIMEOUT); another rank probably "
                    "failed or runs different ops. Aborting the job.\n")
                self.abort(1)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        status = self.nccl.get_async_error()
        if int(status) != 0:
            sys.stderr.write(f"minigraph.distributed: rank {self.rank}: NCCL {kind} failed: "
                             f"{self.nccl.get_last_error()}. Aborting the job.\n")
            self.abort(1)


def _empty_like(dev):
    import pycuda.gpuarray as gpuarray

    return gpuarray.empty(tuple(dev.shape), dtype=dev.dtype)
