"""Building for the kernel emulator (tests/kernel_emulator/toolchain.py): runtime.cpp is
compiled once per cache and linked into every module's library, each library runs
its kernels with a runtime state of its own, and g++'s refusal names the module."""
from __future__ import annotations

import shutil
import subprocess
import tempfile

import kernel_emulator
import numpy as np
import pytest
from kernel_emulator import EmuKernel, build, to_device

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")

SOURCE = r"""
extern "C" __global__ void put_{name}(float* out) {{
  __shared__ float cell[32];
  cell[threadIdx.x] = {value}.0f + threadIdx.x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = cell[31 - threadIdx.x];
}}
"""


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A temporary directory of its own, so the cache starts empty; a list of the
    g++ command lines run meanwhile."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    calls, real = [], subprocess.run

    def recording(cmd, *args, **kwargs):
        calls.append([str(c) for c in cmd])
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(kernel_emulator.toolchain.subprocess, "run", recording)
    return calls


def write_module(kdir, name, value):
    kdir.mkdir(exist_ok=True)
    (kdir / f"{name}.cu").write_text(SOURCE.format(name=name, value=value))


def test_the_runtime_is_compiled_once_and_each_library_runs_its_own_kernels(
        tmp_path, empty_cache):
    kdir = tmp_path / "kernels"
    write_module(kdir, "one", 100)
    write_module(kdir, "two", 200)
    libs = [build(name, {f"put_{name}": "P"}, kdir=kdir) for name in ("one", "two")]
    runtime_compiles = [c for c in empty_cache if any(a.endswith("runtime.cpp") for a in c)]
    assert len(runtime_compiles) == 1, runtime_compiles
    (runtime,) = (libs[0].parent).glob("runtime-*.o")
    assert all(str(runtime) in c for c in empty_cache if "-shared" in c)
    assert not list(libs[0].parent.glob("*.part"))
    for lib, name, value in zip(libs, ("one", "two"), (100, 200)):
        out = to_device(np.zeros(64, np.float32))
        EmuKernel(kernel_emulator.load(lib), f"put_{name}", "P", [1])(
            (2, 1, 1), (32, 1, 1), (out.gpudata,))
        np.testing.assert_array_equal(out.get(), np.tile(value + np.arange(31, -1, -1), 2))
    empty_cache.clear()
    assert build("one", {"put_one": "P"}, kdir=kdir) == libs[0]
    assert empty_cache == []                      # cached: nothing compiled again


def test_a_module_g_plus_plus_refuses_is_a_build_error_naming_it(tmp_path, empty_cache):
    kdir = tmp_path / "kernels"
    kdir.mkdir()
    (kdir / "broken.cu").write_text('extern "C" __global__ void f(float* o) { o[0] = ; }\n')
    with pytest.raises(kernel_emulator.BuildError, match=r"g\+\+ failed on broken\.cu"):
        build("broken", {"f": "P"}, kdir=kdir)
    assert not list((tmp_path / "tmp" / "minigraph-kernel-emulator").glob("broken-*"))
