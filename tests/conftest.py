"""Shared fixtures: the GPU places every GPU test runs on, arrays on them, a world of one
(one_rank) or of none (no_comm) for the distributed tests, and the one
sys.path entry that lets every test (tests/ and tests/gpu/) import helpers,
references, kernel_emulator and mpi_scripts by name."""
from __future__ import annotations

import pathlib
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import kernel_emulator  # noqa: E402

# `pytest -m quick`: the core (scopes, operators, the net and its fork, the runner,
# backward, batch norm, layers, optimizers, checkpoints, folding, inference models,
# ONNX, the layer view) in under a minute on two cores; the whole suite is `pytest`.
QUICK = ("test_scope", "test_operator", "test_schema", "test_net", "test_executor",
         "test_backward", "test_batch_norm", "test_batch_norm_grad", "test_layers",
         "test_optimizer", "test_io", "test_io_contents", "test_fold_bn", "test_journal",
         "test_feeds", "test_layer_norm", "test_inference_model", "test_inference_model_atomic",
         "test_onnx_export", "test_render_layers")


def pytest_configure(config):
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE), every process a test
    starts (the CLI, ranks, probes, examples) would compile minigraph's ~270 modules
    again, about a second each: compile them once, into their __pycache__ as Python
    does by default, in the process that starts the run (not in each xdist worker)."""
    if not sys.dont_write_bytecode or hasattr(config, "workerinput"):
        return
    import compileall

    import minigraph.examples
    import minigraph.kernels
    import minigraph.ops

    for package in (minigraph, minigraph.ops, minigraph.kernels, minigraph.examples):
        for path in package.__path__:
            compileall.compile_dir(path, quiet=2)


def pytest_collection_modifyitems(items):
    """Mark the tests of the QUICK modules `quick`."""
    for item in items:
        if item.path.stem in QUICK:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(autouse=True)
def calm_cores(monkeypatch):
    """Training steps never count the cores contended (minigraph.op_threads.contended):
    what a test checks must not depend on what else the machine runs (pytest's other
    workers). test_op_threads.py sets it where it tests those steps, and
    test_native_pool.py tests the pool's own watch in a process of its own."""
    from minigraph import op_threads

    monkeypatch.setattr(op_threads, "contended", lambda: False)


DEVICES = ["emulated", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(scope="session")
def gpu_place():
    """mg.GPUPlace(0), or skip the test with the reason no GPU can be used here."""
    import minigraph as mg

    try:
        return mg.GPUPlace(0)
    except mg.GPUError as e:
        pytest.skip(str(e))


@pytest.fixture(params=DEVICES)
def device_place(request):
    """A GPU place: the CPU emulator's EmuPlace (the real .cu kernels compiled with
    g++; skipped without g++), or GPUPlace(0) (marked gpu; skipped without one)."""
    from minigraph import device

    if request.param == "gpu":
        gpu = request.getfixturevalue("gpu_place")
        old = device.use_backend(None)
        yield gpu
        device.use_backend(old)
        return
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernel emulator")
    with kernel_emulator.emulated_gpu() as emu:
        yield emu


class DeviceArrays:
    """numpy arrays onto and off a GPU place's device, for tests that call the
    launchers in minigraph.kernels directly (no Executor)."""

    def __init__(self, place):
        self.place = place
        self.emulated = isinstance(place, kernel_emulator.EmuPlace)

    def put(self, a, offset=0):
        """A C-contiguous device copy of numpy `a`; `offset` elements past an aligned
        start (to test unaligned data)."""
        a = np.require(a, requirements="C")
        if self.emulated:
            return kernel_emulator.to_device(a, offset=offset)
        import pycuda.gpuarray as gpuarray

        if not offset:
            return gpuarray.to_gpu(a)
        flat = gpuarray.to_gpu(np.concatenate([np.zeros(offset, a.dtype), a.ravel()]))
        return flat[offset:].reshape(a.shape)

    def get(self, a):
        """A numpy copy of device array `a`."""
        return a.get()


@pytest.fixture
def device(device_place):
    """Arrays on `device_place` (the emulator, or a real GPU marked gpu) for the
    launcher tests: device.put(numpy, offset=0), device.get(array), device.emulated."""
    return DeviceArrays(device_place)


@pytest.fixture
def force_splits(monkeypatch):
    """Let small tensors split one channel over many blocks (exercises the last-block
    merges)."""
    from minigraph.kernels.cuda import launch

    monkeypatch.setattr(launch, "MIN_UNITS_PER_THREAD", 1)


@pytest.fixture(params=["native", "numpy"])
def cpu_engine(request, monkeypatch):
    """The CPU engine the conv ops run float32 on: the native kernels (skipped where
    they cannot be built here) or conv_cpu's numpy engine (MINIGRAPH_NATIVE=0)."""
    from minigraph.kernels.cpu import conv_native, native

    if request.param == "numpy":
        monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    elif not conv_native.available():
        pytest.skip(f"native kernels not built: {native.reason('conv_native')}")
    return request.param


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """An empty cache directory (its path) and no timed kernel choices held by this
    process (kernels/cpu/choices.py), none forced; no choices held afterwards either."""
    from minigraph.kernels.cpu import choices

    monkeypatch.setenv("MINIGRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(choices.ENV, raising=False)
    choices.forget()
    yield tmp_path / "cache"
    choices.forget()


@pytest.fixture
def one_rank(monkeypatch):
    """A world of one: a LocalComm as the current communicator."""
    import minigraph as mg
    from minigraph.distributed import world
    from minigraph.distributed.comm import LocalComm

    comm = LocalComm(mg.CPUPlace())
    monkeypatch.setattr(world, "_comm", comm)
    return comm


@pytest.fixture
def no_comm(monkeypatch):
    """No communicator yet (before init)."""
    from minigraph.distributed import world

    monkeypatch.setattr(world, "_comm", None)
