"""Building, caching and loading the native CPU kernels (kernels/cpu/native.py), and
what runs where they cannot be built."""
import os
import shutil
import subprocess
from pathlib import Path

import native_probe
import numpy as np
import pytest

from minigraph.kernels.cpu import choices, conv_native, native
from minigraph.kernels.cpu import conv_im2col as conv_cpu

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
    assert native.library("relu_native") is not None
    built = sorted(fresh.glob("relu_native-*"))     # the first library loaded in a process
    assert [p.name.split(".", 1)[1] for p in built] == ["so", "so.sha256"]   # brings blas_pool
    stamp = built[0].stat().st_mtime_ns
    everything = sorted(fresh.iterdir())
    native._load.cache_clear()
    assert native.library("relu_native") is not None
    assert sorted(fresh.iterdir()) == everything and built[0].stat().st_mtime_ns == stamp


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


def test_the_switch_reads_every_change_of_the_environment(monkeypatch):
    """native.enabled and choices.enabled read os.environ's own mapping (faster than
    os.environ.get): each set, change and removal is seen at the next call."""
    for value, on in (("0", False), (" OFF ", False), ("No", False), ("1", True),
                      ("yes", True), ("", True), ("off", False)):
        monkeypatch.setenv("MINIGRAPH_NATIVE", value)
        assert native.enabled() is on, value
    monkeypatch.delenv("MINIGRAPH_NATIVE")
    assert native.enabled()
    monkeypatch.setenv("MINIGRAPH_TUNE", "0")
    assert not choices.enabled() and native.enabled()
    monkeypatch.delenv("MINIGRAPH_TUNE")
    assert choices.enabled()
    monkeypatch.setattr(os, "environ", {"MINIGRAPH_NATIVE": "off"})     # a plain mapping
    assert not native.enabled() and native.switched_off("MINIGRAPH_NATIVE")


def test_local_headers_are_part_of_the_source():
    """A kernel's headers (native_pool.h) are put in its source: compiled from a
    temporary file with no include path, and covered by the cache key."""
    header = (Path(native.__file__).parent / "native_pool.h").read_text()
    for name in ("conv_native", "norm_native", "bn_native", "optim_native", "pool_native",
                 "dropout_native"):
        source = native.source_of(name)
        assert '#include "native_pool.h"' not in source and header in source
    maths = (Path(native.__file__).parent / "vector_math.h").read_text()
    for name in ("attention_native", "gelu_native"):
        source = native.source_of(name)
        assert header in source and maths in source and '#include "vector_math.h"' not in source


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
def test_every_kernel_source_builds_where_there_is_a_compiler():
    """Where a C compiler is at hand, every kernels/cpu/*.c builds, every local
    #include in it is put in its place (a line the inliner does not take, such as one
    with a comment after the name, would leave an include the compiler cannot find),
    and the library loads: a source that does not compile would otherwise only turn its
    kernels' tests into skips."""
    folder = Path(native.__file__).parent
    names = sorted(p.stem for p in folder.glob("*.c"))
    assert "attention_native" in names and "conv_native" in names
    for name in names:
        assert "#include \"" not in native.source_of(name), name
        assert native.library(name) is not None, native.reason(name)


def test_the_key_names_this_cpu():
    identity = native.cpu_identity()
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
    assert native.library("relu_native") is not None
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(not shutil.which("gcc"), reason="no gcc here")
def test_cc_may_carry_arguments(fresh, monkeypatch):
    monkeypatch.setenv("CC", f"{shutil.which('gcc')} -Wall")
    assert native.library("relu_native") is not None


# ---- a damaged, planted or unbuildable cache entry (run in fresh processes: a bad
# library can kill the process that loads it, and a process loads a path only once) ----

probe = native_probe.run          # (returncode, output) of a fresh process on a cache


def built_entry(cache):
    """Build relu_native (the smallest kernel library: these tests are about the cache,
    not the kernel) into `cache` in a fresh process; the library's path."""
    code, out = probe(cache)
    assert code == 0 and "KERNEL OK" in out, out
    (lib,) = cache.glob("relu_native-*.so")
    return lib


def compile_library(tmp_path, source, name):
    import subprocess

    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"{name}.so"
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-shared", "-fPIC", str(src),
                    "-o", str(out)], check=True, capture_output=True)
    return out


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
@pytest.mark.parametrize("damage", ["truncated 1 KB", "truncated 12 KB", "empty", "garbage",
                                    "no kernels"])
def test_a_damaged_cache_entry_is_rebuilt(tmp_path, damage):
    """Every damaged entry is found before it is loaded (a truncated library killed
    the process with SIGBUS, one without the kernels made every conv raise, empty
    or garbage ones were never rebuilt): the process builds it anew and the
    native kernel runs."""
    cache = tmp_path / "cache"
    lib = built_entry(cache)
    good = lib.read_bytes()
    if damage.startswith("truncated"):
        size = int(damage.split()[1]) * 1024
        assert size < len(good)
        lib.write_bytes(good[:size])
    elif damage == "empty":
        lib.write_bytes(b"")
    elif damage == "garbage":
        lib.write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    else:
        other = compile_library(tmp_path, "int unrelated(void) { return 7; }\n", "other")
        lib.write_bytes(other.read_bytes())
    code, out = probe(cache)
    assert code == 0, f"exit status {code}:\n{out}"
    assert "LOADED" in out and "KERNEL OK" in out, out
    assert lib.read_bytes() == good or len(lib.read_bytes()) == len(good)
    code, out = probe(cache)                       # and the rebuilt entry is used as it is
    assert code == 0 and "KERNEL OK" in out, out


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
def test_the_library_is_fsynced_before_it_is_renamed_into_the_cache(fresh, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert native.library("relu_native") is not None
    renames = [e for e in events if e[0] == "replace" and e[2].endswith(".so")]
    assert renames, events
    tmp = renames[0][1]
    synced = [i for i, e in enumerate(events) if e == ("fsync", tmp)]
    assert synced and synced[0] < events.index(renames[0]), events


PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
int relu_grad(void) { return 0; }
"""


def plant(tmp_path, directory, filename):
    """A library named `filename` in `directory` whose constructor writes a marker file."""
    marker = tmp_path / "planted-code-ran"
    lib = compile_library(tmp_path, PLANTED % marker, "planted")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / filename).write_bytes(lib.read_bytes())
    return marker


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
@pytest.mark.parametrize("who", ["another user, mode 1777", "this user, mode 0777",
                                 "this user, mode 0775"])
def test_a_cache_directory_others_can_write_is_never_loaded_from(tmp_path, who):
    """The entry's name is predictable: a library planted in a directory that another
    user can write must not run, whatever its name and contents."""
    filename = built_entry(tmp_path / "private").name
    hostile = tmp_path / "shared"
    marker = plant(tmp_path, hostile, filename)
    for extra in (tmp_path / "private").iterdir():       # whatever else the entry needs
        if extra.name != filename:
            shutil.copy(extra, hostile / extra.name)
    if who.startswith("another"):
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another user")
        os.chown(hostile, 65534, 65534)
        hostile.chmod(0o1777)
    else:
        hostile.chmod(int(who.split()[-1], 8))
    code, out = probe(hostile)
    assert code == 0, out
    assert not marker.exists(), "the planted library's constructor ran"
    assert "NOT LOADED" in out and "other users" in out, out


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
def test_an_entry_others_can_write_is_rebuilt_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    lib = built_entry(cache)
    marker = plant(tmp_path, cache, lib.name)
    lib.chmod(0o666)
    code, out = probe(cache)
    assert code == 0 and "KERNEL OK" in out, out
    assert not marker.exists()
    assert lib.stat().st_mode & 0o022 == 0


def test_a_hanging_compiler_falls_back_within_the_build_limit(tmp_path):
    """$CC that never returns: the build gives up at MINIGRAPH_NATIVE_BUILD_TIMEOUT
    (not 2 x 120 s), says on stderr what it is building meanwhile, and the numpy
    kernels run."""
    import time

    hang = tmp_path / "cc"
    hang.write_text("#!/bin/sh\nsleep 600\n")
    hang.chmod(0o755)
    start = time.monotonic()
    code, out = probe(tmp_path / "cache", timeout=40, CC=str(hang),
                      MINIGRAPH_NATIVE_BUILD_TIMEOUT="4")
    assert time.monotonic() - start < 20
    assert code == 0 and "NOT LOADED" in out, out
    assert "building relu_native.c" in out and "4 s" in out, out


def test_a_cc_that_cannot_be_split_falls_back_to_numpy(fresh, monkeypatch):
    monkeypatch.setenv("CC", 'gcc "-O2')
    assert native.library("conv_native") is None
    assert "$CC" in native.reason("conv_native")
    g = conv_cpu.geometry((1, 2, 4, 4), (2, 2, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    assert not conv_native.supports(g, np.float32)


def test_the_build_limit_setting(monkeypatch):
    monkeypatch.setenv("MINIGRAPH_NATIVE_BUILD_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="MINIGRAPH_NATIVE_BUILD_TIMEOUT"):
        native.build_timeout()
    monkeypatch.setenv("MINIGRAPH_NATIVE_BUILD_TIMEOUT", "7.5")
    assert native.build_timeout() == 7.5
    monkeypatch.delenv("MINIGRAPH_NATIVE_BUILD_TIMEOUT")
    assert native.build_timeout() == native.DEFAULT_BUILD_TIMEOUT_S


def test_the_address_a_kernel_gets():
    """None for None and for an array with no values; the data's address for a
    writable and for a read-only array (numpy's way there)."""
    a = np.arange(6.0)
    assert native.address(None) is None and native.address(np.empty(0)) is None
    assert native.address(a) == a.ctypes.data
    a.flags.writeable = False
    assert native.address(a) == a.ctypes.data
    assert native.address(a[2:]) == a.ctypes.data + 16


def test_packed_ints_hold_a_packed_calls_arguments():
    """A *_packed entry point's int64 array: ints and addresses in order, None as 0
    (NULL); its items can be set again between calls."""
    a = np.arange(3.0)
    ints = native.packed_ints([native.address(a), None, 7, -2])
    assert list(ints) == [a.ctypes.data, 0, 7, -2]
    ints[2] = 5
    assert ints[2] == 5 and len(ints) == 4


def _cpu_has(flag):
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not HAS_CC, reason="no C compiler here")
def test_the_vector_width_follows_the_build_target(fresh, monkeypatch):
    """-march=native builds AVX-512 register tiles where the CPU has AVX-512; a compiler
    told otherwise (CC="cc -mno-avx512f") builds AVX2's, under a key of its own."""
    held_back = "-mno-avx512f" in (os.environ.get("CC") or "").split()   # the AVX2 runs
    want = 16 if _cpu_has("avx512f") and not held_back else 8
    assert native.vector_floats("wgrad_native") == want
    first = native.build_key("wgrad_native")
    assert first and first in next(fresh.glob("wgrad_native-*.so")).name
    if want == 16:
        native._load.cache_clear()
        cc = (os.environ.get("CC") or "cc").split()
        monkeypatch.setenv("CC", " ".join(cc + ["-mno-avx512f"]))
        assert native.vector_floats("wgrad_native") == 8
        assert len(list(fresh.glob("wgrad_native-*.so"))) == 2
        assert native.build_key("wgrad_native") != first       # kernel choices made anew


# ---- GCC fuses every multiply-add, whatever CPU it tunes for ----

GCC_12 = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc."
CLANG_16 = "clang version 16.0.6\nTarget: x86_64-pc-linux-gnu\nThread model: posix"
CHAIN = """
typedef float v8 __attribute__((vector_size(32)));
float dot(const float *a, const float *b, long n)
{
    v8 acc = {0};
    for (long i = 0; i < n; i += 8) acc += *(const v8 *)(a + i) * *(const v8 *)(b + i);
    return acc[0];
}
"""


def flag_sets_built_with(monkeypatch, version):
    """The flags of each build native.library tries with a compiler that says `version`
    (every build refused, so all the flag sets are tried)."""
    tried = []

    def refuse(source, compiler, flags, *rest):
        tried.append(flags)
        raise OSError("not built: the test reads the flags only")

    monkeypatch.setattr(native.native_build, "compiler_version", lambda *args: version)
    monkeypatch.setattr(native.native_build, "build", refuse)
    assert native.library("relu_native") is None
    return tried


def test_gcc_and_only_gcc_is_told_to_fuse_every_multiply_add(fresh, monkeypatch):
    assert native.is_gcc(GCC_12)
    assert native.is_gcc("x86_64-linux-gnu-gcc-12 (Debian 12.2.0-14) 12.2.0\n"
                         "Copyright (C) 2022 Free Software Foundation, Inc.")
    assert not native.is_gcc("gcc (GCC) 7.5.0\nCopyright (C) 2017 Free Software Foundation")
    assert not native.is_gcc(CLANG_16) and not native.is_gcc("")
    with_gcc = flag_sets_built_with(monkeypatch, GCC_12)
    assert with_gcc and all(native.GCC_FUSE_ALL[0] in flags for flags in with_gcc)
    native._load.cache_clear()
    with_clang = flag_sets_built_with(monkeypatch, CLANG_16)
    assert with_clang and not any(native.GCC_FUSE_ALL[0] in flags for flags in with_clang)


@pytest.mark.skipif(not shutil.which("gcc") or os.uname().machine != "x86_64",
                    reason="needs gcc on x86-64")
def test_a_sum_carried_through_a_loop_is_one_multiply_add_when_tuned_for_zen3(tmp_path):
    """GCC tuned for AMD Zen 3 (as -march=native makes it there) splits such a multiply-add
    in a multiply and an add unless told GCC_FUSE_ALL; the separable conv then lost the
    bits of the depthwise and pointwise kernels it promises (tests/
    test_fused_separable_conv2d.py failed on that CPU)."""
    version = subprocess.run(["gcc", "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    if not native.is_gcc(version):
        pytest.skip("gcc here is older than 8 (no avoid-fma-max-bits) or is not GCC")
    source = tmp_path / "chain.c"
    source.write_text(CHAIN)
    flags = ["-O3", "-mavx2", "-mfma", "-mtune=znver3", *native.GCC_FUSE_ALL,
             "-std=c11", "-ffp-contract=fast"]
    done = subprocess.run(["gcc", *flags, "-S", "-o", "-", str(source)], capture_output=True,
                          text=True, timeout=60)
    if "znver3" in done.stderr:
        pytest.skip("this gcc does not know Zen 3")
    assert done.returncode == 0, done.stderr
    assert "vfmadd" in done.stdout and "vmulps" not in done.stdout
