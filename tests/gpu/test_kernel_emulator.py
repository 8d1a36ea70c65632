"""The kernel emulator (tests/kernel_emulator) refuses what a GPU or PyCUDA refuses,
so a kernel or launcher bug that a real device would show cannot pass the tests:

- arguments are packed with PyCUDA's rules (a float for an int parameter, or a
  value out of range, is struct.error naming the kernel and the argument);
- grids and blocks beyond the hardware's limits are refused;
- a misaligned access (a 16-byte pack off a 16-byte boundary) fails the launch;
- a block's static shared memory is measured and limited, and starts poisoned
  (shared memory is uninitialised on a GPU: nothing carries over between blocks);
- dynamic shared memory counts against the same 48 KiB unless the kernel's
  MAX_DYNAMIC_SHARED_SIZE_BYTES attribute was raised (then up to it, and 227 KiB
  with the static part); it starts poisoned too, and a write past it fails the
  launch;
- blocks run in an order shuffled by the launch's seed;
- launches from two threads (ranks) run one at a time, and not while their library is
  loaded again, as the runtime's state is one.

Probe kernels are compiled from a source written here; the real ones from kernels/cuda.
"""
from __future__ import annotations

import shutil
import struct
import threading
import time

import kernel_emulator
import numpy as np
import pytest
from kernel_emulator import EmuArray, EmuKernel, EmulatorError, to_device
from thread_helpers import all_right_from_threads, run_in_forked_child

from minigraph.kernels.cuda import loader

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")

PROBES = r"""
extern "C" __global__ void probe_order(unsigned* order, unsigned* counter) {
  if (threadIdx.x == 0) order[atomicAdd(counter, 1u)] = blockIdx.x;
}
extern "C" __global__ void probe_shared_read(float* out) {
  __shared__ float cell[32];
  if (blockIdx.x == 0) cell[threadIdx.x] = 1.0f;     // only block 0 writes it
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = cell[threadIdx.x];
}
extern "C" __global__ void probe_big_shared(float* out) {
  __shared__ float big[16384];                        // 64 KiB: more than a block may have
  big[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = big[threadIdx.x];
}
extern "C" __global__ void probe_load4(const float* in, float* out) {
  struct alignas(16) F4 { float v[4]; };
  out[threadIdx.x] = reinterpret_cast<const F4*>(in)[threadIdx.x].v[0];
}
#include "common.cuh"
// each thread writes `count` floats of dynamic shared memory from `start`, then reads
// back its first (a block-wide sum of the first 32 through async copies of `in`)
extern "C" __global__ void probe_dynamic(const float* in, float* out, int start, int count) {
  float* dyn = mg::dynamic_shared<float>();
  if (threadIdx.x == 0) out[blockIdx.x * 2 + 1] = dyn[0];       // poisoned: NaN
  __syncthreads();
  for (int i = threadIdx.x; i < count; i += blockDim.x) dyn[start + i] = 1.0f;
  mg::async_copy<16>(dyn + 4 * threadIdx.x, in + 4 * threadIdx.x);
  mg::async_commit();
  mg::async_wait_prior<0>();
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int i = 0; i < 4 * 32; ++i) s += dyn[i];
    out[blockIdx.x * 2] = s;
  }
}
"""
SIGNATURES = {"probe_order": "PP", "probe_shared_read": "P", "probe_big_shared": "P",
              "probe_load4": "PP", "probe_dynamic": "PPii"}


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    kdir = tmp_path_factory.mktemp("probes")
    (kdir / "probes.cu").write_text(PROBES)
    (kdir / "common.cuh").write_text((loader.kernel_dir() / "common.cuh").read_text())
    lib = kernel_emulator.load(kernel_emulator.build("probes", SIGNATURES, kdir=kdir))

    def probe(name, seed=1):
        return EmuKernel(lib, name, SIGNATURES[name], [seed])

    probe.kdir = kdir
    return probe


# ---- argument packing (PyCUDA's struct rules) ---------------------------------------------

@pytest.mark.parametrize("fmt,value,words", [
    ("q", 8.0, "required argument is not an integer"),
    ("i", 2**31, "out of range|requires"),
    ("I", -1, "out of range|requires"),
    ("i", np.float32(3), "required argument is not an integer"),
    ("d", "1.0", "required argument is not a float")])
def test_arguments_are_packed_with_pycudas_rules(fmt, value, words):
    with pytest.raises(struct.error, match=rf"kern: argument 1 \({fmt!r}\) = .*({words})"):
        kernel_emulator.pack_args("kern", "P" + fmt, (0, value))


def test_what_pycuda_accepts_arrives_unchanged():
    got = kernel_emulator.pack_args("kern", "PqiIdf", (16, np.int64(-3), np.int32(7), True,
                                                       np.float32(0.5), 1))
    assert got == [16, -3, 7, 1, 0.5, 1.0]
    assert kernel_emulator.pack_args("kern", "f", (0.1,))[0] == float(np.float32(0.1))


def test_a_launcher_passing_a_float_for_an_int_fails_like_pycuda(device_place):
    if not isinstance(device_place, kernel_emulator.EmuPlace):
        pytest.skip("the emulator's own check")
    a, b = to_device(np.ones(8, np.float32)), EmuArray((8,), np.float32)
    k = loader.kernel("elementwise", "copy_f32_w1", "PPq")
    with pytest.raises(struct.error, match=r"copy_f32_w1: argument 2 \('q'\) = 8.0"):
        k.launch((1, 1, 1), (32, 1, 1), a.gpudata, b.gpudata, 8.0)
    k.launch((1, 1, 1), (32, 1, 1), a.gpudata, b.gpudata, 8)
    np.testing.assert_array_equal(b.get(), np.ones(8))


# ---- launch geometry -------------------------------------------------------------------

@pytest.mark.parametrize("grid,block,words", [
    ((1, 65536, 1), (32, 1, 1), r"grid \(1, 65536, 1\)"),
    ((1, 1, 65536), (32, 1, 1), r"grid \(1, 1, 65536\)"),
    ((2**31, 1, 1), (32, 1, 1), r"grid"),
    ((1, 1, 1), (2048, 1, 1), r"block \(2048, 1, 1\)"),
    ((1, 1, 1), (32, 1, 65), r"block \(32, 1, 65\)"),
    ((1, 1, 1), (64, 32, 1), r"2048 threads, more than 1024")])
def test_grids_and_blocks_beyond_the_hardware_are_refused(grid, block, words):
    with pytest.raises(EmulatorError, match=words):
        kernel_emulator.check_geometry("kern", grid, block)


def test_the_runtime_refuses_a_block_that_is_not_whole_warps(probes):
    out = EmuArray((48,), np.float32)
    with pytest.raises(EmulatorError, match=r"block \(48, 1, 1\) of 48 threads"):
        probes("probe_shared_read")((1, 1, 1), (48, 1, 1), (out.gpudata,))


# ---- alignment -----------------------------------------------------------------------------

def test_a_misaligned_vector_load_fails_the_launch(probes):
    out = EmuArray((32,), np.float32)
    k = probes("probe_load4")
    aligned = to_device(np.arange(128, dtype=np.float32))
    k((1, 1, 1), (32, 1, 1), (aligned.gpudata, out.gpudata))
    np.testing.assert_array_equal(out.get(), np.arange(0, 128, 4))
    shifted = to_device(np.arange(129, dtype=np.float32), offset=1)
    with pytest.raises(EmulatorError, match=r"misaligned 16-byte access .* at .*probes.cu:\d+.* "
                                            r"4 bytes past a 16-byte boundary"):
        k((1, 1, 1), (32, 1, 1), (shifted.gpudata, out.gpudata))


def test_a_real_pack_kernel_on_unaligned_data_fails(device_place):
    if not isinstance(device_place, kernel_emulator.EmuPlace):
        pytest.skip("the emulator's own check")
    src = to_device(np.arange(8, dtype=np.float32), offset=1)
    dst = EmuArray((8,), np.float32)
    k = loader.kernel("elementwise", "copy_f32_w4", "PPq")
    with pytest.raises(EmulatorError, match=r"copy_f32_w4: misaligned 16-byte access .* at "
                                            r".*common.cuh"):
        k.launch((1, 1, 1), (32, 1, 1), src.gpudata, dst.gpudata, 8)


# ---- shared memory and block order ----------------------------------------------------------

def test_shared_memory_starts_poisoned_in_every_block(probes):
    out = EmuArray((8 * 32,), np.float32)
    probes("probe_shared_read")((8, 1, 1), (32, 1, 1), (out.gpudata,))
    got = out.get().reshape(8, 32)
    np.testing.assert_array_equal(got[0], np.ones(32))         # block 0 wrote its own
    assert np.isnan(got[1:]).all()                              # nothing carries over


def test_static_shared_memory_is_measured_and_limited(probes, monkeypatch):
    out = EmuArray((32,), np.float32)
    with pytest.raises(EmulatorError, match=r"65536 bytes of static shared memory, more than "
                                            r"the 49152"):
        probes("probe_big_shared")((1, 1, 1), (32, 1, 1), (out.gpudata,))
    small = probes("probe_shared_read")
    small((1, 1, 1), (32, 1, 1), (out.gpudata,))
    assert small.shared_used == 32 * 4
    monkeypatch.setattr(kernel_emulator, "SHARED_LIMIT", 64)
    with pytest.raises(EmulatorError, match="128 bytes of static shared memory"):
        small((1, 1, 1), (32, 1, 1), (out.gpudata,))


def test_a_real_reduction_reports_its_shared_memory(device_place):
    if not isinstance(device_place, kernel_emulator.EmuPlace):
        pytest.skip("the emulator's own measurement")
    from minigraph import device
    from minigraph.kernels.cuda import softmax

    x = to_device(np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32))
    softmax.softmax(x)
    used = {k.name: k._launch.shared_used for k in device.backend()._kernels.values()}
    assert used and max(used.values()) > 0, used


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_blocks_run_in_an_order_shuffled_per_seed(probes, seed):
    orders = []
    for s in (seed, seed + 10):
        order, counter = EmuArray((64,), np.uint32), to_device(np.zeros(1, np.uint32))
        probes("probe_order", s)((64, 1, 1), (32, 1, 1), (order.gpudata, counter.gpudata))
        got = order.get()
        assert sorted(got) == list(range(64))
        orders.append(got.tolist())
    assert orders[0] != orders[1] and orders[0] != sorted(orders[0])


# ---- dynamic shared memory and the function attribute ---------------------------------------

def test_dynamic_shared_memory_is_poisoned_and_filled_by_async_copies(probes):
    k = probes("probe_dynamic")
    src = to_device(np.arange(128, dtype=np.float32))
    out = EmuArray((4,), np.float32)
    k((2, 1, 1), (32, 1, 1), (src.gpudata, out.gpudata, 512, 32), 4096)
    got = out.get().reshape(2, 2)
    np.testing.assert_array_equal(got[:, 0], [np.arange(128).sum()] * 2)
    assert np.isnan(got[:, 1]).all()                  # every block starts poisoned


def test_past_48_kib_a_launch_needs_the_attribute(probes):
    """As CUDA: without MAX_DYNAMIC_SHARED_SIZE_BYTES a block has 48 KiB in all (static
    and dynamic); with it, up to the attribute (and 227 KiB with the static part)."""
    k = probes("probe_dynamic")
    src, out = to_device(np.zeros(128, np.float32)), EmuArray((2,), np.float32)
    with pytest.raises(EmulatorError, match=r"65536 bytes of dynamic shared memory; a block may "
                                            r"have 49152 without raising"):
        k((1, 1, 1), (32, 1, 1), (src.gpudata, out.gpudata, 0, 32), 64 * 1024)
    k.allow_shared(100 * 1024)
    k((1, 1, 1), (32, 1, 1), (src.gpudata, out.gpudata, 16000, 32), 64 * 1024)
    with pytest.raises(EmulatorError, match="the function attribute MAX_DYNAMIC_SHARED_SIZE_BYTES "
                                            "allows 102400"):
        k((1, 1, 1), (32, 1, 1), (src.gpudata, out.gpudata, 0, 32), 101 * 1024)
    with pytest.raises(EmulatorError, match="more than the 232448 a block may opt in to"):
        k.allow_shared(228 * 1024)


def test_static_and_dynamic_shared_memory_add_up(probes, monkeypatch):
    k = probes("probe_shared_read")
    out = EmuArray((32,), np.float32)
    with pytest.raises(EmulatorError, match=r"128 bytes of static shared memory and 49100 of "
                                            r"dynamic, more than the 49152"):
        k((1, 1, 1), (32, 1, 1), (out.gpudata,), 49100)


def test_a_write_past_the_dynamic_shared_memory_fails_the_launch(probes):
    k = probes("probe_dynamic")
    src, out = to_device(np.zeros(128, np.float32)), EmuArray((2,), np.float32)
    with pytest.raises(EmulatorError, match="wrote outside its 4096 bytes of dynamic shared "
                                            "memory"):
        k((1, 1, 1), (32, 1, 1), (src.gpudata, out.gpudata, 1000, 40), 4096)


# ---- ranks on threads -----------------------------------------------------------------------

def test_launches_from_two_threads_run_one_at_a_time(probes):
    """Ranks run on threads (test_nccl.py) and ctypes lets go of the GIL, but a library's
    fibers and shared memory table are one: two launches at once, or a launch while the
    library is loaded again, crashed the process or mixed two blocks' shared memory.
    Run in a forked child, as a crash would end the process."""
    path = kernel_emulator.build("probes", SIGNATURES, kdir=probes.kdir)

    def ranks_and_a_loader(queue):
        wrong, ranks_done = [], threading.Event()

        def rank(seed):
            run = probes("probe_shared_read", seed)
            for _ in range(200):
                out = EmuArray((8 * 32,), np.float32)
                run((8, 1, 1), (32, 1, 1), (out.gpudata,))
                got = out.get().reshape(8, 32)
                if not ((got[0] == 1).all() and np.isnan(got[1:]).all()):
                    wrong.append(seed)

        def loader():
            while not ranks_done.is_set():
                kernel_emulator.load(path)     # the same library: its state is set again

        ranks = [threading.Thread(target=rank, args=(s,)) for s in (1, 2)]
        again = threading.Thread(target=loader)
        for t in (again, *ranks):
            t.start()
        for t in ranks:
            t.join()
        ranks_done.set()
        again.join()
        queue.put(len(wrong))

    assert run_in_forked_child(ranks_and_a_loader) == (0, 0)


def test_ranks_asking_for_a_kernel_at_once_share_it(monkeypatch):
    """Threads first asking for one kernel at once get one object: with one each, a
    rank's allow_shared (the function attribute) was not the attribute another rank's
    launch read. The kernel is made slowly here, so every thread makes its own."""
    class SlowKernel(EmuKernel):
        def __init__(self, *args):
            time.sleep(0.05)
            super().__init__(*args)

    backend = kernel_emulator.EmuBackend()
    name, fmt = next(iter(loader.signature_table()["fill"].items()))
    backend._lib("fill")                         # built before the threads start
    monkeypatch.setattr(kernel_emulator, "EmuKernel", SlowKernel)
    got = []

    def ask():
        got.append(backend.kernel("fill", name, fmt))
        return True

    assert all_right_from_threads(ask, threads=8, calls=1)
    assert len(got) == 8 and all(k is got[0] for k in got)
    assert isinstance(got[0]._launch, SlowKernel)
