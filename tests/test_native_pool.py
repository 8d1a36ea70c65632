"""The pool of worker threads every native kernel and OpenBLAS share (kernels/cpu/
native_pool.h): one pool for every library, results that do not depend on its watch,
and waits that stop watching while another process wants the cores."""
import ctypes
import os

import numpy as np
import pytest

from minigraph.kernels.cpu import blocks, native


def test_every_library_runs_its_passes_on_one_pool():
    """native.py points each library loaded at the first one's pool (native_pool.h):
    one set of workers for every kernel and OpenBLAS; the pool's waits watch for up
    to MINIGRAPH_SPIN_US before they sleep, which changes no result."""
    from minigraph.kernels.cpu import gelu_native, rows_native

    libs = [native.library(name) for name in ("rows_native", "gelu_native", "blas_pool")]
    if any(lib is None for lib in libs):
        pytest.skip(f"native kernels not built: {native.reason('rows_native')}")
    assert len({lib.native_pool_get() for lib in libs}) == 1
    libs[0].native_pool_spin.argtypes = [ctypes.c_int64]
    x = np.random.default_rng(0).standard_normal(1 << 17).astype(np.float32)
    rows = x.reshape(-1, 64)
    try:
        got = []
        for spin in (0, 100, 0):
            libs[0].native_pool_spin(spin)
            with blocks.num_threads(2):
                got.append((gelu_native.forward(x), rows_native.sum_rows(rows)))
    finally:
        libs[0].native_pool_spin(-1)                 # MINIGRAPH_SPIN_US, or the default
    for g, s in got[1:]:
        assert np.array_equal(g, got[0][0]) and np.array_equal(s, got[0][1])


CONTENDED = """
import ctypes, os, subprocess, sys, time
import numpy as np
from minigraph.kernels.cpu import blocks, gelu_native, native
cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})                  # this process and a busy one on one core
busy = subprocess.Popen([sys.executable, "-c",
                         f"import os\\nos.sched_setaffinity(0, {{{cpu}}})\\nwhile True: pass"])
try:
    lib = native.library("gelu_native")
    lib.native_pool_contentions.restype = ctypes.c_int64
    x = np.random.default_rng(0).standard_normal(1 << 17).astype(np.float32)
    want = gelu_native.forward(x)
    calm, end = native.pool_contended(), time.monotonic() + 60
    with blocks.num_threads(2):
        while lib.native_pool_contentions() == 0 and time.monotonic() < end:
            assert np.array_equal(gelu_native.forward(x), want)
        print(calm, lib.native_pool_contentions() > 0, native.pool_contended())
finally:
    busy.kill()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_the_pool_stops_watching_while_another_process_wants_the_cores():
    """native_pool.h: with a busy process on the core, the waits' yields give the core
    away for its turn; the pool then counts the cores contended (its waits sleep at
    once, and a training step runs on one thread: test_op_threads.py), and the results
    stay the same."""
    import subprocess
    import sys

    if native.library("gelu_native") is None:
        pytest.skip(f"native kernels not built: {native.reason('gelu_native')}")
    done = subprocess.run([sys.executable, "-c", CONTENDED], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"], done.stdout + done.stderr
