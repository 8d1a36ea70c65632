"""minigraph.distributed.nccl against a recording fake of nccl4py
(tests/kernel_emulator/fake_nccl.py: every call bound with the signatures of the
installed nccl4py, or of stand-ins with nccl4py 0.6's; it checks what NCCL
would, and refuses two ranks of one communicator on one GPU). Ranks run in
threads on fake GPUs (tests/kernel_emulator/fake_pycuda.py, which also leaks
and warns, as PyCUDA does, about an event destroyed on a thread where its
context is not current), so the context rule, the pooled outputs, the bucketed
gradient average and the device merge of batch statistics are checked with
real numbers; so are the watchdog's handling of its events and of errors
(review finding 6) and the auto backend's choice with more ranks than GPUs
(finding 3).

The tests of nccl4py's own names need the package (`pip install nccl4py
'cuda-bindings>=12.8,<13'` imports without a GPU; only libnccl is missing).
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
from kernel_emulator.fake_nccl import INSTALLED, REAL, HostComm, World, fake_nccl_core, on_ranks

import minigraph as mg
from minigraph.distributed import deadline, world
from minigraph.distributed import nccl as mg_nccl
from minigraph.distributed.comm import CollectiveError, merge_rows
from minigraph.kernels.cuda import collective
from minigraph.schema import KernelContext

needs_nccl4py = pytest.mark.skipif(INSTALLED is None,
                                   reason="nccl4py is not installed or does not import")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


class RankContext(KernelContext):
    """A kernel context whose communicator is this rank's (ranks are threads here)."""

    def __init__(self, comm):
        super().__init__()
        self._comm = comm

    @property
    def comm(self):
        return self._comm


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


@needs_nccl4py
def test_the_names_used_exist_in_nccl4py_and_are_required():
    for name in mg_nccl.NCCL_NAMES:
        assert hasattr(REAL, name), name
    assert isinstance(inspect.getattr_static(REAL.UniqueId, "as_bytes"), property)
    assert {"nranks", "rank", "unique_id"} <= set(inspect.signature(REAL.Communicator.init)
                                                  .parameters)
    assert mg_nccl.nccl_available()


@needs_nccl4py
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
    rng = np.random.default_rng(0)
    offset = 1e6 + rng.standard_normal((14, 3, 2, 2))
    parts = np.split(offset, [5])

    warm = threading.Barrier(2, timeout=60)

    def rank_work(rank):
        from minigraph.kernels.cuda import batch_norm_sync

        place = mg.GPUPlace(rank)
        comm = mg_nccl.NCCLComm(place, HostComm(world, rank), timeout_s=60)
        ctx = RankContext(comm)
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
            outs = collective.allreduce_avg_gpu(op, {"x": grads}, ctx)["out"]
            got["avg_calls"] = world_calls(world, "allreduce", rank) - before
            collective.allreduce_avg_gpu(op, {"x": grads}, ctx)          # warms the pool
            # both ranks' threads share the driver's tally: count between barriers,
            # where only the two ranks' third calls run
            warm.wait()
            allocs = cuda.counts["mem_alloc"]
            warm.wait()
            collective.allreduce_avg_gpu(op, {"x": grads}, ctx)
            warm.wait()
            got["avg_allocs"] = cuda.counts["mem_alloc"] - allocs
            got["avg"] = [place.to_host(o) for o in outs]
            in_place = types.SimpleNamespace(type=op.type, inputs=op.inputs,
                                             outputs={"out": names})
            same = collective.allreduce_avg_gpu(in_place, {"x": grads}, ctx)["out"]
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


# ---- the watchdog's events and errors (pre-flight review finding 6) ----------------------

def test_the_watchdog_releases_each_event_in_its_context(setup):
    """The place (and so its context) belongs to this thread; the watchdog's thread
    waits for the events. PyCUDA destroys an event only where its context can be
    made current: one dropped on the watchdog's thread outside the context leaks,
    with a warning, one CUevent per collective."""
    import gc
    import warnings

    cuda, world_of = setup
    world = world_of(1)
    place = mg.GPUPlace(0)
    comm = mg_nccl.NCCLComm(place, HostComm(world, 0), timeout_s=60)
    x = place.to_device(np.ones(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(5):
            comm.allreduce(x, what=f"grads {k}")
        comm.barrier(what="step")
        comm.close()
        gc.collect()
    assert cuda.counts["event_create"] == 5
    assert cuda.leaks == [], cuda.leaks
    assert cuda.counts["event_destroy"] == 5
    assert not [w for w in caught if "out-of-thread" in str(w.message)]


def test_an_error_while_waiting_is_reported_at_once(setup, capfd):
    """A sticky CUDA error raised by the watchdog's wait names the collective and
    ends the job at once, not when the deadline passes with a misleading message;
    the communicator is then broken."""
    cuda, world_of = setup
    world = world_of(1)
    place = mg.GPUPlace(0)
    host = HostComm(world, 0, timeout_s=60)
    comm = mg_nccl.NCCLComm(place, host)
    x = place.to_device(np.ones(3))
    cuda.hang.set()                                 # the wait blocks until released...
    comm.allreduce(x, what="c_allreduce_avg [fc.w@GRAD]")
    cuda.fail()                                     # ...and then raises the sticky error
    start = time.monotonic()
    cuda.released.set()
    assert host.aborted.wait(10), "the failed wait was not reported"
    assert time.monotonic() - start < 5
    err = capfd.readouterr().err
    assert ("rank 0 of 1: NCCL allreduce of collective #0 'c_allreduce_avg [fc.w@GRAD]' failed: "
            "FakeDriverError: cuEventSynchronize failed: an illegal memory access") in err, err
    assert "did not finish" not in err
    with pytest.raises(CollectiveError, match="illegal memory access"):
        comm.barrier(what="after")
    cuda.fail(None)
    cuda.hang.clear()
    comm.close()                                     # reported already: no second report


def test_an_async_nccl_error_is_reported_with_the_collective(setup, capfd):
    cuda, world_of = setup
    world = world_of(1)
    place = mg.GPUPlace(0)
    host = HostComm(world, 0, timeout_s=60)
    comm = mg_nccl.NCCLComm(place, host)
    world.async_error = 6
    comm.allreduce(place.to_device(np.ones(2)), what="loss")
    assert host.aborted.wait(10)
    assert "collective #0 'loss' failed: RuntimeError: NCCL async error 6: remote process " \
           "exited" in capfd.readouterr().err
    world.async_error = 0
    comm.close()


# ---- more ranks than GPUs (pre-flight review finding 3) ------------------------------------

def test_the_fake_refuses_two_ranks_on_one_gpu(setup):
    cuda, world_of = setup
    world = world_of(2)

    def rank_work(rank):
        return mg_nccl.NCCLComm(mg.GPUPlace(0), HostComm(world, rank), timeout_s=60)
    with pytest.raises(RuntimeError, match="Duplicate GPU detected : rank 1 and rank 0 both on "
                                           "CUDA device 0"):
        on_ranks(world, rank_work)


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_more_ranks_than_gpus(monkeypatch, backend):
    """init(backend='auto', place='gpu') with two ranks on a one-GPU host: every rank
    gets GPU 0 (local_rank % 1), and NCCL refuses two ranks on one GPU - so auto
    picks MPI (staged through the host), and an explicit 'nccl' is a clear error."""
    from minigraph.distributed import mpi

    cuda = fake_pycuda.FakeCuda(devices=1)
    with cuda.install():
        ranks = World(2, cuda)
        pkg = types.ModuleType("nccl")
        pkg.core = fake_nccl_core(ranks)
        monkeypatch.setitem(sys.modules, "nccl", pkg)
        monkeypatch.setitem(sys.modules, "nccl.core", pkg.core)
        hosts = [HostComm(ranks, r) for r in range(2)]
        mine = threading.local()
        monkeypatch.setattr(mpi, "MPIComm", lambda place, check_order, timeout_s=None:
                            hosts[mine.rank])

        def rank_work(rank):
            mine.rank = rank
            return world._make(backend, "gpu", True, 60.0)
        if backend == "auto":
            comms = on_ranks(ranks, rank_work)
            assert comms == hosts and all(c.place.device_id == 0 for c in comms)
            assert not [c for c in ranks.calls if c[1] == "init"]
        else:
            with pytest.raises(RuntimeError, match=r"ranks 0 and 1 share GPU .*/0000:00:00.0 "
                                                   r"\(NCCL refuses that"):
                on_ranks(ranks, rank_work)
