"""Saving and loading a net's persistables (parameters, estimates, counters,
optimizer state) as one versioned .npz file, all of them or some parts;
loading parameters from a plain mapping of arrays (`load_parameters`).

The file holds one array per persistable, named like the Variable, a
`__format__` entry ("minigraph-persistables/2") and a `__manifest__` entry
(JSON: the parts it holds and which array is in which, and the optimizer that
wrote the optimizer state; minigraph.io.checkpoint_match). Version 1 files (no
manifest; optimizer state named without its optimizer) still load. Writes
are atomic: the old file stays intact until the new one is complete. Loads
check the whole file (its zip directory and every array's header, see
minigraph.io.npz) against the net before reading any data, and assign nothing
unless everything fits; the assignment is all or nothing (under the net's
lock, signals deferred), so a training step in another thread or a Ctrl-C
never sees half a load. A save takes a copy of every array under the net's
lock, so it holds one whole step.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from minigraph.io import checkpoint_match, checkpoint_values
from minigraph.io.checkpoint_match import MODEL_PARTS, Source
from minigraph.io.files import atomic_write
from minigraph.io.npz import (
    CHECKPOINT_FORMAT,
    Archive,
    CheckpointError,
    header_arrays,
    npz_bytes,
)
from minigraph.journal import deferred_signals
from minigraph.scope import host_array

FORMAT = CHECKPOINT_FORMAT              # "minigraph-persistables/2"
FORMAT_NAME, FORMAT_VERSION = FORMAT.split("/")[0], int(FORMAT.split("/")[1])
PARTS = checkpoint_values.PARTS



def save(net, path, parts=None):
    """Write persistables of `net` to `path` (an .npz file, written at exactly that
    path): every one (parts=None), or those of the parts named, a collection of
    "parameters" (what layers train, frozen ones too), "estimates" (batch-norm
    running estimates and counters, dropout's step) and "optimizer" (learning
    rate, schedule and GradientMerge state, moments, velocities).
    Persistables with no value yet are initialised first.

    The values are copied under the net's lock (so they are those of one whole
    step, whatever other threads run), then written atomically: to a temporary
    file in the same directory, flushed and fsynced, then renamed over `path`;
    if anything fails the old file is left as it was, the temporary file is
    removed, and the error names `path`. Returns the path. Saving the optimizer
    state of a data-parallel net on several ranks in the middle of a
    GradientMerge accumulation (each rank holds its own merged gradients) is a
    ValueError: mg.distributed.save averages them first.
    """
    from minigraph.distributed.merge import check_saveable

    _check_arguments("save", net, path)
    chosen = checkpoint_match.selection(parts, True, "save")
    path = Path(path)
    with net._lock:
        if "optimizer" in chosen:
            check_saveable(net, f"save {str(path)!r}")
        if any(v.value is None for v in net.persistables()):
            net.initialize()
        arrays = header_arrays(FORMAT, checkpoint_match.manifest(net, chosen))
        for var in net.persistables():
            if checkpoint_values.part_of(var) not in chosen:
                continue
            if var.name in arrays:
                raise ValueError(f"save {str(path)!r}: the persistable name {var.name!r} is "
                                 "reserved for the checkpoint's own entries")
            arrays[var.name] = host_array(var)
        data = npz_bytes(arrays)        # the copy of this step's values
    return atomic_write(path, lambda f: f.write(data))


def load(net, path, strict=True, parts=None):
    """Set persistables of `net` from the checkpoint at `path`.

    parts: None, or a collection of part names (see `save`). With None a strict
    load restores everything the file holds (exact resume; the file must hold
    every part the net has), and a load with strict=False restores parameters
    and estimates only, never optimizer state: the fine-tuning case, a net given
    a new optimizer keeps its learning rate, moments and counters. Optimizer
    state is restored only when "optimizer" is selected (or by a strict load
    with parts=None); then a GradientMerge of other k_steps than the file's is
    refused. A selected part the file does not hold is an error naming what it
    cannot set, strict or not.

    The file is checked before any data is read (see minigraph.io.npz): a damaged
    file is "damaged minigraph checkpoint", a zip without the format entry
    "not a minigraph checkpoint". Then names, shapes and dtypes are checked
    against the net, and every problem is reported in one CheckpointError; then
    nothing is assigned. A shape or dtype mismatch is always such an error.

    strict=True: every persistable of the net in the selected parts must be in
    the file, and the file's arrays of those parts must all be persistables of
    the net; returns the names that were set. strict=False: loads the
    persistables of the selected parts that match by name (an inference-only
    twin of a trained net loads its training checkpoint) and returns `(missing,
    unexpected)`: the net's persistables of those parts the file lacks (left as
    they were) and the file's arrays of those parts the net lacks (ignored), as
    torch's load_state_dict(strict=False).

    A missing batch-norm counter (`*.num_batches`, from checkpoints written
    without counters) is set to 1, "already trained", with a warning, so the
    first training batch does not replace the loaded estimates; with
    strict=False only when another persistable of that layer is loaded.

    Values are checked too (minigraph.io.checkpoint_values): every float value
    finite, counters >= 0, batch-norm variance estimates >= 0, the learning
    rate a finite number >= 0, a ReduceOnPlateau state one that its step() can
    reach; a value that fails is a CheckpointError naming the variable, and
    nothing is loaded. The values are then assigned all at once, under the
    net's lock and with signals deferred (minigraph.journal.deferred_signals):
    a Ctrl-C during a load leaves the net as it was or fully loaded.
    """
    _check_arguments("load", net, path)
    if not isinstance(strict, bool):
        raise TypeError(f"load: strict must be True or False, got {strict!r}")
    chosen = checkpoint_match.selection(parts, strict, "load")
    what = f"load {str(path)!r}"
    with Archive(path, what, FORMAT) as archive:
        sources, held = checkpoint_match.checkpoint_sources(net, archive.entries,
                                                            archive.version, archive.manifest)
        described = (archive.manifest or {}).get("optimizer")
        found = checkpoint_match.match(net, sources, held, chosen, strict, parts is not None,
                                       described)
        _refuse(what, found.problems)
        values = {name: archive.read(src.key) for name, (_, src) in found.take.items()}
    _set(net, found, values, what, restore_optimizer="optimizer" in chosen)
    if strict:
        return list(values) + found.defaulted
    return found.missing, found.unexpected


def load_parameters(net, source, strict=True, rename=None):
    """Set the parameters and estimates of `net` (never optimizer state) from a
    plain mapping of arrays: `source` is a mapping {name: numpy array} (for
    example one converted from a PyTorch state_dict) or the path of a plain
    `np.savez` file (no minigraph format entry; read like a checkpoint, with
    allow_pickle=False: nothing is unpickled).

    rename: None, a function or a mapping from a source name to the net's name
    for it; a function returning None (or a mapping giving None) skips that
    array; a mapping leaves the names it lacks as they are.

    Checked like a checkpoint: shapes, dtypes (no conversion: an array of
    another dtype is a mismatch) and values (finite, counters >= 0, variances
    >= 0); every mismatch is named in one CheckpointError, and then nothing is
    set. strict=True: every parameter and estimate of the net must be given and
    every given array must be one (a missing batch-norm counter is set to 1 with
    a warning, as in `load`); returns the names set. strict=False: sets what
    matches and returns `(missing, unexpected)`. The values are assigned all at
    once, as `load` does.
    """
    from minigraph.net import Net

    if not isinstance(net, Net):
        raise TypeError(f"load_parameters: net must be a minigraph Net, got "
                        f"{type(net).__name__} {net!r:.60}")
    if not isinstance(strict, bool):
        raise TypeError(f"load_parameters: strict must be True or False, got {strict!r}")
    if rename is not None and not callable(rename) and not isinstance(rename, Mapping):
        raise TypeError(f"load_parameters: rename must be None, a function or a mapping of "
                        f"names, got {type(rename).__name__}")
    if isinstance(source, Mapping):
        what = "load_parameters (a mapping)"
        arrays = _mapping_arrays(source, what)
        found = _match_parameters(net, {k: Source(k, a.shape, a.dtype)
                                        for k, a in arrays.items()}, strict, rename, what)
        values = {name: arrays[src.key] for name, (_, src) in found.take.items()}
    elif isinstance(source, (str, os.PathLike)):
        what = f"load_parameters {str(source)!r}"
        with Archive(source, what, None) as archive:
            if archive.format is not None:
                raise CheckpointError(f"{what}: a minigraph checkpoint ({archive.format!r}), "
                                      "not a plain .npz of arrays; load its parameters with "
                                      "mg.io.load(net, path, parts=['parameters'])")
            found = _match_parameters(net, {k: Source(k, e.shape, e.dtype) for k, e in
                                            archive.entries.items()}, strict, rename, what)
            values = {name: archive.read(src.key) for name, (_, src) in found.take.items()}
    else:
        raise TypeError(f"load_parameters: source must be a mapping of names to arrays or the "
                        f"path of an .npz file, got {type(source).__name__} {source!r:.60}")
    _set(net, found, values, what, restore_optimizer=False)
    if strict:
        return list(values) + found.defaulted
    return found.missing, found.unexpected


def read_checkpoint(path):
    """{name: numpy array} of a checkpoint file (its names as stored), without the
    format and manifest entries, read with every check of `load`; a
    CheckpointError unless it is an undamaged minigraph checkpoint of a version
    this code reads."""
    with Archive(path, f"load {str(path)!r}", FORMAT) as archive:
        return {name: archive.read(name) for name in archive.entries}


def _set(net, found, values, what, restore_optimizer):
    """Check `values`, then give them to their Variables all at once (see `load`)."""
    _refuse(what, checkpoint_values.problems(net, values))
    if found.defaulted:
        warnings.warn(f"{what}: no batch counter for {', '.join(found.defaulted)}; setting it "
                      "to 1 (already trained) so the loaded estimates are updated with "
                      "momentum, not replaced by the next batch", stacklevel=3)
    values = {**values, **{name: np.array(1, dtype=np.int64) for name in found.defaulted}}
    variables = {v.name: v for v in net.persistables()}
    ready = [(variables[name], net.place.to_device(value)) for name, value in values.items()]
    opt = getattr(net, "optimizer", None)
    lr_var = checkpoint_values.learning_rate_var(net)
    copy_rate = restore_optimizer and lr_var is not None and lr_var.name in values and \
        not isinstance(getattr(type(opt), "learning_rate", None), property)
    with net._lock, deferred_signals():
        for var, value in ready:
            var.value = value
        if copy_rate:
            opt.learning_rate = float(values[lr_var.name])      # optimizers that keep a copy


def _mapping_arrays(source, what):
    arrays, problems = {}, []
    for key, value in source.items():
        if not isinstance(key, str):
            raise TypeError(f"{what}: names must be str, got {type(key).__name__} {key!r:.60}")
        array = np.asarray(value)
        if array.dtype.kind not in "biufc":
            problems.append(f"{key!r} holds {array.dtype}, not numbers")
        arrays[key] = np.asarray(array, order="C")
    _refuse(what, problems)
    return arrays


def _renamed(sources, rename, what):
    """{net name: Source} after `rename`; two sources for one name is an error."""
    if rename is None:
        return sources
    out = {}
    for key, src in sources.items():
        name = rename.get(key, key) if isinstance(rename, Mapping) else rename(key)
        if name is None:
            continue
        if not isinstance(name, str):
            raise TypeError(f"{what}: rename gave {type(name).__name__} {name!r:.60} for "
                            f"{key!r}; it must give a str or None")
        if name in out:
            raise CheckpointError(f"{what}: rename gives {name!r} for both {out[name].key!r} "
                                  f"and {key!r}")
        out[name] = src
    return out


def _match_parameters(net, sources, strict, rename, what):
    """checkpoint_match.match of `sources` renamed, for the net's parameters and
    estimates; a name of the net's optimizer state is unexpected (an error when
    strict); every problem is raised."""
    sources = _renamed(sources, rename, what)
    ours = {v.name: v for v in net.persistables()}
    state = [n for n in sources if n in ours and
             checkpoint_values.part_of(ours[n]) not in MODEL_PARTS]
    found = checkpoint_match.match(net, {n: s for n, s in sources.items() if n not in state},
                                   MODEL_PARTS, MODEL_PARTS, strict, False)
    found.unexpected += state
    if strict:
        found.problems += [f"unexpected {n!r}: optimizer state, which load_parameters never "
                           "sets" for n in state]
    _refuse(what, found.problems, "the arrays do not fit this net")
    return found


def _refuse(what, problems, why="the checkpoint does not fit this net"):
    if problems:
        raise CheckpointError(f"{what}: {why} "
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

