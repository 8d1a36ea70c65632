"""benchmarks/between_steps.py's machine probes: work that times itself is timed by
its own clock, and the C product computes the product it is named for."""
from __future__ import annotations

import ctypes
import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def between_steps():
    spec = importlib.util.spec_from_file_location(
        "between_steps", ROOT / "benchmarks" / "between_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timed_takes_the_time_work_returns(between_steps, monkeypatch):
    clock = iter([10.0, 12.5, 20.0, 30.0])
    monkeypatch.setattr(between_steps.time, "perf_counter", lambda: next(clock))
    assert between_steps.timed(lambda: None) == 2.5           # wall time
    assert between_steps.timed(lambda: 7e-6) == 7e-6          # its own


def test_the_c_product_is_the_product(between_steps, tmp_path):
    lib = between_steps.c_probes(str(tmp_path))
    if lib is None:
        pytest.skip("no C compiler")
    lib.product_init()
    assert lib.product_ns() > 0
    assert lib.spin_ns(1000) > 0
    a = np.ctypeslib.as_array((ctypes.c_float * (64 * 256)).in_dll(lib, "probe_a"))
    b = np.ctypeslib.as_array((ctypes.c_float * (256 * 128)).in_dll(lib, "probe_b"))
    c = np.ctypeslib.as_array((ctypes.c_float * (64 * 128)).in_dll(lib, "probe_c"))
    want = a.reshape(64, 256).astype(np.float64) @ b.reshape(256, 128).astype(np.float64)
    assert np.array_equal(a[:8], [0, 1, 2, 3, 4, 5, 6, 0])   # set by product_init
    np.testing.assert_array_equal(c.reshape(64, 128), want)   # small ints: exact


@pytest.fixture(scope="module")
def probes(between_steps, tmp_path_factory):
    lib = between_steps.c_probes(str(tmp_path_factory.mktemp("probes")))
    if lib is None:
        pytest.skip("no C compiler")
    return lib


def test_gaps_counts_each_jump_of_the_clock_and_keeps_at_most_cap(probes):
    lengths = (ctypes.c_uint64 * 8)(*[7] * 8)
    every = probes.gaps_ns(1_000_000, 1, lengths, 3)     # every reading is a jump of >= 1 ns
    assert every > 3
    assert all(0 < n < 1_000_000 for n in lengths[:3]) and list(lengths[3:]) == [7] * 5
    assert probes.gaps_ns(1_000_000, 10**10, lengths, 8) == 0   # none lasts 10 s


def test_the_chain_visits_every_line_once_a_page_apart(probes):
    lines, stride = 512, 4096 + 64
    probes.chain_init()
    memory = (ctypes.c_char * (lines * stride)).in_dll(probes, "chain_mem")
    base = ctypes.addressof(memory)
    offset, seen = 0, []
    for _ in range(lines):
        offset = ctypes.c_void_p.from_address(base + offset).value - base
        seen.append(offset)
    assert offset == 0                                    # a cycle of 512 links
    assert sorted(seen) == [i * stride for i in range(lines)]
    assert seen[:4] != [stride, 2 * stride, 3 * stride, 4 * stride]   # shuffled
    assert probes.chain_ns() > 0


def test_interruptions_reports_rates_and_the_chain_by_count(between_steps, probes,
                                                           monkeypatch):
    monkeypatch.setattr(between_steps, "GAP_SECONDS", 0.05)
    monkeypatch.setattr(between_steps, "CHAIN_RUNS", 5)
    monkeypatch.setattr(between_steps, "GAP_NS", 1)      # every reading counts: taken > 0
    taken = between_steps.interruptions(probes)
    assert taken["per second"] > 0 and 0 < taken["share"] <= 1.5
    assert 0 < taken["median us"] <= taken["p90 us"]
    itself, *by_count = taken["chain"]
    assert itself > 0 and by_count[:2] == [None, None] and by_count[2] > 0


def test_thread_times_count_this_threads_work(between_steps):
    import threading
    import time

    me = threading.get_native_id()
    before = between_steps.thread_cpu_ns()
    end = time.thread_time() + 0.03                      # 30 ms on a CPU, however loaded
    while time.thread_time() < end:
        pass
    after = between_steps.thread_cpu_ns()
    ran = after[me][0] - before[me][0]
    assert 20_000_000 < ran < 10**10                      # schedstat lags by a tick at most
    assert all(len(t) == 2 and min(t) >= 0 for t in after.values())
    assert after[me][1] >= before[me][1]                  # the wait only grows
