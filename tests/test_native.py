"""Building, caching and loading the native CPU kernels (kernels/cpu/native.py), and
what runs where they cannot be built."""
import os
import shutil

import numpy as np
import pytest

from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_native, native

HAS_CC = bool(shutil.which((os.environ.get("CC") or "cc").split()[0]) or shutil.which("gcc"))


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache directory and no library loaded in this process (both restored
    afterwards, so other tests keep the loaded library)."""
    monkeypatch.setenv("MINIGRAPH_CACHE", str(tmp_path / "cache"))
    native._load.cache_clear()
    yield tmp_path / "cache"
    native._load.cache_clear()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
def test_built_once_then_loaded_from_the_cache(fresh):
    assert native.library("conv_native") is not None
    built = sorted(fresh.iterdir())
    assert [p.suffix for p in built] == [".so"] and built[0].name.startswith("conv_native-")
    stamp = built[0].stat().st_mtime_ns
    native._load.cache_clear()
    assert native.library("conv_native") is not None
    assert sorted(fresh.iterdir()) == built and built[0].stat().st_mtime_ns == stamp


def test_no_compiler_means_no_library_and_says_why(fresh, monkeypatch):
    monkeypatch.setenv("CC", str(fresh.parent / "no-such-cc"))
    assert native.library("conv_native") is None
    assert "building conv_native.c failed" in native.reason("conv_native")
    assert not conv_native.available()
    assert not list(fresh.glob("*.so"))


def test_a_failing_compiler_leaves_no_files(fresh, monkeypatch):
    failing = fresh.parent / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: error: broken' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    assert native.library("conv_native") is None
    assert "cc: error: broken" in native.reason("conv_native")
    assert list(fresh.iterdir()) == []


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert native.library("conv_native") is None
    assert native.reason("conv_native") == "MINIGRAPH_NATIVE is off"
    g = conv_cpu.geometry((1, 2, 4, 4), (2, 2, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    assert not conv_native.supports(g, np.float32)
    monkeypatch.setenv("MINIGRAPH_NATIVE", "1")
    assert native.reason("conv_native") != "MINIGRAPH_NATIVE is off"


def test_the_key_names_this_cpu():
    identity = native._cpu_identity()
    assert identity and len(identity.splitlines()) >= 2


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
def test_unwritable_cache_builds_in_a_temporary_directory_removed_once_loaded(
        fresh, monkeypatch, tmp_path):
    fresh.parent.joinpath("file").write_text("")
    monkeypatch.setenv("MINIGRAPH_CACHE", str(fresh.parent / "file" / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert native.library("conv_native") is not None
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(not shutil.which("gcc"), reason="no gcc here")
def test_cc_may_carry_arguments(fresh, monkeypatch):
    monkeypatch.setenv("CC", f"{shutil.which('gcc')} -Wall")
    assert native.library("conv_native") is not None
