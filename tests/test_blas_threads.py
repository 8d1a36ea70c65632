"""OpenBLAS's parallel work on minigraph's own pool (kernels/cpu/blas_threads.py and
blas_pool.c): the same results, OpenBLAS's own workers left idle, off where asked,
and safe with forks and with several calling threads."""
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from minigraph.kernels.cpu import blas_threads, blocks, native


def pool_ready():
    """True when the callback can be installed here (skip the test otherwise)."""
    blas_threads.install()
    return bool(blas_threads.installed())


needs_pool = pytest.mark.skipif("not pool_ready()",
                                reason="no native kernels or no OpenBLAS with a threads "
                                       "callback here")


def run_child(code, env=None, timeout=120):
    """Run `code` in a fresh interpreter; its stdout (the test fails on a non-zero exit)."""
    full = dict(os.environ, **(env or {}))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout


@needs_pool
def test_products_on_the_pool_equal_openblas_own_bit_for_bit():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 300), dtype=np.float32)
    b = rng.standard_normal((300, 200), dtype=np.float32)
    ad, bd = a.astype(np.float64), b.astype(np.float64)
    with blocks.num_threads(2):
        blas_threads.uninstall()
        try:
            before = blas_threads.calls()
            own, own_d, own_v = a @ b, ad @ bd, a @ b[:, 0]
            assert blas_threads.calls() == before           # not through the callback
        finally:
            blas_threads.install()
        pooled, pooled_d, pooled_v = a @ b, ad @ bd, a @ b[:, 0]
        assert blas_threads.calls() >= before + 2
    np.testing.assert_array_equal(pooled, own)
    np.testing.assert_array_equal(pooled_d, own_d)
    np.testing.assert_array_equal(pooled_v, own_v)


@needs_pool
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="no /proc/self/task")
def test_openblas_own_workers_stay_asleep_while_products_run():
    """OpenBLAS starts its workers when it loads; after install they get no work (the
    pool's threads do it) and, asleep, use no CPU: their CPU time does not move while
    products run, where without the pool they do half the work and then spin."""
    out = run_child("""
        import os, time
        def tids():
            return {int(t) for t in os.listdir("/proc/self/task")}
        def cpu_ns(ts):
            total = 0
            for t in ts:
                with open(f"/proc/self/task/{t}/schedstat") as f:
                    total += int(f.read().split()[0])
            return total
        import numpy as np
        blas_workers = tids() - {os.getpid()}
        import minigraph as mg
        from minigraph.kernels.cpu import blas_threads
        mg.set_num_threads(2)
        blas_threads.install()
        a = np.ones((512, 512), np.float32)
        a @ a
        time.sleep(1.0)                # OpenBLAS's workers spin ~0.1 s after loading
        before, calls = cpu_ns(blas_workers), blas_threads.calls()
        for _ in range(20):
            a @ a
        print(len(blas_workers), (cpu_ns(blas_workers) - before) / 1e6,
              blas_threads.calls() - calls, bool(blas_threads.installed()))
    """)
    workers, spent_ms, calls, installed = out.split()
    if installed != "True":
        pytest.skip("no OpenBLAS with a threads callback in a fresh interpreter")
    assert int(workers) >= 1
    assert int(calls) == 20
    assert float(spent_ms) < 2.0, f"OpenBLAS's own workers ran {spent_ms} ms"


@pytest.mark.parametrize("env", [{"MINIGRAPH_BLAS_POOL": "0"}, {"MINIGRAPH_NATIVE": "0"}])
def test_left_alone_where_switched_off(env):
    out = run_child("""
        import numpy as np
        import minigraph as mg
        from minigraph.kernels.cpu import blas_threads, relu_native, native
        native.library("relu_native")
        print(blas_threads.install(), "|", blas_threads.reason())
    """, env)
    paths, why = out.split("|")
    assert paths.strip() == "[]"
    assert "MINIGRAPH_BLAS_POOL or MINIGRAPH_NATIVE is off" in why


@needs_pool
def test_the_first_native_library_installs_it():
    out = run_child("""
        import minigraph as mg
        from minigraph.kernels.cpu import blas_threads, native
        before = blas_threads.installed()
        native.library("relu_native")
        print(before == [], bool(blas_threads.installed()))
    """)
    assert out.split() == ["True", "True"]


def test_without_an_openblas_callback_it_says_why(monkeypatch):
    if native.library("blas_pool") is None:
        pytest.skip("no native kernels here")
    monkeypatch.setattr(blas_threads, "_installed", {})
    monkeypatch.setattr(blas_threads, "_openblas_paths", lambda: [])
    assert blas_threads.install() == []
    assert "OpenBLAS" in blas_threads.reason()


def _product_in_child(queue):
    a = np.arange(300 * 300, dtype=np.float32).reshape(300, 300) / 1e5
    queue.put(bool(np.allclose(a @ a, a.astype(np.float64) @ a.astype(np.float64),
                               rtol=1e-4)))


@needs_pool
@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork")
def test_a_forked_child_runs_threaded_products():
    a = np.ones((300, 300), np.float32)
    with blocks.num_threads(2):
        a @ a                                       # the pool's workers are running
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_product_in_child, args=(queue,))
        child.start()
        child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("a product hung in the forked child")
    assert queue.get(timeout=5) is True


@needs_pool
def test_products_from_several_threads_at_once():
    rng = np.random.default_rng(1)
    mats = [rng.standard_normal((200, 200), dtype=np.float32) for _ in range(4)]
    want = [m @ m for m in mats]
    errors = []

    def work(i):
        for _ in range(20):
            if not np.array_equal(mats[i] @ mats[i], want[i]):
                errors.append(i)

    with blocks.num_threads(2):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
