"""minigraph.distributed.nccl against a recording fake of nccl4py.

The fake binds every call with inspect.signature of the installed nccl4py's
own functions (so a renamed function or argument fails here), and checks
what NCCL would: the communicator is made with its device's context current,
every collective runs in that context on the default stream, and its buffers
(read through __cuda_array_interface__) belong to that device. Two ranks run
in two threads on two fake GPUs (tests/kernel_emulator/fake_pycuda.py), so
the context rule, the pooled outputs, the bucketed gradient average and the
device merge of batch statistics are checked with real numbers.

Needs the nccl4py package (`pip install nccl4py 'cuda-bindings>=12.8,<13'`
imports without a GPU; only libnccl is missing); skipped without it.
"""
from __future__ import annotations

import inspect
import shutil
import sys
import threading
import time
import types

import numpy as np
import pytest
from kernel_emulator import fake_pycuda

import minigraph as mg
from minigraph.distributed import deadline
from minigraph.distributed import nccl as mg_nccl
from minigraph.distributed.comm import Progress, merge_rows
from minigraph.kernels.cuda import collective
from minigraph.schema import KernelContext

# not installed, or installed without what it needs (cuda-bindings): skipped either way
REAL = pytest.importorskip("nccl.core", reason="nccl4py is not installed or does not import",
                           exc_type=ImportError)
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


def bound(real_fn, *args, **kwargs):
    """The arguments as the installed nccl4py function binds them (TypeError if not)."""
    return inspect.signature(real_fn).bind(*args, **kwargs).arguments


class World:
    """K ranks in threads: a rendezvous for the fake collectives, and a call log."""

    def __init__(self, size, cuda):
        self.size, self.cuda = size, cuda
        self.slots = [None] * size
        self.gate = threading.Barrier(size, timeout=60)
        self.calls = []
        self.lock = threading.Lock()

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
            assert a["op"] == REAL.SUM and a.get("stream") is None
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
            return 0

        def get_last_error(self, *args):
            bound(REAL.Communicator.get_last_error, self, *args)
            return ""

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


@pytest.fixture
def setup(monkeypatch):
    """(FakeCuda with 2 GPUs, installed; a function making a World with fake nccl4py)."""
    cuda = fake_pycuda.FakeCuda(devices=2)

    def world_of(size):
        world = World(size, cuda)
        pkg = types.ModuleType("nccl")
        pkg.core = fake_nccl_core(world)
        monkeypatch.setitem(sys.modules, "nccl", pkg)
        monkeypatch.setitem(sys.modules, "nccl.core", pkg.core)
        return world

    with cuda.install():
        yield cuda, world_of


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


def test_the_names_used_exist_in_nccl4py_and_are_required():
    for name in mg_nccl.NCCL_NAMES:
        assert hasattr(REAL, name), name
    assert isinstance(inspect.getattr_static(REAL.UniqueId, "as_bytes"), property)
    assert {"nranks", "rank", "unique_id"} <= set(inspect.signature(REAL.Communicator.init)
                                                  .parameters)
    assert mg_nccl.nccl_available()


def test_nccl_available_needs_every_name(monkeypatch):
    partial = types.ModuleType("nccl.core")
    partial.SUM, partial.Communicator = REAL.SUM, REAL.Communicator
    pkg = types.ModuleType("nccl")
    pkg.core = partial
    monkeypatch.setitem(sys.modules, "nccl", pkg)
    monkeypatch.setitem(sys.modules, "nccl.core", partial)
    assert not mg_nccl.nccl_available()


def test_two_ranks_on_two_gpus(setup, monkeypatch):
    cuda, world_of = setup
    world = world_of(2)
    tls = threading.local()
    monkeypatch.setattr(collective, "communicator", lambda: tls.comm)
    rng = np.random.default_rng(0)
    offset = 1e6 + rng.standard_normal((14, 3, 2, 2))
    parts = np.split(offset, [5])

    def rank_work(rank):
        from minigraph.kernels.cuda import batch_norm_sync

        place = mg.GPUPlace(rank)
        comm = tls.comm = mg_nccl.NCCLComm(place, HostComm(world, rank), timeout_s=60)
        with place.activate():
            x = place.to_device(np.arange(5.0) * (rank + 1))
            got = {"sum": place.to_host(comm.allreduce(x)),
                   "gather": place.to_host(comm.allgather(x)),
                   "bcast": place.to_host(comm.broadcast(x, root=1)),
                   "host": comm.allreduce(np.array([rank + 1.0]))}
            local = batch_norm_sync.local_stats(place.to_device(parts[rank]), "NCHW")
            got["stats"] = place.to_host(comm.allreduce_stats(local))
            got["rows"] = place.to_host(comm.allgather(local))
            grads = [place.to_device(np.full(s, rank + 1.0, np.float32)) for s in
                     ((3, 2), (4,), ())] + [place.to_device(np.full(2, rank + 1.0))]
            names = [types.SimpleNamespace(name=f"g{i}") for i in range(len(grads))]
            op = types.SimpleNamespace(type="c_allreduce_avg", inputs={"x": names},
                                       outputs={"out": [object() for _ in names]})
            before = world_calls(world, "allreduce", rank)
            outs = collective.allreduce_avg_gpu(op, {"x": grads}, KernelContext())["out"]
            got["avg_calls"] = world_calls(world, "allreduce", rank) - before
            collective.allreduce_avg_gpu(op, {"x": grads}, KernelContext())          # warms the pool
            allocs = cuda.counts["mem_alloc"]
            collective.allreduce_avg_gpu(op, {"x": grads}, KernelContext())
            got["avg_allocs"] = cuda.counts["mem_alloc"] - allocs
            got["avg"] = [place.to_host(o) for o in outs]
            in_place = types.SimpleNamespace(type=op.type, inputs=op.inputs,
                                             outputs={"out": names})
            same = collective.allreduce_avg_gpu(in_place, {"x": grads}, KernelContext())["out"]
            got["in_place"] = all(a is b for a, b in zip(same, grads, strict=True))
            got["avg_of_avg"] = place.to_host(grads[0])
        comm.barrier(what="save ckpt.npz")               # drain, synchronize, MPI barrier
        got["calls"] = comm.calls
        comm.close()
        got["stack"] = list(cuda.stack())
        return got

    a, b = on_ranks(world, rank_work)
    for got in (a, b):
        np.testing.assert_array_equal(got["sum"], np.arange(5.0) * 3)
        np.testing.assert_array_equal(got["gather"], [np.arange(5.0), np.arange(5.0) * 2])
        np.testing.assert_array_equal(got["bcast"], np.arange(5.0) * 2)
        np.testing.assert_array_equal(got["host"], [3.0])
        np.testing.assert_allclose(got["stats"], merge_rows(got["rows"]), rtol=1e-12)
        centred = offset - offset.mean(axis=(0, 2, 3), keepdims=True)
        want_var = (centred * centred).mean(axis=(0, 2, 3))
        assert np.max(np.abs(got["stats"][4:] / got["stats"][0] - want_var) / want_var) < 1e-6
        assert got["avg_calls"] == 2                     # one allreduce per dtype, not per array
        assert got["avg_allocs"] == 0                    # pooled, once warm
        for g, shape in zip(got["avg"], ((3, 2), (4,), (), (2,)), strict=True):
            np.testing.assert_array_equal(g, np.full(shape, 1.5))
        assert got["in_place"]                           # out is x: written into x
        np.testing.assert_array_equal(got["avg_of_avg"], np.full((3, 2), 1.5))
        assert got["stack"] == []
    assert a["stats"].tobytes() == b["stats"].tobytes()
    kinds = [c[1] for c in world.calls]
    assert kinds.count("get_unique_id") == 1 and kinds.count("init") == 2
    assert sorted(c[2:] for c in world.calls if c[1] == "init") == [(2, 0, 0), (2, 1, 1)]
    assert sorted(c[2:] for c in world.calls if c[1] == "destroy") == [(0, 0), (1, 1)]
    assert "host allreduce" in kinds                 # host arrays go through MPI, not NCCL
    assert kinds.count("host barrier") == 2
    assert a["calls"] == b["calls"] > 10              # one call index, NCCL and MPI calls alike
    assert "host allgather" in kinds                 # the order check (on by default), over MPI
    waits = [t for t, what, _ in cuda.log if what == "event_synchronize"]
    assert waits and all(t.startswith("nccl-") for t in waits)   # the watchdog waits...
    assert cuda.counts["event_query"] == 0                         # ...without polling


def world_calls(world, kind, rank):
    return sum(1 for c in world.calls if c[1] == kind and c[2] == rank)


@pytest.mark.parametrize("how", ["init", "environment"])
def test_a_collective_that_never_finishes_aborts_the_job(setup, capfd, monkeypatch, how):
    """The watchdog's deadline is the communicator's (init(timeout=...) or
    MINIGRAPH_COLLECTIVE_TIMEOUT, as for MPI) and its message names the rank
    and the collective (index and label)."""
    cuda, world_of = setup
    world = world_of(1)
    place = mg.GPUPlace(0)
    if how == "init":
        host = HostComm(world, 0, timeout_s=deadline.resolve_timeout(0.3))
    else:
        monkeypatch.setenv(deadline.TIMEOUT_ENV, "0.3")
        host = HostComm(world, 0, timeout_s=deadline.resolve_timeout())
    comm = mg_nccl.NCCLComm(place, host)
    assert comm.timeout_s == 0.3 and comm.progress is host.progress
    cuda.hang.set()
    start = time.monotonic()
    x = place.to_device(np.ones(3))
    comm.allreduce(x, what="warm-up")
    comm.allreduce(x, what="c_allreduce_avg [fc.w@GRAD]")
    assert time.monotonic() - start < 0.25          # enqueued: the host does not wait
    assert host.aborted.wait(10), "no abort past the deadline"
    assert time.monotonic() - start >= 0.3
    assert ("MainThread", "abort", 0) not in world.calls
    assert any(c[1] == "abort" for c in world.calls)             # NCCL's abort, then MPI's
    err = capfd.readouterr().err
    assert ("rank 0 of 1: NCCL allreduce of collective #0 'warm-up' did not finish within "
            "0.3 s") in err, err
    assert "MINIGRAPH_COLLECTIVE_TIMEOUT" in err
    cuda.hang.clear()
    comm.close()
