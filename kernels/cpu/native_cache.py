"""The native kernels' cache directory: what may be loaded from it, and how an entry
is published there (kernels/cpu/native.py builds; see its module doc).

An entry `<name>-<key>.so` is loaded only when the directory, and every one above
it, is writable by no other user (`check_private`), the entry is a regular file of
this user's (or root's) that no one else can write, and its bytes, read from the
same open file that is then loaded, match the SHA-256 in `<entry>.sha256`
(`load_verified`). The builder writes that digest (`write_digest`) after the
library is complete, fsynced and renamed into place. Builders take turns on the
directory (`build_turn`), so processes started together build each entry once.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import stat
import tempfile
import time

MAX_LIBRARY_BYTES = 64 << 20
DIGEST_SUFFIX = ".sha256"
STALE_TEMP_S = 600.0           # a temporary file older than this is a killed build's

_held = []              # descriptors of loaded libraries, never closed (see dlopen)


class UnsafeCache(Exception):
    """The cache directory (or one above it) can be written by another user."""


def cache_dir():
    """$MINIGRAPH_CACHE, else $XDG_CACHE_HOME/minigraph, else ~/.cache/minigraph."""
    root = os.environ.get("MINIGRAPH_CACHE")
    if root:
        return pathlib.Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "minigraph"


def load_verified(path):
    """The library at `path` when it passes every check (see the module doc), else
    None (then the caller builds it anew)."""
    expected = _read_digest(path.with_name(path.name + DIGEST_SUFFIX))
    if expected is None:
        return None
    try:
        with _trusted(path, MAX_LIBRARY_BYTES) as (fd, data):
            if data is None or hashlib.sha256(data).hexdigest() != expected:
                return None
            return dlopen(fd, path)
    except OSError:
        return None


def _read_digest(path):
    with _trusted(path, 256) as (_, data):
        text = (data or b"").decode("ascii", "replace").split()
    if len(text) == 1 and len(text[0]) == 64 and all(c in "0123456789abcdef" for c in text[0]):
        return text[0]
    return None


def read_trusted(path, limit):
    """The bytes of `path` when it is a regular file of this user's (or root's) that no
    one else can write, opened without following a symlink and at most `limit` bytes;
    else None."""
    with _trusted(path, limit) as (_, data):
        return data


@contextlib.contextmanager
def _trusted(path, limit):
    """(fd, bytes) of `path` opened without following a symlink, read from the same
    open file, while the block runs; bytes None (fd possibly None) when it cannot be
    opened, is not a regular file this user (or root) owns that no one else can
    write, is over `limit` bytes, or changed size while read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield None, None
        return
    try:
        st = os.fstat(fd)
        ok = _trusted_file(st) and st.st_size <= limit
        yield fd, read_all(fd, st.st_size) if ok else None
    finally:
        os.close(fd)


def read_all(fd, size):
    """Exactly `size` bytes from `fd`'s start, or None when the file changed size."""
    chunks, got = [], 0
    os.lseek(fd, 0, os.SEEK_SET)
    while got < size:
        chunk = os.read(fd, min(1 << 20, size - got))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    if os.read(fd, 1):
        return None
    return b"".join(chunks)


def dlopen(fd, path):
    """Load the file open as `fd` (the bytes just verified, not whatever `path` names
    by now); by path only where /proc/self/fd does not exist. The loader knows a
    library by the name it was opened under, so the descriptor of a loaded one is
    kept open for good: its /proc/self/fd name then never names another file."""
    by_fd = f"/proc/self/fd/{fd}"
    if not os.path.exists(by_fd):
        return ctypes.CDLL(str(path))
    held = os.dup(fd)
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{held}")
    except BaseException:
        os.close(held)
        raise
    _held.append(held)
    return lib


def _trusted_file(st):
    return (stat.S_ISREG(st.st_mode) and st.st_uid in (os.geteuid(), 0)
            and not st.st_mode & 0o022)


def check_private(directory):
    """Raise UnsafeCache unless no other user can write `directory` or replace it:
    it is owned by this user (or root) with no group or other write bit, and so
    is every directory above it (there, a sticky bit stands in for the owner)."""
    real = pathlib.Path(os.path.realpath(directory))
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{real} is not a directory")
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
        raise UnsafeCache(_unsafe(directory, real, st, "it"))
    for parent in real.parents:
        pst = os.stat(parent)
        if pst.st_uid not in (os.geteuid(), 0) or \
                (pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX):
            raise UnsafeCache(_unsafe(directory, parent, pst, "the directory above it"))


def _unsafe(directory, where, st, what):
    return (f"the cache directory {str(directory)!r} is writable by other users ({what}, "
            f"{str(where)!r}, is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}); anyone who can write there could plant code. "
            f"Use a directory only you can write: chmod go-w it, or set MINIGRAPH_CACHE")


def write_digest(target, digest):
    """`<target>.sha256` holding `digest` (write_text: a reader sees a whole digest or
    none)."""
    write_text(target.with_name(target.name + DIGEST_SUFFIX), digest + "\n")


def write_text(path, text):
    """`path` (mode 0644) holding `text`, written to a temporary file beside it, fsynced
    and renamed into place: a reader sees the whole text or what was there before. An
    OSError leaves `path` as it was and no temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        pathlib.Path(tmp).unlink(missing_ok=True)


@contextlib.contextmanager
def build_turn(directory, wait_s):
    """Take the cache directory's build turn for the block: an exclusive flock on the
    directory itself (no lock file is left behind), released when the block ends or
    the process dies. Processes started together (pytest's workers, a job's ranks)
    then build each entry once and the others load it: the caller looks for the entry
    again inside the block. Yields the seconds it waited. After `wait_s` it stops
    waiting and the block runs without the turn, as where flock does not exist or the
    file system refuses it."""
    try:
        import fcntl
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (ImportError, OSError):    # not POSIX, or no such directory: no turns
        yield 0.0
        return
    start = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - start >= wait_s:
                    break             # the holder is stuck: build without the turn
                time.sleep(0.02)
            except OSError:           # a file system without locks
                break
        yield time.monotonic() - start
    finally:
        os.close(fd)


def remove_stale_temporaries(directory):
    """Remove what builds killed mid-way left (temporary files older than STALE_TEMP_S)."""
    now = time.time()
    try:
        for entry in os.scandir(directory):
            if entry.name.startswith(".") and entry.name.endswith((".tmp", ".c")):
                try:
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                        os.unlink(entry.path)
                except OSError:
                    pass
    except OSError:
        pass
