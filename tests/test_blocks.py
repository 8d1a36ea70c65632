"""The blocked, threaded CPU engine (minigraph.kernels.cpu.blocks) and the framework-wide
thread setting mg.set_num_threads / mg.get_num_threads."""
import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import threadpoolctl

import minigraph as mg
from minigraph.kernels.cpu import blocks as cpu_blocks


def blas_threads():
    """The thread counts of every BLAS library numpy loaded."""
    return [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
            if lib["user_api"] == "blas"]


@pytest.fixture
def restore_threads():
    """Put the engine's and BLAS's threads back after the test."""
    old = mg.get_num_threads()
    with threadpoolctl.threadpool_limits(limits=None):     # restores BLAS on exit
        yield
        cpu_blocks._set_engine_threads(old)
    assert mg.get_num_threads() == old


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 floats, and every array split over the threads."""
    monkeypatch.setattr(cpu_blocks, "CHUNK_BYTES", 256)
    monkeypatch.setattr(cpu_blocks, "PARALLEL_MIN_BYTES", 0)


# ---- mg.set_num_threads ------------------------------------------------------------------

def test_set_num_threads_sets_the_engine_and_blas(restore_threads):
    assert blas_threads(), "numpy has no BLAS that threadpoolctl sees"
    mg.set_num_threads(1)
    assert mg.get_num_threads() == 1
    assert blas_threads() == [1] * len(blas_threads())
    mg.set_num_threads(np.int64(3))                  # numpy integers are integers
    assert mg.get_num_threads() == 3
    assert blas_threads() == [3] * len(blas_threads())


@pytest.mark.parametrize("bad", [0, -2, 2.5, 1.0, "2", None, True])
def test_set_num_threads_rejects_non_integers_and_values_below_one(bad, restore_threads):
    before, blas_before = mg.get_num_threads(), blas_threads()
    with pytest.raises(ValueError, match=r"set_num_threads: expected an integer >= 1 .*got "):
        mg.set_num_threads(bad)
    assert mg.get_num_threads() == before and blas_threads() == blas_before


def test_num_threads_context_restores_the_engine_and_blas():
    before, blas_before = mg.get_num_threads(), blas_threads()
    with cpu_blocks.num_threads(1):
        assert mg.get_num_threads() == 1 and set(blas_threads()) == {1}
    assert mg.get_num_threads() == before and blas_threads() == blas_before


def test_importing_minigraph_leaves_blas_and_the_environment_alone():
    code = ("import os, numpy, threadpoolctl\n"
            "info = lambda: [l['num_threads'] for l in threadpoolctl.threadpool_info()]\n"
            "env, before = dict(os.environ), info()\n"
            "import minigraph as mg\n"
            "assert info() == before, (before, info())\n"
            "assert dict(os.environ) == env\n"
            "assert mg.get_num_threads() == len(os.sched_getaffinity(0))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- run_blocks and the plans ------------------------------------------------------------

class FakePlan:
    def __init__(self, n, workers):
        self.blocks = list(range(n))
        self.workers = workers


@pytest.mark.parametrize("threads", [1, 3])
def test_run_blocks_runs_every_block_exactly_once(threads):
    seen, lock, names = [], threading.Lock(), set()

    def body(blocks):
        for b in blocks:
            with lock:
                seen.append(b)
                names.add(threading.current_thread().name)

    with cpu_blocks.num_threads(threads):
        cpu_blocks.run_blocks(body, FakePlan(200, threads))
    assert sorted(seen) == list(range(200))
    assert len(names) <= threads


def test_a_raise_in_a_worker_reaches_the_caller():
    caller = threading.current_thread()
    done = []

    def body(blocks):
        if threading.current_thread() is not caller:
            raise RuntimeError("worker failed")
        done.extend(blocks)

    with cpu_blocks.num_threads(3):
        with pytest.raises(RuntimeError, match="worker failed"):
            cpu_blocks.run_blocks(body, FakePlan(10, 3))
        assert done == list(range(10))                   # the caller still did its share
        seen = []
        cpu_blocks.run_blocks(lambda blocks: seen.extend(blocks), FakePlan(10, 3))
        assert sorted(seen) == list(range(10))           # the pool still works


def test_a_raise_on_the_calling_thread_waits_for_the_workers():
    caller = threading.current_thread()
    finished = []

    def body(blocks):
        if threading.current_thread() is caller:
            raise ValueError("caller failed")
        for _ in blocks:
            pass
        finished.append(threading.current_thread().name)

    with cpu_blocks.num_threads(3):
        with pytest.raises(ValueError, match="caller failed"):
            cpu_blocks.run_blocks(body, FakePlan(10, 3))
    assert len(finished) == 2                            # both workers were waited for


SHAPES = [(7, 5, 3),      # short inner axis: RowPlan, units and rows left over
          (10, 3, 20),    # FlatPlan, several whole rows per block
          (9, 6, 40),     # runs of channels inside a row
          (3, 6, 40),     # the same with broadcast constants (few rows)
          (3, 2, 150)]    # one channel in pieces


def covered(plan, x3):
    """How often each element of x3 is in a block."""
    count = np.zeros(x3.shape, np.int64)
    bases = plan.bases(count)
    for blk in plan.blocks:
        plan.view(bases, blk)[...] += 1
    return count


@pytest.mark.parametrize("shape", SHAPES)
def test_plans_cover_the_array_once_and_sum_per_channel(shape, small_blocks):
    x3 = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    plan = cpu_blocks.plan_for(x3)
    want_kind = cpu_blocks.RowPlan if shape[2] < cpu_blocks.MIN_INNER else cpu_blocks.FlatPlan
    assert isinstance(plan, want_kind) and len(plan.blocks) > 1
    assert all(isinstance(b, cpu_blocks.Block) for b in plan.blocks)
    assert (covered(plan, x3) == 1).all()
    results = []
    for threads in (1, 3):
        with cpu_blocks.num_threads(threads):
            plan = cpu_blocks.plan_for(x3)
            assert plan.workers == min(threads, len(plan.blocks))
            sums, xs = plan.new_sums(x3.dtype), plan.bases(x3)

            def body(blocks, plan=plan, sums=sums, xs=xs):
                for blk in blocks:
                    plan.add_sums(sums, blk, plan.view(xs, blk))

            cpu_blocks.run_blocks(body, plan)
            results.append(plan.fold(sums))
    np.testing.assert_allclose(results[0], np.float64(x3).sum(axis=(0, 2)), rtol=1e-5)
    assert results[0].tobytes() == results[1].tobytes()   # threads do not change the sums


@pytest.mark.parametrize("shape", SHAPES)
def test_expanded_constants_line_up_with_each_block(shape, small_blocks):
    x3 = np.zeros(shape, np.float64)
    plan = cpu_blocks.plan_for(x3)
    per_channel = np.arange(shape[1], dtype=np.float64) + 1
    expanded = plan.expand(per_channel, np.float64)
    out = np.zeros(shape)
    outs = plan.bases(out)
    for blk in plan.blocks:
        view = plan.view(outs, blk)
        view += plan.const(expanded, blk)
    np.testing.assert_array_equal(out, np.broadcast_to(per_channel[None, :, None], shape))


def _run_in_child(queue):
    try:
        with cpu_blocks.num_threads(2):
            seen = []
            cpu_blocks.run_blocks(lambda blocks: seen.extend(blocks), FakePlan(50, 2))
        queue.put(sorted(seen) == list(range(50)))
    except BaseException as e:  # noqa: BLE001  (report anything to the parent)
        queue.put(repr(e))


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork")
def test_a_forked_child_gets_a_fresh_pool():
    with cpu_blocks.num_threads(2):
        cpu_blocks.run_blocks(lambda blocks: list(blocks), FakePlan(10, 2))   # start the pool
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_run_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in run_blocks")
    assert queue.get(timeout=5) is True


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5, 7), (3, cpu_blocks.ZEROS_SIZE + 5), (2, 16, 33, 33)])
def test_relu_matches_numpy_maximum(dtype, shape):
    """relu against chunks of cached zeros is np.maximum(x, 0), bit for bit: NaN
    stays NaN, -inf and -0.0 give 0; in place, into `out`, and on a strided x."""
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    x.reshape(-1)[:4] = [np.nan, -np.inf, -0.0, np.inf]
    expected = np.maximum(x, 0)
    np.testing.assert_array_equal(cpu_blocks.relu(x), expected)
    out = np.full_like(x, 7.0)
    assert cpu_blocks.relu(x, out=out) is out
    np.testing.assert_array_equal(out, expected)
    y = x.copy()
    cpu_blocks.relu(y, out=y)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(cpu_blocks.relu(x.T), expected.T)
    assert not cpu_blocks.zeros(dtype).any() and not cpu_blocks.zeros(dtype).flags.writeable
