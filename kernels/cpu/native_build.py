"""Compiling a native kernel library (native.py decides what and where, and loads it):
into a temporary file, fsynced, loaded from that file, renamed into the cache with its
SHA-256 beside it; a compiler still running at the deadline is killed with its
children."""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

from minigraph.io.files import fsync_dir
from minigraph.kernels.cpu import native_cache as cache


def build(source, compiler, flags, directory, filename, deadline):
    """Compile `source` with `flags` and return the loaded library: in `directory`
    (published there as `filename` with its digest), or, when `directory` is None,
    in a temporary directory removed once loaded."""
    temporary = directory is None
    if temporary:
        directory = pathlib.Path(tempfile.mkdtemp(prefix="minigraph-native-"))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{filename}.", suffix=".tmp")
    os.close(fd)
    try:
        compile_source(source, compiler, flags, tmp, deadline)
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            data = cache.read_all(fd, os.fstat(fd).st_size)
            if not data:
                raise OSError(f"{compiler[0]} wrote no library")
            lib = cache.dlopen(fd, tmp)
        finally:
            os.close(fd)
        if not temporary:
            target = directory / filename
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
            cache.write_digest(target, hashlib.sha256(data).hexdigest())
            fsync_dir(directory)
        return lib
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)


def compile_source(source, compiler, flags, tmp, deadline):
    """Build `source` into the file `tmp` before `deadline` (time.monotonic); the
    source file beside it is gone afterwards, also on failure."""
    src = pathlib.Path(tmp).with_suffix(".c")
    src.write_text(source)
    try:
        code, _, err = run([*compiler, *flags, str(src), "-o", tmp], deadline)
    finally:
        src.unlink(missing_ok=True)
    if code != 0:
        raise OSError(err or f"{compiler[0]} exited with {code}")


def run(cmd, deadline):
    """(returncode, stdout, stderr) of `cmd`, killed with its whole process group
    (a compiler driver's children too) at `deadline`: then TimeoutExpired."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise subprocess.TimeoutExpired(cmd, 0)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        raise
    return proc.returncode, out, err


def compiler_version(compiler, deadline):
    """The compiler's --version output ('' when it fails); TimeoutExpired at `deadline`."""
    try:
        return run([*compiler, "--version"], deadline)[1]
    except OSError:
        return ""
