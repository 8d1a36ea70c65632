"""kernels/cuda/backend.py (the PyCUDA backend) on the fake driver, for what the GPU
pre-flight review found it would do on its first real run:

- finding 1: a device's state (its memory pool and DeviceInfo) is built with that
  device's context pushed - PyCUDA's DeviceMemoryPool binds to the current context
  and raises with none, and Context.get_device() reads the current context - so a
  place first used on a worker thread works, and a second GPU gets its own pool
  and its own device description;
- finding 7: each kernel module is compiled once per process and architecture
  (PyCUDA's compile runs nvcc's preprocessor on every call, cache hit or not) and
  loaded once per context, whatever backend or test asks for it.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from kernel_emulator import fake_pycuda
from thread_helpers import run_on_thread

import minigraph as mg
from minigraph import device

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


@pytest.fixture
def fake():
    cuda = fake_pycuda.FakeCuda(devices=2)
    with cuda.install():
        yield cuda


def test_a_place_made_and_first_used_on_a_worker_thread(fake):
    def work():
        place = mg.GPUPlace(0)                     # nothing is current on this thread
        got = place.to_host(place.to_device(np.arange(4.0)))
        return got, list(fake.stack())
    got, stack = run_on_thread(work)
    np.testing.assert_array_equal(got, np.arange(4.0))
    assert stack == []


def test_a_place_made_on_the_main_thread_first_used_on_a_worker(fake):
    from minigraph.kernels.cuda import elementwise

    place = mg.GPUPlace(0)

    def work():
        with place.activate():
            x = place.to_device(np.ones(5))
            return place.to_host(elementwise.add(x, x))
    np.testing.assert_array_equal(run_on_thread(work), np.full(5, 2.0))
    assert fake.leaks == []


def test_the_second_gpu_gets_its_own_pool_and_device_info(fake):
    from minigraph.kernels.cuda import elementwise

    p0, p1 = mg.GPUPlace(0), mg.GPUPlace(1)          # GPU 0's context stays current here
    for p in (p1, p0):
        with p.activate():
            x = p.to_device(np.arange(3.0))
            np.testing.assert_array_equal(p.to_host(elementwise.add(x, x)), np.arange(3.0) * 2)
    states = device.backend()._states
    assert states[p1.context].info.name == "fake GPU 1"
    assert states[p0.context].info.name == "fake GPU 0"
    assert states[p1.context].pool.ctx is p1.context
    assert fake.stack() == [p0.context]              # the standing push, nothing more


def test_each_module_is_compiled_once_per_process_and_loaded_per_context(fake):
    from minigraph.kernels.cuda import elementwise

    p0, p1 = mg.GPUPlace(0), mg.GPUPlace(1)

    def add_on(place):
        with place.activate():
            x = place.to_device(np.ones(8, np.float32))
            return place.to_host(elementwise.add(x, x))
    add_on(p0)
    add_on(p1)
    for _ in range(2):                              # what each GPU test's fixture does
        device.use_backend(None)
        add_on(p0)
    assert fake.compiled["elementwise"] == 1, fake.compiled
    assert fake.counts["module_load"] == 4          # per context, per backend
    assert fake.counts["check_toolkit"] == 1        # checked before the one compile


def test_a_compile_error_is_not_cached(fake, monkeypatch):
    from minigraph.kernels.cuda import elementwise

    calls = []

    def broken(source, **kw):
        calls.append(kw)
        raise RuntimeError("nvcc: boom")
    import pycuda.compiler

    monkeypatch.setattr(pycuda.compiler, "compile", broken)
    p = mg.GPUPlace(0)
    x = p.to_device(np.ones(3))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="nvcc: boom"):
            elementwise.add(x, x)
    assert len(calls) == 2 and calls[0]["arch"] == "sm_90" and calls[0]["no_extern_c"]
