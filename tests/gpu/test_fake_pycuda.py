"""The fake PyCUDA (tests/kernel_emulator/fake_pycuda.py, fake_memory.py) refuses
what PyCUDA and the driver refuse, read against PyCUDA's sources (src/cpp/cuda.hpp,
mempool.hpp, driver.py), so host-side code that would fail on a real GPU fails
its tests here:

- DeviceMemoryPool() and Event() need a current context (context_dependent:
  "no currently active context?"); a pool allocates only in its own context;
- Context.get_device() is static: it reads the current context, not `self`;
- a Context object belongs to the thread that retained it: an event or
  allocation of it destroyed on another thread while it is not current there
  is leaked with PyCUDA's warning, and detach() there releases nothing;
- after a sticky error every wait, launch and copy raises;
- prepared_async_call packs its arguments with struct's rules, and takes more than
  48 KiB of dynamic shared memory only after the function's
  MAX_DYNAMIC_SHARED_SIZE_BYTES attribute allows it (set_attribute, at most the
  device's opt-in);
- compile needs no context (given arch); module_from_buffer does;
- every fake GPU runs its kernels on one emulated device, made once whichever thread asks;
- ranks on threads that allocate at once each own what they allocated.
"""
from __future__ import annotations

import shutil
import struct
import threading
import time

import numpy as np
import pytest
from kernel_emulator import fake_pycuda
from kernel_emulator.fake_memory import FakeDriverError
from thread_helpers import all_right_from_threads, run_on_thread

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


@pytest.fixture
def cuda():
    fake = fake_pycuda.FakeCuda(devices=2)
    with fake.install():
        import pycuda.driver as drv

        drv.init()
        fake.drv = drv
        yield fake


def test_a_memory_pool_needs_a_context_and_allocates_only_in_it(cuda):
    from pycuda.tools import DeviceMemoryPool

    with pytest.raises(FakeDriverError, match="no currently active context"):
        DeviceMemoryPool()
    c0 = cuda.drv.Device(0).retain_primary_context()
    c1 = cuda.drv.Device(1).retain_primary_context()
    c0.push()
    pool = DeviceMemoryPool()
    pool.allocate(64)
    c1.push()
    with pytest.raises(FakeDriverError, match="DeviceMemoryPool of .*GPU 0.* with .*GPU 1"):
        pool.allocate(64)
    cuda.drv.Context.pop()
    cuda.drv.Context.pop()
    c0.detach()
    c1.detach()


def test_get_device_reads_the_current_context(cuda):
    c0 = cuda.drv.Device(0).retain_primary_context()
    c1 = cuda.drv.Device(1).retain_primary_context()
    with pytest.raises(FakeDriverError, match="cuCtxGetDevice"):
        c1.get_device()
    c0.push()
    assert c1.get_device().index == 0                    # not c1's device: the current one
    cuda.drv.Context.pop()
    c0.detach()
    c1.detach()


def test_objects_of_a_context_die_cleanly_only_where_it_can_be_made_current(cuda):
    ctx = cuda.drv.Device(0).retain_primary_context()    # owned by this thread
    ctx.push()
    events = [cuda.drv.Event() for _ in range(3)]
    cuda.drv.Context.pop()

    def drop_out_of_context():
        events.pop()                                     # not current, not the owner

    with pytest.warns(UserWarning, match="event in out-of-thread context could not be cleaned"):
        run_on_thread(drop_out_of_context, name="other")
    assert cuda.leaks == [("other", "event", 0)]

    def drop_in_context():
        ctx.push()
        events.pop()
        cuda.drv.Context.pop()
    run_on_thread(drop_in_context, name="other")
    events.pop()                                          # the owner thread: PyCUDA pushes it
    assert len(cuda.leaks) == 1 and cuda.counts["event_destroy"] == 2

    def detach_elsewhere():
        ctx.detach()
    run_on_thread(detach_elsewhere, name="other")
    assert cuda.devices[0].retains == 1                  # PyCUDA released nothing
    with pytest.raises(AssertionError, match="still retained"):
        cuda.check_clean()
    cuda.devices[0].retains = 0                          # the test's own clean-up


def test_events_need_a_context_and_a_sticky_error_raises_everywhere(cuda):
    with pytest.raises(FakeDriverError, match="no currently active context"):
        cuda.drv.Event()
    ctx = cuda.drv.Device(0).retain_primary_context()
    ctx.push()
    event = cuda.drv.Event(cuda.drv.event_flags.DISABLE_TIMING).record()
    event.synchronize()
    cuda.fail()
    for call in (event.synchronize, event.query, cuda.drv.Context.synchronize):
        with pytest.raises(FakeDriverError, match="illegal memory access"):
            call()
    cuda.fail(None)
    del event
    cuda.drv.Context.pop()
    ctx.detach()


def test_launches_pack_arguments_like_pycuda(cuda):
    import pycuda.compiler

    from minigraph.kernels.cuda import loader

    ctx = cuda.drv.Device(0).retain_primary_context()
    image = pycuda.compiler.compile(loader.read_source("fill"), arch="sm_90")  # no context
    with pytest.raises(FakeDriverError, match="cuModuleLoadData"):
        cuda.drv.module_from_buffer(image)
    ctx.push()
    fn = cuda.drv.module_from_buffer(image).get_function("fill_u32")
    fn.prepare("PqI")
    out = cuda.drv.Context.get_current()
    from pycuda.gpuarray import empty

    a = empty((8,), np.uint32)
    fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8, 7)
    np.testing.assert_array_equal(a.get(), np.full(8, 7))
    with pytest.raises(struct.error, match="not an integer"):
        fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8.0, 7)
    with pytest.raises(struct.error, match="fill_u32: argument 2"):
        fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8, -1)
    with pytest.raises(Exception, match=r"block \(2048, 1, 1\)"):
        fn.prepared_async_call((1, 1, 1), (2048, 1, 1), None, int(a.gpudata), 8, 7)
    assert out is ctx
    del a, fn
    cuda.drv.Context.pop()
    ctx.detach()


def test_dynamic_shared_memory_past_48_kib_needs_the_function_attribute(cuda):
    import pycuda.compiler

    from minigraph.kernels.cuda import loader

    ctx = cuda.drv.Device(0).retain_primary_context()
    ctx.push()
    image = pycuda.compiler.compile(loader.read_source("fill"), arch="sm_90")
    fn = cuda.drv.module_from_buffer(image).get_function("fill_u32")
    fn.prepare("PqI")
    from pycuda.gpuarray import empty

    a = empty((8,), np.uint32)
    fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8, 7,
                           shared_size=48 * 1024)
    with pytest.raises(FakeDriverError, match="49153 bytes of dynamic shared memory, more than "
                                              "the 49152"):
        fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8, 7,
                               shared_size=48 * 1024 + 1)
    attribute = cuda.drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES
    with pytest.raises(FakeDriverError, match="more than the device's opt-in"):
        fn.set_attribute(attribute, 228 * 1024)
    fn.set_attribute(attribute, 200 * 1024)
    fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8, 7,
                           shared_size=200 * 1024)
    with pytest.raises(FakeDriverError, match="more than the 204800"):
        fn.prepared_async_call((1, 1, 1), (32, 1, 1), None, int(a.gpudata), 8, 7,
                               shared_size=200 * 1024 + 4)
    np.testing.assert_array_equal(a.get(), np.full(8, 7))
    assert cuda.counts["set_attribute"] == 1
    del a, fn
    cuda.drv.Context.pop()
    ctx.detach()


def test_ranks_on_threads_share_one_emulated_device(monkeypatch):
    """Ranks asking for the emulator at once get one backend, so a kernel library is
    loaded once (a second load resets the runtime's shared memory table). The backend
    is made slowly here, so threads that checked before it was made would make their own."""
    import kernel_emulator

    class SlowBackend(kernel_emulator.EmuBackend):
        def __init__(self, **kwargs):
            time.sleep(0.05)
            super().__init__(**kwargs)

    monkeypatch.setattr(kernel_emulator, "EmuBackend", SlowBackend)
    fake, made = fake_pycuda.FakeCuda(devices=2), []

    def ask():
        made.append(fake.emulator())        # kept: a freed backend's id could come again
        return True

    assert all_right_from_threads(ask, threads=8, calls=1)
    assert len(made) == 8 and all(b is made[0] for b in made)


def test_two_ranks_allocating_at_once_keep_their_memory_apart(cuda):
    """The driver's table of which context owns an address stays sorted when ranks on
    threads allocate at once (insort is not atomic): every address names its own GPU."""
    from pycuda.tools import DeviceMemoryPool

    start, wrong = threading.Barrier(2, timeout=60), {}

    def rank(index):
        ctx = cuda.drv.Device(index).retain_primary_context()
        ctx.push()
        pool = DeviceMemoryPool()
        start.wait()
        blocks = [pool.allocate(64) for _ in range(5000)]
        wrong[index] = sum(cuda.owner(int(b)) is not ctx for b in blocks)
        del blocks
        pool.stop_holding()
        cuda.drv.Context.pop()
        ctx.detach()

    threads = [threading.Thread(target=rank, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert wrong == {0: 0, 1: 0}
