"""The MPI backend (mpi4py): numpy arrays directly; GPU arrays staged through host memory.

Every collective is posted nonblocking (Iallreduce, Iallgather, Ibcast,
Ibarrier) and waited for under the communicator's deadline without spinning
(minigraph/distributed/deadline.py): a rank that dies, stalls or goes out of
step ends every other rank with an error naming it and the collective.

mpi4py is imported when an MPIComm is made, never when this module is
imported. Without `mpiexec` MPI starts as a world of one process.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from minigraph.distributed.comm import Communicator, chan_merge, is_host_array
from minigraph.distributed.deadline import Waiter, resolve_timeout
from minigraph.distributed.startup import handshake

# dtypes MPI has no reduction type for: reduced in a wider one, then cast back
_WIDEN = {np.dtype("float16"): np.dtype("float32"), np.dtype("bool"): np.dtype("int32")}


ABORT_GRACE_S = 0.5


class MPIComm(Communicator):
    """Collectives over an mpi4py communicator (MPI.COMM_WORLD by default).

    On a GPU place, device arrays are copied to the host, reduced there and
    copied back to the place (no CUDA-aware MPI needed). timeout_s: the
    deadline of each collective (None: MINIGRAPH_COLLECTIVE_TIMEOUT, else 60).
    """

    backend = "mpi"

    def __init__(self, place=None, check_order=True, mpi_comm=None, timeout_s=None):
        from mpi4py import MPI

        self.MPI = MPI
        self.mpi_comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        node = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank = node.Get_rank()
        node.Free()
        super().__init__(self.mpi_comm.Get_rank(), self.mpi_comm.Get_size(), local_rank,
                         place, check_order, resolve_timeout(timeout_s))
        self.waiter = Waiter(self)
        self._digest_out = np.empty(8, dtype=np.uint8)
        self._digest_in = np.empty(8 * self.size, dtype=np.uint8)
        handshake(self)                  # the ranks' settings agree (startup.py)

    def _allreduce(self, x):
        host = self._to_host(x)
        wide = _WIDEN.get(host.dtype, host.dtype)
        send = np.ascontiguousarray(host, dtype=wide)
        recv = np.empty_like(send)
        self.waiter.wait(self.mpi_comm.Iallreduce(send, recv, op=self.MPI.SUM))
        return self._like(x, recv.astype(host.dtype, copy=False))

    def _allreduce_stats(self, x):
        """One MPI_Allreduce with a user-defined, commutative op (comm.chan_merge)
        on the whole 2C+1 vector as one element of a contiguous datatype, so MPI
        never splits a vector."""
        host = np.ascontiguousarray(self._to_host(x), dtype=np.float64)
        recv = np.empty_like(host)
        dtype, op = _stats_type(self.MPI, host.shape[0])
        self.waiter.wait(self.mpi_comm.Iallreduce([host, 1, dtype], [recv, 1, dtype], op=op))
        return self._like(x, recv)

    def _allgather(self, x):
        host = np.ascontiguousarray(self._to_host(x))
        recv = np.empty((self.size,) + host.shape, dtype=host.dtype)
        self.waiter.wait(self.mpi_comm.Iallgather(_bytes_view(host), _bytes_view(recv)))
        return self._like(x, recv)

    def _broadcast(self, x, root):
        buf = np.array(self._to_host(x), copy=True, order="C")
        self.waiter.wait(self.mpi_comm.Ibcast(_bytes_view(buf), root=root))
        return self._like(x, buf)

    def _barrier(self):
        self.waiter.wait(self.mpi_comm.Ibarrier())

    def _exchange_digest(self, digest):
        """The order check's exchange, into buffers made once (it precedes every collective)."""
        self._digest_out[:] = np.frombuffer(digest, dtype=np.uint8)
        self.waiter.wait(self.mpi_comm.Iallgather(self._digest_out, self._digest_in))
        return self._digest_in.tobytes()

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)      # let the launcher forward what this rank printed
        self.mpi_comm.Abort(code)

    def _to_host(self, x):
        """x as a numpy array: a device array is copied out on its place (under its
        context, so any thread may call this)."""
        if is_host_array(x):
            return x
        if self.place is not None and self.place.kind == "gpu":
            return self.place.to_host(x)
        return _to_host(x)

    def _like(self, x, host):
        """`host` as an array of x's kind: itself for numpy input, else a device copy."""
        if is_host_array(x):
            return host
        if self.place is not None and self.place.kind == "gpu":
            return self.place.to_device(host)
        import pycuda.gpuarray as gpuarray

        return gpuarray.to_gpu(np.ascontiguousarray(host))


def running():
    """True while MPI is initialised and not finalized in this process."""
    MPI = getattr(sys.modules.get("mpi4py"), "MPI", None)
    return MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()


_stats_types = {}
_stats_op = []


def _stats_type(MPI, width):
    """(contiguous datatype of `width` doubles, the Chan-merge op), made once."""
    if not _stats_op:
        _stats_op.append(MPI.Op.Create(_chan_op, commute=True))
    dtype = _stats_types.get(width)
    if dtype is None:
        dtype = _stats_types[width] = MPI.DOUBLE.Create_contiguous(width).Commit()
    return dtype, _stats_op[0]


def _chan_op(inbuf, inoutbuf, datatype):
    """MPI reduction: inoutbuf[k] = chan_merge(inbuf[k], inoutbuf[k]) per vector."""
    width = datatype.Get_size() // 8
    a = np.frombuffer(inbuf, dtype=np.float64).reshape(-1, width)
    b = np.frombuffer(inoutbuf, dtype=np.float64).reshape(-1, width)
    for k in range(a.shape[0]):
        b[k] = chan_merge(a[k], b[k])


def _to_host(x):
    if is_host_array(x):
        return x
    if hasattr(x, "get"):                     # pycuda GPUArray
        return x.get()
    return np.asarray(x)


def _bytes_view(a):
    """The array's memory as bytes: gathers and broadcasts move bytes, so
    every dtype (float16, bool, ...) travels unchanged."""
    return a.reshape(-1).view(np.uint8)
