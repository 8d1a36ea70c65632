"""A recording fake of nccl4py (`nccl.core`) for tests/test_nccl.py: ranks are
threads on the fake PyCUDA's GPUs (fake_pycuda.py).

Every call is bound with inspect.signature of the installed nccl4py's own
function (so a renamed function or argument fails), or, without nccl4py, of
stand-ins with nccl4py 0.6's signatures (`Nccl06`). It checks what NCCL would:
the communicator is made with its device's context current, two ranks of one
communicator on one GPU are refused ("Duplicate GPU detected"), every
collective runs in that context on the default stream, and its buffers (read
through __cuda_array_interface__) belong to that device. `HostComm` is the MPI
side a NCCLComm bootstraps with.
"""
from __future__ import annotations

import inspect
import threading
import types

import numpy as np

from minigraph.distributed.comm import Progress


class Nccl06:
    """Stand-ins with nccl4py 0.6's signatures, for machines without nccl4py."""

    SUM = 0

    def get_unique_id(empty=False): ...

    class UniqueId:
        @staticmethod
        def from_bytes(b): ...

    class Communicator:
        @staticmethod
        def init(nranks, rank, unique_id, config=None): ...

        def allreduce(self, sendbuf, recvbuf, op, *, stream=None, config=None): ...

        def allgather(self, sendbuf, recvbuf, *, stream=None, config=None): ...

        def broadcast(self, sendbuf, recvbuf, root, *, stream=None, config=None): ...

        def get_async_error(self): ...

        def get_last_error(self): ...

        def abort(self): ...

        def destroy(self): ...


try:          # not installed, or installed without what it needs (cuda-bindings)
    import nccl.core as INSTALLED
except ImportError:
    INSTALLED = None
REAL = INSTALLED or Nccl06


def bound(real_fn, *args, **kwargs):
    """The arguments as nccl4py's function binds them (TypeError if not)."""
    return inspect.signature(real_fn).bind(*args, **kwargs).arguments


class World:
    """K ranks in threads: a rendezvous for the fake collectives, and a call log."""

    def __init__(self, size, cuda):
        self.size, self.cuda = size, cuda
        self.slots = [None] * size
        self.gate = threading.Barrier(size, timeout=60)
        self.calls = []
        self.lock = threading.Lock()
        self.async_error = 0             # what get_async_error reports

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.gate.wait()
        values = list(self.slots)
        self.gate.wait()
        return values

    def record(self, *call):
        with self.lock:
            self.calls.append((threading.current_thread().name, *call))


def fake_nccl_core(world):
    """A module with the names minigraph uses, each call checked against nccl4py's."""
    cuda = world.cuda
    mod = types.ModuleType("nccl.core")
    mod.SUM = REAL.SUM

    class UniqueId:
        def __init__(self, raw):
            self.raw = raw

        @property
        def as_bytes(self):
            return self.raw

        @staticmethod
        def from_bytes(b):
            bound(REAL.UniqueId.from_bytes, b)
            return UniqueId(bytes(b))

    def get_unique_id(*args, **kwargs):
        bound(REAL.get_unique_id, *args, **kwargs)
        world.record("get_unique_id")
        return UniqueId(b"\x07" * 128)

    class Communicator:
        @classmethod
        def init(cls, *args, **kwargs):
            a = bound(REAL.Communicator.init, *args, **kwargs)
            assert a["unique_id"].raw == b"\x07" * 128, "every rank joins with rank 0's id"
            comm = cls()
            comm.rank, comm.ctx = a["rank"], cuda.current("ncclCommInitRank")
            world.record("init", a["nranks"], a["rank"], comm.ctx.device.index)
            devices = world.exchange(comm.rank, comm.ctx.device.index)
            for r, d in enumerate(devices):
                if d in devices[:r]:
                    raise RuntimeError(f"NCCL error: invalid usage (Duplicate GPU detected : "
                                       f"rank {r} and rank {devices.index(d)} both on CUDA "
                                       f"device {d})")
            return comm

        def _enqueue(self, kind, *bufs):
            ctx = cuda.current(f"nccl {kind}")
            assert ctx is self.ctx, f"{kind} with {ctx} current, communicator on {self.ctx}"
            for b in bufs:
                iface = b.__cuda_array_interface__
                assert iface["version"] >= 3
                assert cuda.owner(iface["data"][0]) is self.ctx, f"{kind}: buffer of another GPU"
            world.record(kind, self.rank, tuple(b.shape for b in bufs))

        def allreduce(self, *args, **kwargs):
            a = bound(REAL.Communicator.allreduce, self, *args, **kwargs)
            assert a["op"] == REAL.SUM and a.get("stream") == _device_stream(), \
                "a collective off the device's own stream"
            self._enqueue("allreduce", a["sendbuf"], a["recvbuf"])
            values = world.exchange(self.rank, a["sendbuf"].get())
            a["recvbuf"]._host()[...] = sum(values[1:], values[0])

        def allgather(self, *args, **kwargs):
            a = bound(REAL.Communicator.allgather, self, *args, **kwargs)
            self._enqueue("allgather", a["sendbuf"], a["recvbuf"])
            values = world.exchange(self.rank, a["sendbuf"].get())
            a["recvbuf"]._host()[...] = np.stack(values)

        def broadcast(self, *args, **kwargs):
            a = bound(REAL.Communicator.broadcast, self, *args, **kwargs)
            self._enqueue("broadcast", a["sendbuf"], a["recvbuf"])
            values = world.exchange(self.rank, a["sendbuf"].get())
            a["recvbuf"]._host()[...] = values[a["root"]]

        def get_async_error(self, *args):
            bound(REAL.Communicator.get_async_error, self, *args)
            return world.async_error

        def get_last_error(self, *args):
            bound(REAL.Communicator.get_last_error, self, *args)
            return "remote process exited" if world.async_error else ""

        def abort(self, *args):
            bound(REAL.Communicator.abort, self, *args)
            world.record("abort", self.rank)

        def destroy(self, *args):
            bound(REAL.Communicator.destroy, self, *args)
            world.record("destroy", self.rank, cuda.current("destroy").device.index)

    mod.UniqueId, mod.get_unique_id, mod.Communicator = UniqueId, get_unique_id, Communicator
    return mod


class HostComm:
    """The MPI side NCCLComm bootstraps with (broadcast, barrier, host collectives, abort;
    the call index and the deadline it shares)."""

    def __init__(self, world, rank, timeout_s=60.0):
        self.world, self.rank, self.size, self.local_rank = world, rank, world.size, rank
        self.mpi_comm = self
        self.aborted = threading.Event()
        self.progress, self.timeout_s = Progress(), timeout_s

    def broadcast(self, x, root=0, what=""):
        self.world.record("host broadcast", self.rank, what)
        return np.array(self.world.exchange(self.rank, np.array(x))[root])

    def Barrier(self):
        self.world.exchange(self.rank, None)

    def _barrier(self):
        self.world.record("host barrier", self.rank)
        self.world.exchange(self.rank, None)

    def _allreduce(self, x):
        self.world.record("host allreduce", self.rank)
        values = self.world.exchange(self.rank, np.array(x))
        return sum(values[1:], values[0])

    def _allgather(self, x):
        self.world.record("host allgather", self.rank)
        return np.stack(self.world.exchange(self.rank, np.array(x)))

    def abort(self, code=1):
        self.world.record("host abort", self.rank, code)
        self.aborted.set()
        self.world.cuda.released.set()


def on_ranks(world, fn):
    """Run fn(rank) on one thread per rank; re-raise the first failure here."""
    errors, results = [], [None] * world.size

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported in the test's thread
            errors.append(e)
            world.gate.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}")
               for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _device_stream():
    """The handle of the stream the current device owns (what every NCCL call must get)."""
    from minigraph.device import current

    return current().stream_handle
