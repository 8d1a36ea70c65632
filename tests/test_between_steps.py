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
