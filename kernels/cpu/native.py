"""Building and loading the native CPU kernels (*.c beside their launchers).

`library(name)` compiles kernels/cpu/<name>.c with the system C compiler (`cc`,
or $CC) for this machine's own instruction set (-O3 -march=native), once: the
shared library is kept in a cache directory ($MINIGRAPH_CACHE, else
$XDG_CACHE_HOME/minigraph, else ~/.cache/minigraph) under a name that hashes
the source, the flags, the compiler's version and this CPU's model and
flags, so a changed kernel, compiler or machine builds anew. The library is
written to a temporary file and renamed into place (processes that build at
once each write their own). Where the cache cannot be written it is built in
a temporary directory for this process only, removed once loaded.

Where no compiler works, or MINIGRAPH_NATIVE=0, `library` returns None and
`reason(name)` says why: callers then run their numpy kernels, which are the
reference the native ones are tested against.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading

FLAG_SETS = (("-O3", "-march=native"), ("-O3",))     # the second where -march=native fails
# -ffp-contract=fast: ISO C mode would not fuse a * b + c into one multiply-add
COMMON_FLAGS = ("-std=c11", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread",
                "-fno-strict-aliasing")
TIMEOUT_S = 120

_lock = threading.Lock()
_reasons = {}


def enabled():
    """False when MINIGRAPH_NATIVE is 0, off or no: the numpy kernels run everywhere."""
    return os.environ.get("MINIGRAPH_NATIVE", "1").strip().lower() not in ("0", "off", "no")


def library(name):
    """The loaded ctypes library of kernels/cpu/<name>.c, built on first use, or None
    (native kernels off, or no working compiler: reason(name) says which)."""
    return _load(name) if enabled() else None


def reason(name):
    """Why library(name) returns None now (empty when it does not, or its build was
    not tried yet)."""
    if not enabled():
        return "MINIGRAPH_NATIVE is off"
    return _reasons.get(name, "")


@functools.cache
def _load(name):
    with _lock:
        source = importlib.resources.files(__package__).joinpath(f"{name}.c").read_text()
        compiler = shlex.split(os.environ.get("CC", "")) or [
            found for found in (shutil.which("cc"), shutil.which("gcc")) if found][:1]
        if not compiler:
            _reasons[name] = "no C compiler (cc, gcc or $CC) on PATH"
            return None
        errors = []
        for flags in FLAG_SETS:
            try:
                path, temporary = _build(name, source, compiler, flags + COMMON_FLAGS)
                try:
                    return ctypes.CDLL(str(path))
                finally:
                    if temporary:            # loaded: the file is no longer needed
                        shutil.rmtree(path.parent, ignore_errors=True)
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(f"{' '.join(flags)}: {str(err).strip()[:300]}")
        _reasons[name] = (f"building {name}.c failed with {' '.join(compiler)}: "
                          + "; ".join(errors))
        return None


def _build(name, source, compiler, flags):
    """The path of the shared library of `source` built with `flags`, and whether it
    lies in a temporary directory (to remove once loaded): the cached one, else a
    fresh build renamed into the cache, else one in a temporary directory."""
    key = hashlib.sha256("\0".join(
        (source, *compiler, *flags, _compiler_version(compiler), _cpu_identity())).encode())
    filename = f"{name}-{key.hexdigest()[:20]}.so"
    try:
        directory = _cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / filename
        if target.exists():
            return target, False
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{filename}.", suffix=".tmp")
    except OSError:                       # no cache here: this process builds its own
        directory = pathlib.Path(tempfile.mkdtemp(prefix="minigraph-native-"))
        target = directory / filename
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        os.close(fd)
        try:
            return _compile(source, compiler, flags, tmp, target), True
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    os.close(fd)
    return _compile(source, compiler, flags, tmp, target), False


def _compile(source, compiler, flags, tmp, target):
    """Build `source` into the file `tmp`, then rename it to `target`; `tmp` and the
    source file beside it are gone afterwards, also on failure."""
    try:
        src = pathlib.Path(tmp).with_suffix(".c")
        src.write_text(source)
        try:
            done = subprocess.run([*compiler, *flags, str(src), "-o", tmp],
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
        finally:
            src.unlink(missing_ok=True)
        if done.returncode != 0:
            raise OSError(done.stderr or f"{compiler[0]} exited with {done.returncode}")
        os.replace(tmp, target)
        return target
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)


def _cache_dir():
    root = os.environ.get("MINIGRAPH_CACHE")
    if root:
        return pathlib.Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "minigraph"


def _compiler_version(compiler):
    try:
        return subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                              timeout=TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_identity():
    """This CPU's model and instruction-set flags (a library built for -march=native
    must not load on another CPU sharing the cache)."""
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
