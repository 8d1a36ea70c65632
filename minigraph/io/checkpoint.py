"""Saving and loading a net's persistables (parameters, estimates, counters,
velocities, learning rates) as one versioned .npz file.

The file holds one array per persistable, named like the Variable, plus a
`__format__` entry ("minigraph-persistables/1"). Writes are atomic: the old
file stays intact until the new one is complete. Loads check the whole file
(its zip directory and every array's header, see minigraph.io.npz) against the
net before reading any data, and assign nothing unless everything fits.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from minigraph.io import checkpoint_values
from minigraph.io.files import atomic_write
from minigraph.io.npz import CHECKPOINT_FORMAT, FORMAT_KEY, Archive, CheckpointError, write_npz
from minigraph.scope import host_array

FORMAT = CHECKPOINT_FORMAT              # "minigraph-persistables/1"
FORMAT_NAME, FORMAT_VERSION = FORMAT.split("/")[0], int(FORMAT.split("/")[1])
COUNTER_SUFFIX = ".num_batches"


def save(net, path):
    """Write every persistable of `net` to `path` (an .npz file, written at
    exactly that path). Persistables with no value yet are initialised first.

    Atomic: the data goes to a temporary file in the same directory, is
    flushed and fsynced, then renamed over `path`; if anything fails the old
    file is left as it was, the temporary file is removed, and the error names
    `path`. Returns the path. A data-parallel net on several ranks in the middle
    of a GradientMerge accumulation (each rank holds its own merged gradients)
    is a ValueError: mg.distributed.save averages them first.
    """
    _check_arguments("save", net, path)
    path = Path(path)
    from minigraph.distributed.merge import check_saveable

    check_saveable(net, f"save {str(path)!r}")
    if any(v.value is None for v in net.persistables()):
        net.initialize()
    arrays = {FORMAT_KEY: np.array(FORMAT)}
    for var in net.persistables():
        if var.name == FORMAT_KEY:
            raise ValueError(f"save {str(path)!r}: the persistable name {FORMAT_KEY!r} is "
                             "reserved for the checkpoint's format entry")
        arrays[var.name] = host_array(var)
    return atomic_write(path, lambda f: write_npz(f, arrays))


def load(net, path, strict=True):
    """Set the persistables of `net` from the checkpoint at `path`.

    The file is checked before any data is read (see minigraph.io.npz): a
    damaged file is "damaged minigraph checkpoint", a zip without the format
    entry "not a minigraph checkpoint". Then names, shapes and dtypes are
    checked against the net, and every problem is reported in one
    CheckpointError; then nothing is assigned. A shape or dtype mismatch is
    always such an error, and so is a learning rate (the net's optimizer's
    `lr_var`) that is NaN, infinite or negative.

    strict=True: every persistable of the net must be in the file and
    nothing else; returns the names that were set. strict=False: loads the
    persistables that match by name (an inference-only twin of a trained net
    loads its training checkpoint) and returns `(missing, unexpected)`: the
    net's persistables the file lacks (left as they were) and the file's
    arrays the net lacks (ignored), as torch's load_state_dict(strict=False).

    A missing batch-norm counter (`*.num_batches`, from checkpoints written
    without counters) is set to 1, "already trained", with a warning, so the
    first training batch does not replace the loaded estimates; with
    strict=False only when another persistable of that layer is loaded.

    Values are checked too (minigraph.io.checkpoint_values): every float value
    finite, counters (integer scalars: batch counters, schedule and
    GradientMerge steps) >= 0, batch-norm variance estimates >= 0, the
    learning rate a finite number >= 0, a ReduceOnPlateau state one that its
    step() can reach; a value that fails is a CheckpointError naming the
    variable, and nothing is loaded.
    """
    _check_arguments("load", net, path)
    if not isinstance(strict, bool):
        raise TypeError(f"load: strict must be True or False, got {strict!r}")
    what = f"load {str(path)!r}"
    with Archive(path, what, FORMAT) as archive:
        stored = archive.entries
        expected = {v.name: v for v in net.persistables()}
        problems, defaulted, missing = [], [], []
        for name, var in expected.items():
            if name in stored:
                problems += _mismatch(name, var, stored[name])
            elif _is_counter(var) and (strict or _layer_loaded(name, stored)):
                defaulted.append(name)
            elif strict:
                problems.append(f"missing {name!r} (shape {var.shape}, {var.dtype})")
            else:
                missing.append(name)
        unexpected = [name for name in stored if name not in expected]
        if strict:
            problems += [f"unexpected {name!r} (shape {stored[name].shape}, "
                         f"{stored[name].dtype}): not a persistable of this net"
                         for name in unexpected]
        _refuse(what, problems)
        values = {name: archive.read(name) for name in expected if name in stored}
    _refuse(what, checkpoint_values.problems(net, values))
    if defaulted:
        warnings.warn(f"{what}: no batch counter for {', '.join(defaulted)}; setting it to 1 "
                      "(already trained) so the loaded estimates are updated with momentum, "
                      "not replaced by the next batch", stacklevel=2)
    for name in defaulted:
        values[name] = np.array(1, dtype=np.int64)
    for name, value in values.items():
        expected[name].set(net.place.to_device(value))
    opt = getattr(net, "optimizer", None)
    lr_var = checkpoint_values.learning_rate_var(net)
    if lr_var is not None and lr_var.name in values and \
            not isinstance(getattr(type(opt), "learning_rate", None), property):
        opt.learning_rate = float(values[lr_var.name])      # optimizers that keep a copy
    if strict:
        return list(expected)
    return missing, unexpected


def read_checkpoint(path):
    """{name: numpy array} of a checkpoint file, without the format entry,
    read with every check of `load`; a CheckpointError unless it is an
    undamaged minigraph checkpoint of a version this code reads."""
    with Archive(path, f"load {str(path)!r}", FORMAT) as archive:
        return {name: archive.read(name) for name in archive.entries}


def _mismatch(name, var, entry):
    problems = []
    if var.shape is not None and tuple(entry.shape) != tuple(var.shape):
        problems.append(f"wrong shape for {name!r}: the net has {tuple(var.shape)}, "
                        f"the file {tuple(entry.shape)}")
    if var.dtype is not None and entry.dtype != var.dtype:
        problems.append(f"wrong dtype for {name!r}: the net has {var.dtype}, "
                        f"the file {entry.dtype}")
    if var.shape is None and not problems:
        # a persistable of unknown shape: still no bigger than what it held before
        have = var.value
        if have is not None and entry.nbytes > have.nbytes:
            problems.append(f"wrong size for {name!r}: the file holds {entry.nbytes} bytes")
    return problems


def _refuse(what, problems):
    if problems:
        raise CheckpointError(f"{what}: the checkpoint does not fit this net "
                              f"({len(problems)} problem(s); nothing was loaded):\n  "
                              + "\n  ".join(problems))


def _check_arguments(who, net, path):
    from minigraph.net import Net

    if not isinstance(net, Net):
        raise TypeError(f"{who}: net must be a minigraph Net, got {type(net).__name__} "
                        f"{net!r:.60}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{who}: path must be a str or os.PathLike (a file name), got "
                        f"{type(path).__name__} {path!r:.60}")


def _is_counter(var):
    return var.name.endswith(COUNTER_SUFFIX) and var.dtype == np.int64 and var.shape == ()


def _layer_loaded(counter_name, stored):
    layer = counter_name[:-len(COUNTER_SUFFIX)] + "."
    return any(name.startswith(layer) for name in stored)
