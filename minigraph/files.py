"""Writing files atomically: a temporary file beside the target, flushed,
fsynced and renamed over it, so a reader sees the old file or the new one,
never half of one. Errors name the caller's path, never the temporary file.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path, write):
    """Create or replace the file at `path` with what `write(f)` writes to a
    binary file object, atomically: a temporary file in the same directory,
    flushed and fsynced, then renamed over `path`. On any failure `path` is
    left as it was and the temporary file is removed; an OSError about the
    temporary file is raised again (same type and errno) naming `path`. The
    new file gets the old file's permissions, or the usual ones for a new
    file (0o666 - umask). Returns `path` as a Path.
    """
    path = Path(path)
    directory = path.parent
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        about_tmp = tmp is None or e.filename in (tmp, None) or e.filename2 == tmp
        if about_tmp and e.errno is not None:
            raise type(e)(e.errno, e.strerror or str(e), str(path)) from e
        raise
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(directory)
    return path


def _remove(tmp):
    if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)


def _mode_for(path):
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return                      # not possible on every platform; the data is synced
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
