"""Which persistables a load sets, from which arrays of its source: the parts the
caller selects, the parts the source holds, the names of version 1 checkpoints,
and every problem, found before anything is read or assigned.

A checkpoint holds up to three parts (checkpoint_values.part_of): "parameters"
(what layers train, frozen ones too), "estimates" (batch-norm running
estimates and counters, dropout's step: what layers keep but do not train) and
"optimizer" (learning rates, schedule and GradientMerge state, moments,
velocities). A version 2 file lists its parts in its manifest, with a
description of the optimizer that wrote it (its type, name and, for
GradientMerge, k_steps). A version 1 file held every part, and named the
optimizer state without the optimizer's name (`learning_rate_0`,
`fc1.w.velocity`): its names are mapped through the net's optimizers'
`legacy_names`, and a name of that pattern the net does not have counts as
optimizer state.
"""
from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from minigraph.io.checkpoint_values import PARTS, part_of

MODEL_PARTS = frozenset(("parameters", "estimates"))
COUNTER_SUFFIX = ".num_batches"
LEGACY_STATE = re.compile(r"learning_rate_\d+(\.step|\.plateau)?|gradient_merge_\d+\.step|"
                          r".+\.(velocity|moment1|moment2|beta1_pow|beta2_pow|merged_grad)")


def selection(parts, strict, who):
    """The parts (a frozenset) a load or save with `parts` and `strict` takes: None is
    every part for a save and a strict load, parameters and estimates for a load
    with strict=False; otherwise a non-empty collection of names from PARTS."""
    if parts is None:
        return frozenset(PARTS) if strict else MODEL_PARTS
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Collection):
        raise TypeError(f"{who}: parts must be None or a collection of part names, such as "
                        f"{{'parameters', 'estimates'}}, got {type(parts).__name__} "
                        f"{parts!r:.60}")
    chosen = list(parts)
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise ValueError(f"{who}: unknown part {unknown[0]!r}; the parts are "
                         f"{', '.join(map(repr, PARTS))}")
    if not chosen:
        raise ValueError(f"{who}: parts is empty; name at least one of "
                         f"{', '.join(map(repr, PARTS))}")
    return frozenset(chosen)


def optimizers(net):
    """The net's optimizer and, inside a GradientMerge, the one it wraps (outer first)."""
    found, opt = [], getattr(net, "optimizer", None)
    while opt is not None:
        found.append(opt)
        opt = getattr(opt, "inner", None)
    return found


def manifest(net, chosen):
    """The manifest of a file holding the persistables `chosen` of `net` in the parts
    chosen: {"parts": {part: [names]}, "optimizer": the optimizer's describe() when
    its state is saved, else None}."""
    parts = {p: [v.name for v in net.persistables() if part_of(v) == p]
             for p in PARTS if p in chosen}
    describe = getattr(getattr(net, "optimizer", None), "describe", None)
    described = describe() if describe is not None and "optimizer" in chosen else None
    return {"parts": parts, "optimizer": described}


@dataclass(frozen=True)
class Source:
    """One array a load may take: its key in the source, shape, dtype, and the part
    the source says it belongs to (None: unknown)."""

    key: str
    shape: tuple
    dtype: np.dtype
    part: str | None = None

    @property
    def nbytes(self):
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass
class Match:
    """What a load does: `take` {net name: (Variable, Source)}; counters set to 1
    (`defaulted`); `missing` and `unexpected` names; `problems` (each a line)."""

    take: dict = field(default_factory=dict)
    defaulted: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def legacy_renames(net):
    """{version 1 name: name now} of the state of net's optimizers."""
    return {old: new for opt in optimizers(net)
            for new, old in getattr(opt, "legacy_names", {}).items() if old != new}


def checkpoint_sources(net, entries, version, manifest_):
    """{net name: Source} of a checkpoint's entries ({key: npz.Entry}), and the parts
    the file holds (a frozenset)."""
    if version >= 2:
        part = {key: p for p, keys in manifest_["parts"].items() for key in keys}
        held = frozenset(manifest_["parts"])
    else:
        names = {v.name: v for v in net.persistables()}
        part = {key: part_of(names[key]) if key in names else
                "optimizer" if LEGACY_STATE.fullmatch(key) else None for key in entries}
        held = frozenset(PARTS)
    renames = legacy_renames(net) if version < 2 else {}
    sources = {}
    for key, entry in entries.items():
        sources[key if key not in renames or net.scope.find_local_var(key) else
                renames[key]] = Source(key, entry.shape, entry.dtype, part[key])
    return sources, held


def match(net, sources, held, selected, strict, explicit, described=None):
    """Match `sources` ({net name: Source}; a source holding the parts `held`,
    written by the optimizer `described`, a manifest's description) with the
    persistables of `net` in the parts `selected`. A selected part the source does
    not hold, where the net has persistables, is an error when the selection was
    `explicit` or `strict`. Each problem is a line of Match.problems (nothing is
    assigned then)."""
    found = Match()
    names = [v.name for v in net.persistables()
             if part_of(v) in selected and part_of(v) not in held]
    lacking = [p for p in PARTS if p in selected and p not in held and any(
        part_of(v) == p for v in net.persistables())]
    if lacking and (strict or explicit):
        found.problems.append(
            f"the file holds no {' or '.join(lacking)} (it holds {', '.join(sorted(held))}), "
            f"so it cannot set {_some(names) or 'them'}"
            + ("; load it with parts=" + repr(sorted(selected & held)) if selected & held
               and strict and not explicit else ""))
        return found
    ours = {v.name: v for v in net.persistables()}
    wanted = {n: v for n, v in ours.items() if part_of(v) in selected}
    for name, var in wanted.items():
        src = sources.get(name)
        if src is not None:
            found.problems += _mismatch(name, var, src)
            found.take[name] = (var, src)
        elif _is_counter(var) and (strict or _estimates_loaded(name, sources, ours)):
            found.defaulted.append(name)
        elif strict:
            found.problems.append(f"missing {name!r} (shape {var.shape}, {var.dtype})")
        else:
            found.missing.append(name)
    found.unexpected = [n for n, src in sources.items() if n not in ours and
                        (src.part is None or src.part in selected)]
    if strict:
        found.problems += [f"unexpected {n!r} (shape {sources[n].shape}, {sources[n].dtype}): "
                           "not a persistable of this net" for n in found.unexpected]
    if "optimizer" in selected:
        found.problems += optimizer_problems(net, found.problems, described)
    return found


def optimizer_problems(net, problems, described):
    """Complaints about restoring the optimizer state of a file into `net`: a
    GradientMerge of other k_steps; when there are other `problems`, a line saying
    which optimizer wrote the file (`described`) and which one the net has."""
    found = []
    ours = {getattr(o, "name", None): o for o in optimizers(net)}
    theirs = _described(described)
    for name, desc in theirs.items():
        opt = ours.get(name)
        if desc.get("type") == "GradientMerge" and getattr(opt, "k_steps", None) is not None \
                and desc.get("k_steps") != opt.k_steps:
            found.append(f"the file's GradientMerge {name!r} accumulated over k_steps="
                         f"{desc.get('k_steps')!r}, this net's accumulates over k_steps="
                         f"{opt.k_steps}: its merged gradients and step counter would mean "
                         "something else; build it with the file's k_steps, or leave the "
                         "optimizer state out (parts=['parameters', 'estimates'])")
    if (problems or found) and theirs and \
            [d.get("type") for d in theirs.values()] != [type(o).__name__ for o in ours.values()]:
        found.append("the file's optimizer state was written by "
                     + " around ".join(f"{d.get('type')} {n!r}" for n, d in theirs.items())
                     + "; this net's optimizer is "
                     + (" around ".join(f"{type(o).__name__} {n!r}" for n, o in ours.items())
                        or "none"))
    return found


def _described(desc):
    """{name: description} of a manifest's optimizer description, outer first."""
    found = {}
    while isinstance(desc, dict):
        found[str(desc.get("name"))] = desc
        desc = desc.get("inner")
    return found


def _mismatch(name, var, src):
    problems = []
    if var.shape is not None and tuple(src.shape) != tuple(var.shape):
        problems.append(f"wrong shape for {name!r}: the net has {tuple(var.shape)}, "
                        f"the file {tuple(src.shape)}")
    if var.dtype is not None and src.dtype != var.dtype:
        problems.append(f"wrong dtype for {name!r}: the net has {var.dtype}, "
                        f"the file {src.dtype}")
    if var.shape is None and not problems:
        # a persistable of unknown shape: still no bigger than what it held before
        have = var.value
        if have is not None and src.nbytes > have.nbytes:
            problems.append(f"wrong size for {name!r}: the file holds {src.nbytes} bytes")
    return problems


def _is_counter(var):
    return var.name.endswith(COUNTER_SUFFIX) and var.dtype == np.int64 and var.shape == ()


def _estimates_loaded(counter_name, sources, ours):
    """Whether `sources` hold another estimate of the counter's layer (a file written
    without counters), so the counter must say "already trained"."""
    layer = counter_name[:-len(COUNTER_SUFFIX)] + "."
    return any(name.startswith(layer) and name in ours and
               part_of(ours[name]) == "estimates" for name in sources)


def _some(names, at_most=8):
    shown = ", ".join(map(repr, names[:at_most]))
    return shown + (f" and {len(names) - at_most} more" if len(names) > at_most else "")
