"""Files, written atomically and read only when they are regular files.

Writing (`atomic_write`): a temporary file beside the target, flushed, fsynced
and renamed over it, so a reader sees the old file or the new one, never half
of one. A symlink is followed to the file it names, which is replaced the same
way (the link stays a link); a target that exists and is not a regular file
(a device such as /dev/full, a FIFO, a socket, a folder) is refused. Each
temporary file's name carries this host and process, so the next save to the
same path removes what a killed save left. Errors name the caller's path,
never the temporary file.

Reading (`open_regular`): opened without blocking (a FIFO with no writer would
wait forever) and checked to be a regular file before anything is read, so a
device such as /dev/zero is refused instead of being read until memory runs out.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import stat
import tempfile
from pathlib import Path

MAX_LINKS = 40                  # as the kernel's limit on symlinks in one lookup
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def atomic_write(path, write):
    """Create or replace the file at `path` with what `write(f)` writes to a
    binary file object, atomically: a temporary file in the target's directory,
    flushed and fsynced, then renamed over the target. The target is `path`, or
    the file a symlink at `path` names (through a chain of links; the links are
    kept). A target that is not a regular file is an OSError saying so, and a
    folder an IsADirectoryError; nothing is written then. On any failure the
    target is left as it was and the temporary file is removed; an OSError
    about the temporary file is raised again (same type and errno) naming
    `path`. The new file gets the old file's permissions, or the usual ones for
    a new file (0o666 - umask). Temporary files of saves to the same target
    whose process is gone (killed mid-save) are removed first. Returns `path`
    as a Path.
    """
    path = Path(path)
    target = final_target(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise type(e)(e.errno, e.strerror or str(e), str(path)) from e
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
        raise OSError(errno.EINVAL, f"{_kind(st)}{_via(path, target)}, not a regular file; "
                      "minigraph writes regular files only (it never replaces a device, "
                      "FIFO or socket)", str(path))
    directory = target.parent
    prefix = _prefix(target.name)
    _remove_stale(directory, prefix)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{prefix}{_owner_tag()}.",
                                   suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as e:
        _remove(tmp)
        about_tmp = tmp is None or e.filename in (tmp, None) or e.filename2 == tmp
        if about_tmp and e.errno is not None:
            raise type(e)(e.errno, e.strerror or str(e), str(path)) from e
        raise
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(directory)
    return path


def final_target(path):
    """The path a write to `path` lands on: `path` itself, or, for a symlink, the
    file its chain of links names (which may not exist yet). Too many links (a
    loop) is an OSError (ELOOP) naming `path`."""
    path = Path(path)
    current = path
    for _ in range(MAX_LINKS):
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return current
        except OSError as e:
            raise type(e)(e.errno, e.strerror or str(e), str(path)) from e
        if not stat.S_ISLNK(st.st_mode):
            return current
        link = os.readlink(current)
        current = Path(os.path.realpath(current.parent)) / link
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))


def open_regular(path, max_bytes=None):
    """`path` opened for binary reading, after checking (on the open file) that it
    is a regular file, and, when `max_bytes` is given, no larger. Raises
    FileNotFoundError for a missing file, IsADirectoryError for a folder and
    NotRegularFile (an OSError) for anything else that is not a regular file or
    is too large; never blocks on a FIFO."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__} "
                        f"{path!r}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", os.fsdecode(path))
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{_kind(st)}, not a regular file",
                                 os.fsdecode(path))
        if max_bytes is not None and st.st_size > max_bytes:
            raise NotRegularFile(errno.EFBIG, f"{st.st_size} bytes, more than the "
                                 f"{max_bytes} this file may hold", os.fsdecode(path))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    # outside the try: once the file object exists it owns fd, and a Ctrl-C arriving
    # as it is made must not close fd a second time (another open may reuse its number)
    return os.fdopen(fd, "rb")


class NotRegularFile(OSError):
    """A file that minigraph will not read: a device, FIFO or socket, or too large."""


def _kind(st):
    for test, name in _KINDS:
        if test(st.st_mode):
            return name
    return "not a file"


def _via(path, target):
    return "" if Path(path) == target else f" (the symlink's target {str(target)!r})"


def _prefix(name):
    """The start of the temporary files' names of saves to the file `name`."""
    if len(name) > 120:           # keep the temporary name within the 255-byte limit
        name = name[:100] + "~" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return f".{name}."


def _owner_tag():
    """This host (hashed) and process: `host-pid`, so a later save can tell whose
    temporary file it sees."""
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"{host}-{os.getpid()}"


def _remove_stale(directory, prefix):
    """Remove temporary files `prefix` + `host-pid.*.tmp` of this host whose process
    has ended (a save killed before it could clean up)."""
    host = _owner_tag().split("-")[0]
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        owner = name[len(prefix):].split(".", 1)[0]
        their_host, _, pid = owner.partition("-")
        if their_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True               # someone else's process
    return True


def _remove(tmp):
    if tmp is not None and os.path.exists(tmp):
        os.unlink(tmp)


def _umask():
    """The process's umask, read without changing it where /proc says it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def fsync_dir(directory):
    """fsync `directory` (so a rename in it is durable) where the platform allows."""
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
