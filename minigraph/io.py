"""Saving and loading a net's persistables (parameters, estimates, counters,
velocities, learning rates) as one versioned .npz file.

The file holds one array per persistable, named like the Variable, plus a
`__format__` entry ("minigraph-persistables/1"). Writes are atomic: the old
file stays intact until the new one is complete. Loads check everything
before assigning anything.
"""
from __future__ import annotations

import os
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np

FORMAT_NAME = "minigraph-persistables"
FORMAT_VERSION = 1
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"
FORMAT_KEY = "__format__"
COUNTER_SUFFIX = ".num_batches"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the net, or is not a minigraph checkpoint."""


def save(net, path):
    """Write every persistable of `net` to `path` (an .npz file, written at
    exactly that path). Persistables with no value yet are initialised first.

    Atomic: the data goes to a temporary file in the same directory, is
    flushed and fsynced, then renamed over `path`; if anything fails the old
    file is left as it was and the temporary file is removed. Returns the path.
    """
    path = Path(path)
    if any(v.value is None for v in net.persistables()):
        net.initialize()
    arrays = {FORMAT_KEY: np.array(FORMAT)}
    for var in net.persistables():
        arrays[var.name] = np.asarray(var.get())
    atomic_write(path, lambda f: write_npz(f, arrays))
    return path


def atomic_write(path, write):
    """Create or replace the file at `path` with what `write(f)` writes to a
    binary file object, atomically: a temporary file in the same directory,
    flushed and fsynced, then renamed over `path`. On any failure `path` is
    left as it was and the temporary file is removed. The new file gets the
    old file's permissions, or the usual ones for a new file (0o666 - umask).
    """
    path = Path(path)
    directory = path.parent
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def write_npz(f, arrays):
    """Write {name: array} to the open binary file `f` in numpy's .npz layout
    (any name works, unlike the keyword arguments of np.savez)."""
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in arrays.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def load(net, path):
    """Set every persistable of `net` from the checkpoint at `path`.

    Names, shapes and dtypes are checked against the net first; every
    mismatch (missing, unexpected, wrong shape, wrong dtype) is reported in
    one CheckpointError, and then nothing is assigned. A missing batch-norm
    counter (`*.num_batches`, from checkpoints written without counters) is
    set to 1, "already trained", with a warning, so the first training batch
    does not replace the loaded estimates. Returns the names that were set.
    """
    stored = read_checkpoint(path)
    expected = {v.name: v for v in net.persistables()}
    problems, defaulted = [], []
    for name, var in expected.items():
        if name not in stored:
            if _is_counter(var):
                defaulted.append(name)
            else:
                problems.append(f"missing {name!r} (shape {var.shape}, {var.dtype})")
            continue
        array = stored[name]
        if var.shape is not None and tuple(array.shape) != tuple(var.shape):
            problems.append(f"wrong shape for {name!r}: the net has {tuple(var.shape)}, "
                            f"the file {tuple(array.shape)}")
        if var.dtype is not None and array.dtype != var.dtype:
            problems.append(f"wrong dtype for {name!r}: the net has {var.dtype}, "
                            f"the file {array.dtype}")
    problems += [f"unexpected {name!r} (shape {tuple(a.shape)}, {a.dtype}): not a persistable "
                 "of this net" for name, a in stored.items() if name not in expected]
    if problems:
        raise CheckpointError(f"load {str(path)!r}: the checkpoint does not fit this net "
                              f"({len(problems)} problem(s); nothing was loaded):\n  "
                              + "\n  ".join(problems))
    if defaulted:
        warnings.warn(f"load {str(path)!r}: no batch counter for {', '.join(defaulted)}; "
                      "setting it to 1 (already trained) so the loaded estimates are "
                      "updated with momentum, not replaced by the next batch", stacklevel=2)
    for name, var in expected.items():
        value = stored[name] if name in stored else np.array(1, dtype=np.int64)
        var.set(net.place.to_device(value))
    opt = getattr(net, "optimizer", None)
    if opt is not None and getattr(opt, "lr_var", None) is not None and opt.lr_var.name in stored:
        opt.learning_rate = float(stored[opt.lr_var.name])
    return list(expected)


def read_checkpoint(path):
    """{name: numpy array} of a checkpoint file, without the format entry;
    a CheckpointError unless it is a minigraph checkpoint of a version this
    code reads."""
    try:
        npz = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CheckpointError(f"load {str(path)!r}: not a minigraph checkpoint ({e})") from e
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise CheckpointError(f"load {str(path)!r}: not a minigraph checkpoint (a single "
                              "array, not an .npz archive)")
    with npz:
        try:
            arrays = {name: npz[name] for name in npz.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise CheckpointError(f"load {str(path)!r}: a damaged checkpoint ({e})") from e
    fmt = arrays.pop(FORMAT_KEY, None)
    if fmt is None:
        raise CheckpointError(f"load {str(path)!r}: not a minigraph checkpoint (no "
                              f"{FORMAT_KEY!r} entry; expected {FORMAT!r})")
    fmt = str(fmt[()]) if fmt.shape == () else str(fmt)
    name, _, version = fmt.partition("/")
    if name != FORMAT_NAME:
        raise CheckpointError(f"load {str(path)!r}: unknown format {fmt!r}; expected {FORMAT!r}")
    if version != str(FORMAT_VERSION):
        raise CheckpointError(f"load {str(path)!r}: format version {version!r} is not one this "
                              f"minigraph reads (it reads version {FORMAT_VERSION}, {FORMAT!r})")
    return arrays


def _mode_for(path):
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _is_counter(var):
    return var.name.endswith(COUNTER_SUFFIX) and var.dtype == np.int64 and var.shape == ()


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
