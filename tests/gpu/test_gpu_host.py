"""The host side of the GPU path, on a fake PyCUDA driver (no GPU needed).

tests/kernel_emulator/fake_pycuda.py keeps per-thread context stacks and
primary-context retain counts, and rejects what the driver would: work with
no context current, a kernel launched outside the context its module was
loaded in, a pointer of another device's memory. Kernels run on the CPU
emulator, so results are checked too.

- exit: every context stack is empty and every primary context released, in
  the driver's order (synchronize, drop loader state and pool, pop, detach);
- contexts and threads: launches, allocations and copies run in their place's
  context; a second thread trains a net; two GPUs in one process each run
  their own kernels, with their own loader state; no silent guess between two;
- the toolkit is checked against the driver before the first compile;
- a broken pycuda is reported as broken, not as missing;
- launchers reject arrays that are not C-contiguous, naming them;
- host speed: launch plans are memoised; feeds and temporaries come from the
  pool (no allocation or free per step once warm).
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading

import kernel_emulator
import numpy as np
import pytest
from kernel_emulator import fake_pycuda
from op_harness import batches, small_net
from references import pool2d_grad

import minigraph as mg
from minigraph import device
from minigraph import place as mg_place
from minigraph.kernels.cuda import backend as cuda_backend
from minigraph.kernels.cuda import launch, loader

TESTS = pathlib.Path(__file__).parents[1]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


@pytest.fixture
def fake():
    cuda = fake_pycuda.FakeCuda(devices=2)
    with cuda.install():
        yield cuda


def train(net, loss, feeds):
    return [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds]


# ---- item 1: nothing left pushed at exit -----------------------------------------------

EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading
    sys.path.insert(0, {tests!r})
    import numpy as np
    from kernel_emulator import fake_pycuda
    fake = fake_pycuda.FakeCuda(devices=2)

    def verify():                     # registered first: runs after minigraph's hook
        try:
            fake.check_clean()
        except AssertionError as e:
            print("NOT CLEAN:", e, flush=True)
            os._exit(3)
        print("LOG", [e for e in fake.log if e[1] != "push" or e[0] == "MainThread"][-12:])
        print("CLEAN", dict(fake.counts), flush=True)

    atexit.register(verify)
    installed = fake.install()       # stays installed until the process ends
    installed.__enter__()
    import minigraph as mg
    from minigraph.kernels.cuda import elementwise
    p0, p1 = mg.GPUPlace(0), mg.GPUPlace(1)
    for p in (p0, p1):
        with p.activate():
            a = p.to_device(np.ones(5))
            assert np.array_equal(p.to_host(elementwise.add(a, a)), np.full(5, 2.0))
    def worker():
        with p1.activate():
            b = p1.to_device(np.arange(3.0))
            elementwise.add(b, b)
    t = threading.Thread(target=worker, name="worker")
    t.start(); t.join()
""")


def test_exit_pops_and_releases_every_context_in_order():
    script = EXIT_SCRIPT.format(tests=str(TESTS))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CLEAN" in done.stdout, done.stdout
    log = eval(done.stdout.split("LOG ", 1)[1].split("\n", 1)[0])   # noqa: S307 (our own repr)
    main = [(what, dev) for thread, what, dev in log if thread == "MainThread"]
    # per device, the last made first: push, synchronize, drop loader state and give the
    # pool back, pop; then the main thread's standing push; then detach each
    assert main[-11:] == [("push", 1), ("synchronize", 1), ("free_pool", 1), ("pop", 1),
                          ("push", 0), ("synchronize", 0), ("free_pool", 0), ("pop", 0),
                          ("pop", 0), ("detach", 0), ("detach", 1)], main


def test_release_gpus_drops_the_loader_state(fake):
    p = mg.GPUPlace(0)
    with p.activate():
        p.to_host(p.to_device(np.ones(3)))
        state = device.current()
    assert state in device.backend()._states.values()
    mg_place.release_gpus()
    assert not device.backend()._states and not device.places
    assert state.kernels == {} and state.flags == {} and state.cache == {}
    fake.check_clean()
    mg_place.release_gpus()                                 # a second call does nothing
    assert mg.GPUPlace(0).context.retains == 1              # a new place retains afresh


# ---- item 2: contexts and threads ------------------------------------------------------

def test_a_net_runs_in_its_context_and_leaves_the_stack_as_found(fake):
    place = mg.GPUPlace(0)
    net, _, loss = small_net(place, mg.optimizer.SGD(learning_rate=0.1))
    losses = train(net, loss, batches(2))
    cpu_net, _, cpu_loss = small_net(mg.CPUPlace(), mg.optimizer.SGD(learning_rate=0.1))
    np.testing.assert_allclose(losses, train(cpu_net, cpu_loss, batches(2)), rtol=1e-4)
    assert fake.stack() == [place.context]          # only the main thread's standing push
    assert fake.counts["launch"] > 10               # every one checked by the fake driver


def test_a_second_thread_trains_a_net(fake):
    place = mg.GPUPlace(0)
    out = {}

    def worker():
        try:
            net, _, loss = small_net(place, mg.optimizer.SGD(learning_rate=0.1))
            out["losses"] = train(net, loss, batches(2))
            out["stack"] = list(fake.stack())
        except Exception as e:  # reported below, in the test's thread
            out["error"] = e

    t = threading.Thread(target=worker, name="worker")
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert out["stack"] == []                       # nothing left pushed on the worker
    net, _, loss = small_net(place, mg.optimizer.SGD(learning_rate=0.1))
    np.testing.assert_allclose(out["losses"], train(net, loss, batches(2)), rtol=1e-6)


def test_two_gpus_in_one_process_each_run_their_own_kernels(fake):
    places = [mg.GPUPlace(0), mg.GPUPlace(1)]
    runs = []
    for p in places:
        with p.activate():
            net, _, loss = small_net(p, mg.optimizer.SGD(learning_rate=0.1))
            runs.append(train(net, loss, batches(2)))
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6)
    states = device.backend()._states
    assert set(states) == {p.context for p in places}
    for p in places:
        s = states[p.context]
        assert s.kernels and all(k.state is s for k in s.kernels.values())
        assert s.pool is not states[places[1 - p.device_id].context].pool
    compiled = [d for _, what, d in fake.log if what == "push"]
    assert 0 in compiled and 1 in compiled


def test_nets_on_two_gpus_train_in_turn_without_activating_by_hand(fake):
    """Net.train/infer and Executor.run activate their place for the whole step."""
    nets = [small_net(mg.GPUPlace(i), mg.optimizer.SGD(learning_rate=0.1)) for i in (0, 1)]
    losses = [[], []]
    for feed in batches(3):
        for i, (net, _, loss) in enumerate(nets):
            (value,) = net.train(feed=feed, fetch=[loss])
            losses[i].append(float(value))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert fake.stack() == [nets[0][0].place.context]   # only the main thread's first place


def test_two_gpus_and_no_active_place_is_an_error_not_a_guess(fake):
    from minigraph.kernels.cuda import elementwise

    p0, p1 = mg.GPUPlace(0), mg.GPUPlace(1)
    x = p0.to_device(np.ones(4))
    with pytest.raises(mg.GPUError, match=r"2 GPU places .* none is active on this thread"):
        elementwise.add(x, x)
    with p1.activate(), p0.activate():                 # nested: the innermost wins
        assert np.array_equal(p0.to_host(elementwise.add(x, x)), np.full(4, 2.0))


def test_activate_nests_without_pushing_again(fake):
    p = mg.GPUPlace(0)
    with p.activate():                      # the device state is made (its own push) once
        pass
    before = fake.counts["push"]
    with p.activate(), p.activate(), p.activate():
        p.to_host(p.to_device(np.ones(2)))
    assert fake.counts["push"] - before == 1
    assert mg.CPUPlace().activate().__enter__() is None


# ---- item 4: the toolkit against the driver -------------------------------------------

def fake_nvcc(tmp_path, release):
    bin_dir = tmp_path / f"cuda-{release}" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("driver,release,ok", [
    (12040, "13.0", False), (13000, "13.0", True), (12040, "12.8", True),
    (12040, "12.2", True), (11080, "12.0", False)])
def test_toolkit_newer_than_the_driver_is_refused(tmp_path, monkeypatch, driver, release, ok):
    monkeypatch.setenv("PATH", str(fake_nvcc(tmp_path, release)))
    if ok:
        assert cuda_backend.check_toolkit(driver).endswith("nvcc")
        return
    with pytest.raises(mg.GPUError) as e:
        cuda_backend.check_toolkit(driver)
    major = driver // 1000
    for words in (f"CUDA {release}", f"CUDA {major}.{driver % 1000 // 10}",
                  f"Put a CUDA {major}.x toolkit first on PATH", "CUDA_ROOT"):
        assert words in str(e.value)


def test_no_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(mg.GPUError, match=r"`nvcc` is not on PATH.*CUDA 12.4 or older"):
        cuda_backend.check_toolkit(12040)


def test_the_check_runs_before_the_first_compile(tmp_path, monkeypatch):
    from minigraph.kernels.cuda import elementwise

    cuda = fake_pycuda.FakeCuda(devices=1, driver_version=12040)
    with cuda.install():
        monkeypatch.setattr(cuda_backend, "check_toolkit", cuda.real_check_toolkit)
        monkeypatch.setenv("PATH", str(fake_nvcc(tmp_path, "13.0")))
        p = mg.GPUPlace(0)
        x = p.to_device(np.ones(3))
        with pytest.raises(mg.GPUError, match=r"CUDA 13.0\) is newer than the driver"):
            elementwise.add(x, x)
        assert cuda.counts["compile"] == 0


# ---- item 6: a broken pycuda; arrays that are not contiguous -------------------------

@pytest.mark.parametrize("error,words", [
    ("ImportError('/x/pycuda/_driver.so: undefined symbol: cuMemFree_v2', "
     "name='pycuda._driver')", "pycuda is installed but broken"),
    ("ImportError('libcuda.so.1: cannot open shared object file', name='pycuda._driver')",
     "the CUDA driver could not be loaded"),
    ("ModuleNotFoundError(\"No module named 'pytools'\", name='pytools')",
     "pycuda is installed but broken")])
def test_a_broken_pycuda_is_not_reported_as_missing(tmp_path, monkeypatch, error, words):
    pkg = tmp_path / "pycuda"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "driver.py").write_text(f"raise {error}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "pycuda" or m.startswith("pycuda.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(mg.GPUError, match=words):
        mg.GPUPlace(0)


def test_missing_pycuda_is_reported_as_not_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pycuda" else real(name, *a))
    monkeypatch.setitem(sys.modules, "pycuda", None)        # import pycuda -> ImportError
    monkeypatch.delitem(sys.modules, "pycuda.driver", raising=False)
    with pytest.raises(mg.GPUError, match=r"pycuda is not installed \(pip install"):
        mg.GPUPlace(0)


def test_launchers_reject_arrays_that_are_not_contiguous():
    from minigraph.kernels.cuda import batch_norm, elementwise

    with kernel_emulator.emulated_gpu():
        x = kernel_emulator.to_device(np.ones((4, 3), np.float32))
        strided = kernel_emulator.to_device(np.ones((4, 3), np.float32))
        strided.flags.c_contiguous = False
        with pytest.raises(ValueError, match=r"elementwise_add: y: a float32\(4, 3\) .* not C-"):
            elementwise.add(x, strided)
        with pytest.raises(ValueError, match=r"copy_\{t\}_w\{w\}: array 1: .* not C-contiguous"):
            loader.launch_flat("elementwise", elementwise.SIGNATURES, "copy_{t}_w{w}",
                               np.float32, 12, (x, strided), 12)
        c = kernel_emulator.to_device(np.ones(3, np.float32))
        with pytest.raises(ValueError, match=r"batch_norm: x: a float32\(4, 3\) .* strides"):
            batch_norm.forward_infer(strided, c, c, c, c, 1e-5)
        with pytest.raises(ValueError, match=r"batch_norm: 'scale': .* not C-contiguous"):
            bad = kernel_emulator.to_device(np.ones(3, np.float32))
            bad.flags.c_contiguous = False
            batch_norm.forward_infer(x, bad, c, c, c, 1e-5)


# ---- item 5: host speed ----------------------------------------------------------------

def test_launch_plans_are_computed_once_per_shape(monkeypatch):
    from minigraph.kernels.cuda import batch_norm, batch_norm_grad

    calls = []
    real = launch.best_splits
    monkeypatch.setattr(launch, "best_splits", lambda *a: calls.append(a) or real(*a))
    launch._plans.clear()
    with kernel_emulator.emulated_gpu():
        x = kernel_emulator.to_device(np.random.default_rng(0).standard_normal((6, 3, 4, 4)))
        p = [kernel_emulator.to_device(v) for v in (np.ones(3), np.zeros(3), np.zeros(3),
                                                    np.ones(3))]
        counter = kernel_emulator.to_device(np.array(0, np.int64))
        batch_norm.forward_train(x, *p, counter, 0.9, 1e-5)
        first = len(calls)
        assert first >= 1
        for _ in range(3):
            batch_norm.forward_train(x, *p, counter, 0.9, 1e-5)
            batch_norm_grad.backward(x, x, p[0], p[2], p[3], 1e-5)
        backward_plans = len(calls) - first
        batch_norm_grad.backward(x, x, p[0], p[2], p[3], 1e-5)
        assert len(calls) - first == backward_plans <= 2


def test_feeds_and_temporaries_come_from_the_pool(fake):
    place = mg.GPUPlace(0)
    net, _, loss = small_net(place, mg.optimizer.Momentum(learning_rate=0.05))
    feeds = batches(8)
    train(net, loss, feeds[:5])     # warm-up fills the pool; the plan's CUDA graph takes its
    before = dict(fake.counts)      # own blocks once, keeping the feeds it was captured with
    train(net, loss, feeds[5:])
    grew = {k: fake.counts[k] - before.get(k, 0) for k in ("mem_alloc", "mem_free")}
    assert grew == {"mem_alloc": 0, "mem_free": 0}, grew
    assert fake.counts["htod"] - before.get("htod", 0) == 2 * 3        # the feeds, only


@pytest.mark.skipif(os.environ.get("MINIGRAPH_NO_PLAN_TIMING") == "1", reason="opted out")
def test_a_cached_plan_costs_microseconds():
    import time

    dev = launch.DeviceInfo(name="h100", compute_capability=(9, 0), sm_count=132)
    launch._plans.clear()
    launch.reduce_plan(32 * 56 * 56, 256, 1, 4, True, dev)
    start = time.perf_counter()
    for _ in range(1000):
        launch.reduce_plan(32 * 56 * 56, 256, 1, 4, True, dev)
    assert (time.perf_counter() - start) / 1000 < 50e-6


# ---- item 6: max-pool backward is deterministic ----------------------------------------

def test_max_pool_grad_gathers_without_atomics_or_a_zero_fill(monkeypatch):
    """Overlapping 3x3 windows, stride 1, on data full of ties: the kernel writes every
    element of dx itself (no zero-fill first: the emulator's fresh arrays are NaN),
    sums in a fixed window order (no atomicAdd), so grids of any size give the same
    bits, and the first maximum of each window gets its gradient."""
    from minigraph.kernels.cuda import fill, pool2d

    assert "atomicAdd" not in (loader.kernel_dir() / "pool2d.cu").read_text()
    monkeypatch.setattr(fill, "fill_constant", lambda *a: pytest.fail("dx was zero-filled"))
    rng = np.random.default_rng(5)
    x = rng.integers(0, 3, size=(2, 3, 9, 8)).astype(np.float32)
    d = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    runs = []
    for sm_count, seed in ((1, 1), (3, 7), (16, 2)):
        monkeypatch.setattr(device, "_backend", kernel_emulator.EmuBackend(sm_count, seed))
        dx = pool2d.pool2d_grad(kernel_emulator.to_device(x), kernel_emulator.to_device(d),
                                "max", (3, 3), (1, 1), (0, 0))
        runs.append(dx.get())
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)
    want = pool2d_grad(x, d, "max", (3, 3), (1, 1), (0, 0))
    np.testing.assert_allclose(runs[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call,words", [
    (lambda k, a, b: k["elementwise"].add(a, b), "elementwise_add: y"),
    (lambda k, a, b: k["elementwise"].copy(b), "copy: src"),
    (lambda k, a, b: k["matmul"].matmul(a, b), "matmul: b"),
    (lambda k, a, b: k["mean"].mean(b), "mean: x"),
    (lambda k, a, b: k["elementwise"].copy(a, out=b), "copy: out"),
    (lambda k, a, b: k["collective"].pack([a, b]), r"pack \(array 1\)")])
def test_each_launcher_names_the_array_that_is_not_contiguous(call, words):
    import importlib

    mods = {m: importlib.import_module(f"minigraph.kernels.cuda.{m}")
            for m in ("elementwise", "matmul", "mean", "collective")}
    with kernel_emulator.emulated_gpu():
        a = kernel_emulator.to_device(np.ones((3, 3), np.float32))
        b = kernel_emulator.to_device(np.ones((3, 3), np.float32))
        b.flags.c_contiguous = False
        with pytest.raises(ValueError, match=rf"{words}: a float32.* not C-contiguous"):
            call(mods, a, b)
