"""An idle loop for the benchmarks: a C loop that keeps a core busy for a given time on
registers alone (a count between readings of the clock; no memory touched, no call into
any framework), built with the C compiler in a temporary directory.

A process that ran such a loop has done nothing that could evict a framework's data:
what an inference loses after it, the machine took (other processes, the hypervisor,
the kernel's ticks), beside what any pause costs the framework's own threads (its
idle workers go to sleep, as they would while the program reads its next batch; on
one thread, with no workers, the losses were alike: docs/performance.md). nets_cpu.py
times each inference after one as long as a training step beside the inference right
after a training step; between_steps.py uses the loop in its machine table.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import tempfile

SPIN_C = r"""
#include <stdint.h>
#include <time.h>
static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}
/* Busy for `ns` nanoseconds on registers: a count between readings of the clock. */
uint64_t spin_ns(uint64_t ns)
{
    uint64_t end = now_ns() + ns, count = 0;
    while (now_ns() < end)
        for (int i = 0; i < 256; i++) {
            count++;
            __asm__ volatile("" : "+r"(count));    /* kept in a register, not folded */
        }
    return count;
}
"""


def build_c(source, tmp, name="probes"):
    """C `source` built as a shared library in the directory `tmp` and loaded, or None
    without a C compiler ($CC, else cc or gcc, as kernels/cpu/native.py finds it; the
    benchmarks' PyTorch processes import no minigraph) or where the build fails. The
    library holds spin_ns(ns) when `source` includes SPIN_C."""
    compiler = shlex.split(os.environ.get("CC", "")) or [
        found for found in (shutil.which("cc"), shutil.which("gcc")) if found][:1]
    if not compiler:
        return None
    path, library = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
    with open(path, "w") as f:
        f.write(source)
    try:
        built = subprocess.run([*compiler, "-O2", "-shared", "-fPIC", "-o", library, path],
                               capture_output=True, timeout=60)
    except OSError:
        return None
    if built.returncode != 0:
        return None
    lib = ctypes.CDLL(library)
    if "spin_ns" in source:
        lib.spin_ns.argtypes, lib.spin_ns.restype = [ctypes.c_uint64], ctypes.c_uint64
    return lib


def idle_loop():
    """idle(seconds): the C loop for that long, or None where it cannot be built. The
    library stays loaded after its temporary directory is gone."""
    with tempfile.TemporaryDirectory() as tmp:
        lib = build_c(SPIN_C, tmp, "idle")
    if lib is None:
        return None
    return lambda seconds: lib.spin_ns(max(0, int(seconds * 1e9)))
