"""Running a Net's step: the cached plan, feeds and fetches, and the journal
that makes a training step all or nothing.

A plan is made once per (mode, fetch targets) and kept by the net until its
ops change: the ops to run (infer is pruned to what the fetches need), the
data Variables they read, and for each op the persistables it writes. The
first run on a place compiles it further (`Plan.compiled`): per op its
kernel, its bound input and output slots, and - in a training step - the
temporaries no later op reads, released as soon as the op has run, so a
step's peak memory is what backward still needs rather than every value
computed; a value that later ops read only for its shape (add_grad's x and
y, `Slot.shape_only`) is replaced by a stand-in of that shape and dtype that
holds no memory. An input whose value dies at the op that reads it may be
handed over to a CPU kernel that declares it may write its output there
(`OpSchema.reuse`: relu, add, relu's and batch norm's gradients), when at
run time nothing else refers to the array or its memory (no other Variable,
no view: `minigraph.handover`), so the output takes no new memory. The
first training step with a signature (see below) measures the memory its
values hold after each op (`minigraph.work_room`); later ones give kernels
that declare `OpSchema.work_room` (conv2d and its gradient) the room the
step's peak leaves at their op, for their work arrays. A
training step keeps the values it fetches, the persistables, the feeds and
the gradients of the persistables (as PyTorch keeps `.grad`); to read any
other value of a training step, fetch it. The gradients a step computes anew
are dropped as it starts (as PyTorch's zero_grad(set_to_none=True)), so the
last step's hold no memory during this one. Inference keeps every value. Ops
check their inputs' shapes and dtypes (schema inference) while the signature
of what the plan reads from outside (feeds, persistables) is new; once a run
with a signature has succeeded, later runs with it skip those checks, since
every value inside follows from it.

A training step saves a copy of each persistable an op writes just before
the first op that writes it; if any op raises, every saved value is put back
(into the same array object), so parameters, estimates, counters and
optimizer state are exactly as before the step. The copies cost one read and
write of the state the step updates; on the CPU they go into arrays kept with
the plan, reused from step to step.
"""
from __future__ import annotations

import itertools

import numpy as np

from minigraph import handover, host_memory, work_room
from minigraph.executor import check_feed
from minigraph.schema import OpError
from minigraph.scope import Variable

ONE, LIST, UNBOUND = 0, 1, 2


class Plan:
    """ops: to run in order; needed: the data Variables they read; writes[i]:
    the persistables ops[i] writes (saved before it runs in a training step)."""

    def __init__(self, ops, needed, writes, mode, targets):
        self.ops, self.needed, self.writes = ops, needed, writes
        self.mode, self.targets = mode, targets
        self._compiled = {}
        self.checked = None             # the external signature last run with checks
        self.rooms = None               # per step, the kernel's work room (minigraph.work_room)
        self.saved = {}                 # id(persistable) -> the journal's reusable copy

    def compiled(self, kind, keep=()):
        """(steps, external, stale) for place kind `kind`: steps[i] = (kernel or None,
        op, inputs, outputs, writes, releases, n): after ops[i] a training step drops the
        values of releases[:n] and replaces those of releases[n:] (read later only for
        their shapes: Slot.shape_only) by stand-ins; external: the Variables the plan reads
        that no op of it writes. `keep`: Variables a training step keeps after it ends
        (besides fetches, persistables and data: the persistables' gradients); stale:
        those of them the step computes anew without reading them first, whose values
        from the last step a training step drops before its first op (as PyTorch's
        zero_grad(set_to_none=True)), so they take no memory while the step runs."""
        found = self._compiled.get(kind)
        if found is None:
            if kind == "cpu":
                host_memory.keep_freed_memory()
            found = self._compiled[kind] = _compile(self, kind, keep)
        return found


def _compile(plan, kind, kept):
    made, external = set(), []
    last_use, value_use = {}, {}
    for i, op in enumerate(plan.ops):
        for v in op.input_vars():
            if id(v) not in made and all(v is not e for e in external):
                external.append(v)
        for v in op.input_vars() + op.output_vars():
            last_use[id(v)] = (i, v)
        for v in _value_vars(op):
            value_use[id(v)] = i
        made.update(id(v) for v in op.output_vars())
    keep = {id(t) for t in plan.targets} | {id(v) for v in kept}
    releases = [[] for _ in plan.ops]
    thins = [[] for _ in plan.ops]
    if plan.mode == "train":
        for i, v in last_use.values():
            if not (v.persistable or v.is_data or id(v) in keep or v in external):
                releases[i].append(v)
                if value_use.get(id(v), i) < i:      # later ops read only its shape
                    thins[value_use[id(v)]].append(v)
    stale = ()
    if plan.mode == "train":
        stale = tuple(v for v in kept if id(v) in made and all(v is not e for e in external))
    steps = []
    for op, writes, free, thin in zip(plan.ops, plan.writes, releases, thins):
        ins = tuple((slot, v, UNBOUND if v is None else LIST if isinstance(v, list) else ONE)
                    for slot, v in op.inputs.items())
        outs = tuple((slot, v, LIST if isinstance(v, list) else ONE)
                     for slot, v in op.outputs.items() if v is not None)
        donors = handover.donors(op, free + thin) if kind == "cpu" else ()
        steps.append((op.schema.kernels.get(kind), op, ins, outs, writes,
                      tuple(free) + tuple(thin), len(free), donors))
    return tuple(steps), tuple(external), stale


def _value_vars(op):
    """The Variables whose values `op` reads or writes (not its shape-only inputs)."""
    found = list(op.output_vars())
    for slot in op.schema.inputs:
        v = op.inputs.get(slot.name)
        if v is not None and not slot.shape_only:
            found.extend(v if isinstance(v, list) else [v])
    return found


def _stand_in(value):
    """A read-only array of `value`'s shape and dtype that holds no memory (for ops that
    read only the shape)."""
    return np.broadcast_to(np.zeros((), dtype=value.dtype), value.shape)


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
    return Plan(tuple(ops), tuple(needed), writes, mode, tuple(targets))


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
    steps, external, stale = plan.compiled(place.kind, _parameter_grads(net))
    signature = tuple(None if v.value is None else (v.value.shape, v.value.dtype)
                      for v in external)
    check = signature != plan.checked
    with place.activate():              # a GPU's context, once for the whole step
        if mode != "train":
            run_ops(steps, place, check, None)
            plan.checked = signature
            return net.executor.fetch_all(net.scopes[mode], targets)
        journal = Journal(place, plan.saved)
        for var in stale:
            var.value = None
        meter = work_room.Meter() if check and place.kind == "cpu" else None
        try:
            run_ops(steps, place, check, journal, None if check else plan.rooms, meter)
            place.check_errors()        # what device kernels flagged fails the step too
        except BaseException:
            journal.roll_back()
            raise
        plan.checked = signature
        plan.rooms = meter.rooms(steps) if meter is not None else plan.rooms
        return net.executor.fetch_all(net.scopes[mode], targets, check_errors=False)


def _parameter_grads(net):
    """The gradients of the net's persistables (kept after a step, like PyTorch's .grad)."""
    found = []
    for name, grad in net.grads.items():
        var = net.scope.find_var(name)
        if var is not None and var.persistable:
            found.append(grad)
    return found


def run_ops(steps, place, check, journal, rooms=None, meter=None):
    """Run compiled steps: gather inputs, check them when `check`, call the kernel,
    store outputs; with a journal, save persistables first, hand over the inputs
    kernels may write into (OpSchema.reuse) and release temporaries. `rooms`: per
    step, keyword arguments for the kernel (its work room, minigraph.work_room);
    `meter`: a work_room.Meter that measures the step's memory op by op."""
    kind = place.kind
    for (fn, op, inputs, outputs, writes, releases, n_free, donors), extra in zip(
            steps, rooms or itertools.repeat({})):
        if fn is None:
            raise OpError(f"{op.type}: no kernel for {place!r}")
        if writes and journal is not None:
            journal.save(writes)
        if donors and journal is not None:
            donated = handover.handed_over(donors)
            if donated:
                extra = {**extra, "donated": donated}
        _run_op(fn, op, inputs, outputs, check, kind, extra)
        if meter is not None:
            meter.ran(outputs, releases)
        if journal is not None:
            for k, var in enumerate(releases):
                if k < n_free:
                    var.value = None
                elif var.value is not None:
                    var.value = _stand_in(var.value)


def _run_op(fn, op, inputs, outputs, check, kind, extra):
    """One op: gather, check, call, store. (A function of its own so that nothing of
    one op - its inputs, its outputs dict - is still referred to when the next one
    asks whether an array is held elsewhere.)"""
    ins = {}
    for slot, var, how in inputs:
        if how == ONE:
            value = var.value
            if value is None:
                _no_value(op, slot, var)
            ins[slot] = value
        elif how == LIST:
            ins[slot] = [_value_of(op, slot, v) for v in var]
        else:
            ins[slot] = None
    if check:
        op.check_inputs(ins, kind)
    outs = fn(op, ins, **extra) if extra else fn(op, ins)
    for slot, var, how in outputs:
        if slot in outs:
            if how == ONE:
                var.value = outs[slot]
            else:
                for v, x in zip(var, outs[slot]):
                    v.value = x


def _value_of(op, slot, var):
    if var.value is None:
        _no_value(op, slot, var)
    return var.value


def _no_value(op, slot, var):
    raise OpError(f"{op.type}: input {slot!r} (variable {var.name!r}) has no value; "
                  "feed it or initialise it first")


class Journal:
    """Copies of the persistables a step is about to write, to put back on failure.
    `buffers` ({id(var): array}) keeps host copies from step to step."""

    def __init__(self, place, buffers=None):
        self.place = place
        self.buffers = {} if buffers is None else buffers
        self.saved = []
        self._seen = set()

    def save(self, variables):
        """Keep a copy of each Variable's value (once per step)."""
        for var in variables:
            value = var.value
            if id(var) not in self._seen and value is not None:
                self._seen.add(id(var))
                self.saved.append((var, value, self._copy(var, value)))

    def _copy(self, var, value):
        if not isinstance(value, np.ndarray):
            return self.place.copy(value)
        buf = self.buffers.get(id(var))
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = self.buffers[id(var)] = np.empty_like(value)
        np.copyto(buf, value)
        return buf

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

