"""Building and loading the native CPU kernels (*.c beside their launchers; the
compiling itself is native_build.py's, the cache's checks native_cache.py's).

`library(name)` compiles kernels/cpu/<name>.c (with the headers of this folder
it includes, `source_of`) with the system C compiler (`cc`, or $CC) for this
machine's own instruction set (-O3 -march=native), once: the shared library is
kept in a cache directory ($MINIGRAPH_CACHE, else $XDG_CACHE_HOME/minigraph,
else ~/.cache/minigraph) under a name that hashes the source, the flags, the
compiler's version and this CPU's model and flags, so a changed kernel, header,
compiler or machine builds anew.

Nothing unverified is loaded:
  * the cache directory, and every directory above it, must be writable by no
    other user (owned by this user or root, no group or other write bit; a
    sticky directory such as /tmp is accepted above the cache directory only).
    Otherwise `library` returns None and `reason` says why: the entry's name is
    predictable, so anyone who can write there could plant code;
  * a build is compiled into a temporary file, fsynced, loaded from that file
    (so a library that does not load is never published), renamed into place,
    and then its SHA-256 is written beside it (`<entry>.sha256`, also fsynced
    and renamed). An entry is loaded only when it is a regular file of this
    user's (or root's) that no one else can write and its bytes match that
    digest, read from the same open file that is then loaded (/proc/self/fd).
    An entry that fails (truncated, empty, garbage, another library, no
    digest) is built again and replaced.

Processes building into one cache take turns (a flock on the directory), so
processes started together (a job's ranks) build each library once and the others
load it; one that waited MINIGRAPH_NATIVE_BUILD_TIMEOUT seconds for its turn builds on
its own. The build itself (the compiler's version, then each flag set) must finish
within that many seconds (DEFAULT_BUILD_TIMEOUT_S); a compiler still running then is
killed with its children. A build that takes longer than NOTICE_AFTER_S says on
stderr what it is building. Where the cache cannot be written the library is built
in a temporary directory for this process only, removed once loaded.

Where no compiler works, $CC cannot be split into a command, the build runs
out of time, the cache is unsafe, or MINIGRAPH_NATIVE=0, `library` returns
None and `reason(name)` says why: callers then run their numpy kernels, which
are the reference the native ones are tested against.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.resources
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

from minigraph.kernels.cpu import native_build
from minigraph.kernels.cpu import native_cache as cache

FLAG_SETS = (("-O3", "-march=native"), ("-O3",))     # the second where -march=native fails
# GCC tuned for some CPUs (-march=native on AMD Zen 2 and 3: avoid-fma-max-bits 256)
# leaves a multiply-add whose sum feeds the next one in a loop as a multiply and an
# add, so kernels that promise each other's bits (the separable conv and the depthwise
# conv then the pointwise one) round differently there; 0 fuses every one it can
GCC_FUSE_ALL = ("--param=avoid-fma-max-bits=0",)
# -ffp-contract=fast: ISO C mode would not fuse a * b + c into one multiply-add;
# -fno-math-errno: a sqrt that may set errno is a call, and a loop with a call in it
# is not vectorized (the kernels never read errno; the results are the same)
COMMON_FLAGS = ("-std=c11", "-ffp-contract=fast", "-fno-math-errno", "-fPIC", "-shared",
                "-pthread", "-fno-strict-aliasing")
LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.h)"$', re.MULTILINE)
BUILD_TIMEOUT_ENV = "MINIGRAPH_NATIVE_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 60.0
NOTICE_AFTER_S = 2.0

_lock = threading.Lock()
_reasons = {}
_keys = {}


def enabled():
    """False when MINIGRAPH_NATIVE is 0, off or no: the numpy kernels run everywhere."""
    return not switched_off("MINIGRAPH_NATIVE")


def switched_off(name):
    """True when the environment variable `name` is 0, off or no (any case, spaces
    around), read from os.environ's own mapping: every kernel call asks, and
    os.environ.get of an absent name raises and catches a KeyError (about 1 us)."""
    data = getattr(os.environ, "_data", None)
    if type(data) is not dict:
        return os.environ.get(name, "1").strip().lower() in _OFF
    key = _env_keys.get(name)
    if key is None:
        key = _env_keys[name] = os.environ.encodekey(name)
    raw = data.get(key)
    if raw is None:
        return False
    off = _off.get(raw)
    if off is None:
        off = _off[raw] = os.environ.decodevalue(raw).strip().lower() in _OFF
    return off


_OFF = ("0", "off", "no")
_env_keys, _off = {}, {}        # name -> its key in os.environ._data; raw value -> off


def library(name):
    """The loaded ctypes library of kernels/cpu/<name>.c, built on first use, or None
    (native kernels off, no working compiler, the build ran out of time, or an
    unsafe cache: reason(name) says which). The first library loaded also hands
    OpenBLAS's threads over to the native pool (blas_threads.install), so that no
    BLAS thread spins on a core a native kernel's thread needs."""
    if not enabled():
        return None
    lib = _load(name)
    if lib is not None and not _blas_pool_tried:
        _give_blas_the_pool()
    return lib


_blas_pool_tried = False


def _give_blas_the_pool():
    global _blas_pool_tried
    _blas_pool_tried = True
    from minigraph.kernels.cpu import blas_threads

    blas_threads.install()


def typed_function(name, symbol, argtypes, restype=ctypes.c_int):
    """C function `symbol` of library(name) with argtypes and restype set, or None where
    the library is not at hand (see library). Callers keep what it returns."""
    lib = library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def packed_ints(values):
    """A C int64 array of `values` (ints, and pointers as integers, None for NULL): the
    arguments of a kernel's *_packed entry point, which a prepared call fills once and
    passes as one pointer (ctypes converts each argument of every call, about 0.2 us
    apiece: ten of them cost more than a generated token's layer_norm)."""
    return (ctypes.c_int64 * len(values))(*(0 if v is None else v for v in values))


_char, _address = ctypes.c_char.from_buffer, ctypes.addressof


def address(a):
    """The address of C-contiguous numpy array `a`'s data, for a C kernel's pointer
    argument: None for None or an array with no values. Through ctypes' buffer
    protocol (several times faster than a.ctypes.data), or numpy's way where `a` is
    read-only."""
    if a is None or a.size == 0:
        return None
    try:
        return _address(_char(a))
    except TypeError:                       # read-only
        return a.ctypes.data


def build_key(name):
    """The cache key of library(name) as loaded (its source, headers, flags, compiler
    and CPU: a changed kernel has another), or None where it is not at hand."""
    return _keys.get(name) if library(name) is not None else None


def vector_floats(name):
    """The floats in one vector of library(name)'s kernels that use native_simd.h: 16
    where it was built for AVX-512, 8 elsewhere; None where the library is not at hand
    or does not use that header."""
    lib = library(name)
    fn = getattr(lib, "native_vector_floats", None) if lib is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_int64
    return int(fn())


def reason(name):
    """Why library(name) returns None now (empty when it does not, or its build was
    not tried yet)."""
    if not enabled():
        return "MINIGRAPH_NATIVE is off"
    return _reasons.get(name, "")


def build_timeout():
    """Seconds the whole build of one library may take: MINIGRAPH_NATIVE_BUILD_TIMEOUT,
    else DEFAULT_BUILD_TIMEOUT_S; a ValueError naming the variable unless it is a
    number > 0."""
    text = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{BUILD_TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


@functools.cache
def _load(name):
    with _lock:
        try:
            return _share_pool(_load_or_build(name))
        except _Refused as e:
            _reasons[name] = str(e)
            return None


def _share_pool(lib):
    """`lib`, its passes run on the pool of the first library loaded (native_pool.h):
    one set of workers for every kernel, watching for the next pass before they sleep."""
    if not hasattr(lib, "native_pool_use"):       # a library without native_pool.h
        return lib
    lib.native_pool_get.restype = ctypes.c_void_p
    lib.native_pool_use.argtypes, lib.native_pool_use.restype = [ctypes.c_void_p], None
    if not _pool:
        lib.native_pool_contended.restype = ctypes.c_int64
        _pool.extend((lib.native_pool_get(), lib.native_pool_contended))
    lib.native_pool_use(_pool[0])
    return lib


def pool_contended():
    """Whether other threads (another process's) lately wanted the cores the native
    pool runs on (native_pool.h); False before any native library is loaded."""
    return bool(_pool) and bool(_pool[1]())


_pool = []              # the address of the pool every library shares, its
                        # native_pool_contended


class _Refused(Exception):
    """Why this process runs `name` without its native library."""


def source_of(name):
    """The C source of kernels/cpu/<name>.c with the headers of this folder it
    includes (`#include "x.h"`, in headers too) put in their place: what is compiled
    and what the cache key covers, so a changed header builds anew and no include path
    is needed."""
    files = importlib.resources.files(__package__)

    def inline(text, depth=0):
        if depth > 8:
            raise ValueError(f"native: {name}.c: local #includes nest deeper than 8")
        return LOCAL_INCLUDE.sub(
            lambda m: inline(files.joinpath(m.group(1)).read_text(), depth + 1), text)

    return inline(files.joinpath(f"{name}.c").read_text())


def _load_or_build(name):
    source = source_of(name)
    cc = os.environ.get("CC", "")
    try:
        compiler = shlex.split(cc) or [found for found in (shutil.which("cc"),
                                                           shutil.which("gcc")) if found][:1]
    except ValueError as e:
        raise _Refused(f"$CC ({cc!r}) cannot be split into a command ({e})") from None
    if not compiler:
        raise _Refused("no C compiler (cc, gcc or $CC) on PATH")
    try:
        limit = build_timeout()
    except ValueError as e:
        raise _Refused(str(e)) from None
    try:
        directory = cache.cache_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache.check_private(directory)
    except cache.UnsafeCache as e:
        raise _Refused(f"not loading native kernels from the cache: {e}") from None
    except OSError:
        directory = None                  # no cache here: this process builds its own
    deadline = time.monotonic() + limit
    errors = []
    with _Notice(name, compiler, limit):
        try:
            version = native_build.compiler_version(compiler, deadline)
        except subprocess.TimeoutExpired:
            raise _Refused(f"building {name}.c: {' '.join(compiler)} --version did not finish "
                           f"within the build limit of {limit:g} s ({BUILD_TIMEOUT_ENV})") \
                from None
        if directory is not None:
            cache.remove_stale_temporaries(directory)
        for flags in FLAG_SETS:
            flags = flags + (GCC_FUSE_ALL if is_gcc(version) else ())
            key = hashlib.sha256("\0".join(
                (source, *compiler, *flags, *COMMON_FLAGS, version,
                 cpu_identity())).encode()).hexdigest()[:20]
            filename = f"{name}-{key}.so"
            _keys[name] = key
            if directory is not None:
                lib = cache.load_verified(directory / filename)
                if lib is not None:
                    return lib
            try:
                with _build_turn(directory, limit) as waited:
                    deadline += waited            # the wait is not the build's time
                    lib = None if directory is None else cache.load_verified(directory / filename)
                    if lib is not None:           # another process built it meanwhile
                        return lib
                    return native_build.build(source, compiler, flags + COMMON_FLAGS,
                                              directory, filename, deadline)
            except subprocess.TimeoutExpired:
                errors.append(f"{' '.join(flags)}: did not finish within the build limit of "
                              f"{limit:g} s ({BUILD_TIMEOUT_ENV})")
                break
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(f"{' '.join(flags)}: {str(err).strip()[:300]}")
    raise _Refused(f"building {name}.c failed with {' '.join(compiler)}: " + "; ".join(errors))


def _build_turn(directory, wait_s):
    """The cache's build turn (native_cache.build_turn); none without a cache."""
    return contextlib.nullcontext(0.0) if directory is None else \
        cache.build_turn(directory, wait_s)


def is_gcc(version):
    """True when `version` (the compiler's --version output) is GCC's from version 8
    on, which takes GCC_FUSE_ALL (clang does not)."""
    m = re.match(r"\S*(?:gcc|cc|g\+\+)\S* \(.*\) (\d+)\.", version)
    return bool(m) and "Free Software Foundation" in version and int(m.group(1)) >= 8


class _Notice:
    """Says on stderr what is being built when the build takes longer than
    NOTICE_AFTER_S (the first conv of a new machine waits for it)."""

    def __init__(self, name, compiler, limit):
        self.text = (f"minigraph: building the native CPU kernels {name}.c with "
                     f"{' '.join(compiler)} (once per machine and compiler; at most "
                     f"{limit:g} s, {BUILD_TIMEOUT_ENV}, then the numpy kernels run)\n")
        self.timer = threading.Timer(NOTICE_AFTER_S, self._say)
        self.timer.daemon = True

    def _say(self):
        try:
            sys.stderr.write(self.text)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()


def cpu_identity():
    """This CPU's model and instruction-set flags (a library built for -march=native
    must not load on another CPU sharing the cache; choices.py keys its file by it)."""
    lines = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("model name", "flags", "Features")):
                    lines.append(line.strip())
                if line.strip() == "":
                    break          # the first processor's lines
    except OSError:
        pass
    return "\n".join(lines)
