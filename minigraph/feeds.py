"""Feeds and fetches: what a caller names, resolved to a net's Variables and checked.

A feed is {data name or data Variable: array}; each value is checked against
its Variable's declared dtype and shape (-1 matches any size) and stored on
the net's place as a copy the net owns. A fetch is a Variable of the net or a
name; a Variable of the other branch stands for its copy in the branch that
runs. The exporters resolve their feeds and fetches the same way
(`io_variables`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np

from minigraph.scope import Variable
from minigraph.validators import is_int

DATA_KINDS = "biuf"          # bool, signed and unsigned ints, floats


def data_declaration(name, shape, dtype):
    """(shape as a tuple of ints, np.dtype) of a data input `name`, or a TypeError /
    ValueError naming it: every size an int >= 0 or -1 (no float, str or bool),
    and a numeric or bool dtype (not object, str, bytes, void or datetime)."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"data {name!r}: shape must be a tuple of ints, got {shape!r}")
    shape = tuple(shape)
    if not all(is_int(d) for d in shape):
        raise TypeError(f"data {name!r}: shape must be a tuple of ints (-1 for a size each "
                        f"feed gives), got {shape!r}")
    shape = tuple(int(d) for d in shape)
    if any(d < -1 for d in shape):
        raise ValueError(f"data {name!r}: every size must be >= 0, or -1 for a size each feed "
                         f"gives, got {shape}")
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"data {name!r}: dtype must be a numeric or bool numpy dtype, got "
                        f"{dtype!r} ({e})") from None
    if dt.kind not in DATA_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(f"data {name!r}: dtype must be a numeric or bool numpy dtype "
                        f"(float32, int64, ...), got {dt}")
    return shape, dt


def check_fetch_list(fetch, who):
    """`fetch` as a list, or a TypeError naming `who`: a fetch list holds Variables or
    names, and a lone name or Variable is not one (a str would be read per character)."""
    if isinstance(fetch, (str, bytes, Variable, Mapping)) or not hasattr(fetch, "__iter__"):
        hint = f" (fetch=[{fetch!r}])" if isinstance(fetch, str) else ""
        raise TypeError(f"{who}: fetch must be a list of Variables or names, got "
                        f"{type(fetch).__name__} {fetch!r:.60}{hint}")
    return list(fetch)


def fetch_targets(net, mode, fetch):
    """The Variables `mode` computes for the fetch list `fetch` (see fetch_target)."""
    return tuple(fetch_target(net, mode, f) for f in check_fetch_list(fetch, mode))


def check_feed(var, value):
    """`value` as an array matching `var`'s declared dtype and shape, or a clear error."""
    value = np.asarray(value)
    if var.decl_dtype is not None and value.dtype != var.decl_dtype:
        raise TypeError(f"feed {var.name!r}: expected dtype {var.decl_dtype}, got {value.dtype} "
                        f"(convert with .astype({str(var.decl_dtype)!r}))")
    shape = var.decl_shape
    if shape is not None and (len(shape) != value.ndim or
                              any(d >= 0 and d != s for d, s in zip(shape, value.shape))):
        want = "(" + ", ".join("N" if d < 0 else str(d) for d in shape) + ")"
        raise ValueError(f"feed {var.name!r}: expected shape {want}, got {value.shape}")
    return value


def check_feed_mapping(feed, who):
    """`feed` ({} for None) when it is a mapping; else a TypeError naming `who` that
    says what a feed is (an array, a list of pairs, 0 or a string is not one)."""
    if feed is None:
        return {}
    if not isinstance(feed, Mapping):
        if isinstance(feed, np.ndarray):
            got = f"an array ({feed.dtype}, shape {feed.shape})"
        else:
            got = f"{type(feed).__name__} {' '.join(repr(feed).split())[:40]}"
        raise TypeError(f"{who}: feed must be a dict {{data name or data Variable: array}}, "
                        f"e.g. feed={{'image': x, 'label': y}}; got {got}")
    return feed


def feed_by_name(data_vars, feed, who="feed"):
    """{data name: value} of `feed`, whose keys may be names or the data Variables
    themselves; `data_vars` is the net's {name: data Variable}. None is no feed;
    anything but a mapping is a TypeError naming `who` (check_feed_mapping)."""
    feed = check_feed_mapping(feed, who)
    named = {}
    for key, value in feed.items():
        if isinstance(key, Variable):
            if data_vars.get(key.name) is not key:
                raise KeyError(f"feed {key.name!r}: this Variable is not a data variable of "
                               "this net (from another net, or not declared with "
                               "layers.data)")
            key = key.name
        if key not in data_vars:
            raise KeyError(f"feed {key!r}: not a data variable of this net; data: "
                           f"{', '.join(data_vars) or '(none)'}")
        named[key] = value
    return named


def store_feeds(place, data_vars, needed, feed, mode):
    """Check every value of `feed` ({name: value}) and store it on `place` in its data
    Variable; a KeyError naming what `needed` (the data Variables the ops read) lacks.
    On the CPU a C-contiguous array is stored as a read-only view (no copy: nothing
    can write through it), any other as a read-only contiguous copy; `fed` releases
    them when the run ends, so the net never keeps (nor writes) the caller's array."""
    missing = [v.name for v in needed if v.name not in feed]
    if missing:
        raise KeyError(f"{mode}: missing feed {', '.join(map(repr, missing))}; the ops run "
                       f"need {', '.join(v.name for v in needed)}")
    for name, value in feed.items():
        var = data_vars[name]
        checked = check_feed(var, value)
        stored = place.to_device(checked)
        if stored is checked:                           # the caller's memory, on the CPU
            stored = checked.view() if checked.flags.c_contiguous else \
                np.ascontiguousarray(checked)
            stored.flags.writeable = False
        var.value = stored


@contextlib.contextmanager
def fed(place, data_vars, needed, feed, mode):
    """store_feeds for the length of a `with` block: afterwards the data Variables of
    `feed` hold nothing (also when storing or the block failed), so the net keeps no
    caller's array past a run."""
    try:
        store_feeds(place, data_vars, needed, feed, mode)
        yield
    finally:
        for name in feed:
            data_vars[name].value = None


def fetch_target(net, mode, target):
    """The Variable `mode` computes for `target` (a Variable of this net, or a name)."""
    scope = net.scopes[mode]
    if not isinstance(target, Variable):
        var = scope.find_var(target)
        if var is None:
            raise KeyError(f"fetch {target!r}: no variable of that name in this net's "
                           f"{mode} branch")
        return var
    if not net.owns(target):
        raise KeyError(f"fetch {target.name!r}: this Variable belongs to another net; fetch "
                       "a Variable of this net or a name")
    other = "train" if mode == "infer" else "infer"
    if target.scope is net.scopes[other]:
        twin = net.twin(target)
        if twin is None:
            raise KeyError(f"fetch {target.name!r}: computed only in the {other} branch (it "
                           f"has no copy in the {mode} branch)")
        return twin
    return target


def scope_targets(scope, fetch):
    """The Variables of `fetch` (Variables, or names looked up in `scope`)."""
    found = []
    for target in check_fetch_list(fetch, "Executor.run"):
        var = target if isinstance(target, Variable) else scope.find_var(target)
        if var is None:
            raise KeyError(f"fetch {target!r}: no such variable in the scope")
        found.append(var)
    return found


def io_variables(net, feeds, fetches, what, error=ValueError):
    """(feed Variables, fetch Variables) of the inference graph an exporter writes.

    feeds: a list of data Variables of `net` or their names; fetches: a
    non-empty list of Variables of `net` or names (a train-branch Variable
    stands for its infer copy). Anything else, or a repeated one, is an
    `error` whose message starts with `what`."""
    found = {}
    for kind, given in (("feeds", feeds), ("fetches", fetches)):
        if isinstance(given, (str, Variable)) or not hasattr(given, "__iter__") or \
                (kind == "fetches" and not given):
            raise error(f"{what}: {kind} must be a{' non-empty' if kind == 'fetches' else ''} "
                        f"list of Variables or names, got {given!r}")
        out = found[kind] = []
        for item in given:
            if kind == "feeds":
                name = item.name if isinstance(item, Variable) else item
                var = net.data_vars.get(name) if isinstance(name, str) else None
                if var is None or (isinstance(item, Variable) and item is not var):
                    raise error(f"{what}: feed {name!r} is not a data variable of this net "
                                f"(declared with layers.data); data: "
                                f"{', '.join(net.data_vars) or '(none)'}")
            else:
                try:
                    var = fetch_target(net, "infer", item)
                except KeyError as e:
                    raise error(f"{what}: {e.args[0]}") from None
            if any(var is v for v in out):
                raise error(f"{what}: {kind[:-1]} {var.name!r} is given twice")
            out.append(var)
    return found["feeds"], found["fetches"]


def check_no_infer_state(ops, what, error=ValueError):
    """An `error` naming `what`, the op and the Variable when one of `ops` keeps state of
    the infer branch: an in-place output that is not persistable (a KV cache's, which
    lives in the net that built it: layers.KVCache). A model made from such ops would
    read state that nothing there computes."""
    for op in ops:
        for var in op.in_place_outputs():
            if not var.persistable:
                raise error(f"{what}: op {op.type!r} keeps state of the infer branch in "
                            f"{var.name!r} (a KV cache, for generation in the net that built "
                            "it); export to ONNX (stateless), or build the layers again "
                            "without kv_cache and load the parameters (mg.io.load)")
