"""Shared fixtures."""
from __future__ import annotations

import pathlib
import shutil
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import kernel_emulator  # noqa: E402


@pytest.fixture(scope="session")
def gpu_place():
    """mg.GPUPlace(0), or skip the test with the reason no GPU can be used here."""
    import minigraph as mg

    try:
        return mg.GPUPlace(0)
    except mg.GPUError as e:
        pytest.skip(str(e))


@pytest.fixture(params=["emulated", pytest.param("gpu", marks=pytest.mark.gpu)])
def device_place(request):
    """A GPU place: the CPU emulator's (runs here), or GPUPlace(0) (skipped without one)."""
    from minigraph.kernels import loader

    if request.param == "gpu":
        gpu = request.getfixturevalue("gpu_place")
        old = loader.use_backend(None)
        yield gpu
        loader.use_backend(old)
        return
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernel emulator")
    with kernel_emulator.emulated_gpu() as emu:
        yield emu
