"""Running a Net's step: the cached plan, feeds and fetches, and the journal
that makes a training step all or nothing.

A plan is made once per (mode, fetch targets) and kept by the net until its
ops change: the ops to run (infer is pruned to what the fetches need), the
data Variables they read, and for each op the persistables it writes. A
training step saves a copy of each such persistable just before the first
op that writes it; if any op raises, every saved value is put back (into
the same array object), so parameters, estimates, counters and optimizer
state are exactly as before the step. The copies cost one read and write of
the state the step updates (measured in benchmarks/nets_cpu.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from minigraph.executor import check_feed
from minigraph.scope import Variable


class Plan(NamedTuple):
    """ops: to run in order; needed: the data Variables they read; writes[i]:
    the persistables ops[i] writes (saved before it runs in a training step)."""

    ops: tuple
    needed: tuple
    writes: tuple


def make_plan(ops, mode, targets):
    """The Plan of `ops` for `mode`; infer with targets runs only what they need."""
    if mode == "infer" and targets:
        ops = prune(ops, targets)
    needed = []
    for op in ops:
        for v in op.input_vars():
            if v.is_data and v not in needed:
                needed.append(v)
    writes = tuple(tuple(v for v in op.output_vars() if v.persistable) for op in ops)
    return Plan(tuple(ops), tuple(needed), writes)


def prune(ops, targets):
    """The ops that contribute to `targets`, in their original order."""
    needed = {id(t) for t in targets}
    kept = []
    for op in reversed(ops):
        if any(id(v) in needed for v in op.output_vars()):
            kept.append(op)
            needed.update(id(v) for v in op.input_vars())
    return kept[::-1]


def run_step(net, mode, feed, fetch):
    """Feed, run the plan of `mode` for `fetch`, fetch (Net.train / Net.infer)."""
    feed = feed_by_name(net, feed or {})
    if fetch is None:
        fetch = net.default_fetches
    targets = tuple(fetch_target(net, mode, f) for f in fetch)
    plan = net.plan(mode, targets)
    missing = [v.name for v in plan.needed if v.name not in feed]
    if missing:
        raise KeyError(f"{mode}: missing feed {', '.join(map(repr, missing))}; the ops run "
                       f"need {', '.join(v.name for v in plan.needed)}")
    place = net.place
    for name, value in feed.items():
        var = net.data_vars[name]
        stored = place.to_device(check_feed(var, value))
        if stored is value:
            stored = stored.copy()      # the net never keeps (nor writes) the caller's array
        var.value = stored
    ex = net.executor
    if mode != "train":
        for op in plan.ops:
            ex.run_op(op)
        return ex.fetch_all(net.scopes[mode], targets)
    journal = Journal(place)
    try:
        for op, writes in zip(plan.ops, plan.writes):
            if writes:
                journal.save(writes)
            ex.run_op(op)
        place.check_errors()            # what device kernels flagged fails the step too
    except BaseException:
        journal.roll_back()
        raise
    return ex.fetch_all(net.scopes[mode], targets, check_errors=False)


class Journal:
    """Copies of the persistables a step is about to write, to put back on failure."""

    def __init__(self, place):
        self.place = place
        self.saved = []
        self._seen = set()

    def save(self, variables):
        """Keep a copy of each Variable's value (once per step)."""
        for var in variables:
            if id(var) not in self._seen and var.value is not None:
                self._seen.add(id(var))
                self.saved.append((var, var.value, self.place.copy(var.value)))

    def roll_back(self):
        """Give every saved Variable its saved value back, in the same array object
        where it can (numpy arrays), else by rebinding the copy."""
        for var, array, copy in reversed(self.saved):
            if isinstance(array, np.ndarray):
                np.copyto(array, copy)
                var.value = array
            else:
                var.value = copy


def feed_by_name(net, feed):
    """{data name: value}; keys may be names or the data Variables themselves."""
    named = {}
    for key, value in feed.items():
        if isinstance(key, Variable):
            if net.data_vars.get(key.name) is not key:
                raise KeyError(f"feed {key.name!r}: this Variable is not a data variable of "
                               "this net (from another net, or not declared with "
                               "layers.data)")
            key = key.name
        if key not in net.data_vars:
            raise KeyError(f"feed {key!r}: not a data variable of this net; data: "
                           f"{', '.join(net.data_vars) or '(none)'}")
        named[key] = value
    return named


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
