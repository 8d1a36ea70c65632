"""What a run executes: a Plan (the ops, in order, pruned to the fetches in
inference) and its compiled form per device kind (Compiled: one Step per op with its
bound slots, the persistables it writes, the temporaries released after it, the
inputs it may be handed over). minigraph.executor runs them; see its doc for what
compiling finds and why.
"""
from __future__ import annotations

from typing import NamedTuple

from minigraph import handover, host_memory
from minigraph.schema import KernelContext

ONE, LIST, UNBOUND = 0, 1, 2          # how a slot is bound: a Variable, a list, nothing
MODES = ("run", "infer", "train")
CHECKED_SIGNATURES = 8      # signatures a compiled plan keeps the checks' picks of
                            # (a generated token's and its prompt's; a last short batch)


class Step(NamedTuple):
    """One op of a compiled plan.

    inputs / outputs: (slot, Variable or list of them or None, ONE/LIST/UNBOUND);
    writes: the persistables it writes (noted by the journal before it runs);
    untouched: the ids of those whose old arrays it leaves as they are (no copy);
    spares: (in-place output slot, persistable, its index in the slot's list or None)
      for the persistables it writes into spare arrays (OpSchema.spares, CPU training
      steps);
    drops: Variables whose values a training step drops after it;
    thins: Variables whose values it replaces by stand-ins after it (read later
      only for their shapes);
    donors: (slot, Variable) pairs it may be handed over (CPU training steps)."""

    op: object
    inputs: tuple
    outputs: tuple
    writes: tuple
    untouched: frozenset
    spares: tuple
    drops: tuple
    thins: tuple
    donors: tuple


class Compiled:
    """A plan compiled for one device kind: its steps, the Variables it reads from
    outside (`external`), the kept gradients it recomputes (`stale`), the kernel
    picked for each step (on check runs), the kernels' contexts and the signatures
    that have run with checks."""

    def __init__(self, steps, external, stale, place):
        self.steps, self.external, self.stale = steps, external, stale
        self.collective_ops = tuple(s.op for s in steps if s.op.schema.collectives is not None)
        self.kernels = [None] * len(steps)
        self.plain = KernelContext(place)
        self.roomy = None               # per step, the context with its work room
        self.replay = None              # GPU: the plan's CUDA graph (minigraph.replay)
        self.bound = None               # CPU inference: its bound forms (minigraph.bound_run)
        self.op_threads = {}            # CPU training: threads per op (minigraph.op_threads)
        self.checked = {}               # signature -> (kernels, roomy), oldest first
        self.in_use = None              # the signature whose picks `kernels` holds

    def recall(self, signature):
        """Whether a run with this external signature has passed its checks (one of the
        last CHECKED_SIGNATURES); if so, and it is not the signature in use, the
        kernels its checked run picked and the work rooms it measured are put back
        (the bound forms dropped where the kernels differ)."""
        if signature == self.in_use:
            return True
        found = self.checked.get(signature)
        if found is None:           # a checked run follows: it may pick other kernels
            self.in_use = None
            return False
        kernels, self.roomy = found
        if kernels != tuple(self.kernels):
            self.kernels[:] = kernels
            self.bound = None
        self.in_use = signature
        return True

    def remember(self, signature):
        """After a run with `signature` passed its checks: its kernels and work rooms,
        the oldest signature forgotten past CHECKED_SIGNATURES."""
        self.checked.pop(signature, None)
        if len(self.checked) >= CHECKED_SIGNATURES:
            del self.checked[next(iter(self.checked))]
        self.checked[signature] = (tuple(self.kernels), self.roomy)
        self.in_use = signature


class Plan:
    """The ops a run executes, and what it knows of them.

    ops: in order (mode "infer" with targets keeps only what they need);
    needed: the data Variables they read; targets: the Variables fetched;
    keep: Variables a training step keeps besides fetches, persistables and
    data (the persistables' gradients)."""

    def __init__(self, ops, mode="run", targets=(), keep=()):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "infer" and targets:
            ops = prune(ops, targets)
        self.ops, self.mode = tuple(ops), mode
        self.targets, self.keep = tuple(targets), tuple(keep)
        self.needed = tuple(_data_read(self.ops))
        self.lean = mode == "train"     # releases temporaries, journals persistables
        self.saved = {}                 # id(persistable) -> the journal's reusable copy
        self._compiled = {}

    def compiled(self, place):
        """This plan compiled for `place.kind` (made on first use)."""
        found = self._compiled.get(place.kind)
        if found is None:
            if place.kind == "cpu":
                host_memory.keep_freed_memory()
            found = self._compiled[place.kind] = compile_plan(self, place)
        return found


def prune(ops, targets):
    """The ops that contribute to `targets`, in their original order."""
    needed = {id(t) for t in targets}
    kept = []
    for op in reversed(ops):
        if any(id(v) in needed for v in op.output_vars()):
            kept.append(op)
            needed.update(id(v) for v in op.input_vars())
    return kept[::-1]


def compile_plan(plan, place):
    """`plan` compiled for `place` (Compiled; see the module doc)."""
    made, external, outside = set(), [], set()        # outside: the ids of external
    last_use, value_use = {}, {}
    for i, op in enumerate(plan.ops):
        for v in op.input_vars():
            if id(v) not in made and id(v) not in outside:
                external.append(v)
                outside.add(id(v))
        for v in op.input_vars() + op.output_vars():
            last_use[id(v)] = (i, v)
        for v in _value_vars(op):
            value_use[id(v)] = i
        made.update(id(v) for v in op.output_vars())
    keep = {id(t) for t in plan.targets} | {id(v) for v in plan.keep}
    drops = [[] for _ in plan.ops]
    thins = [[] for _ in plan.ops]
    stale = ()
    if plan.lean:
        for i, v in last_use.values():
            if not (v.persistable or v.is_data or id(v) in keep or id(v) in outside):
                drops[i].append(v)
                if value_use.get(id(v), i) < i:      # later ops read only its shape
                    thins[value_use[id(v)]].append(v)
        stale = tuple(v for v in plan.keep if id(v) in made and id(v) not in outside)
    steps = []
    for op, dropped, thinned in zip(plan.ops, drops, thins):
        ins = tuple((slot, v, UNBOUND if v is None else LIST if isinstance(v, list) else ONE)
                    for slot, v in op.inputs.items())
        outs = tuple((slot, v, LIST if isinstance(v, list) else ONE)
                     for slot, v in op.outputs.items() if v is not None)
        writes = tuple(v for v in op.output_vars() if v.persistable)
        in_place = [(slot, v, i) for slot in op.schema.inplace
                    for v, i in _positions(op.outputs.get(slot))]
        spares = tuple((slot, v, i) for slot, v, i in in_place if v.persistable) \
            if op.schema.spares and place.kind == "cpu" else ()
        changed = {id(v) for _, v, _ in in_place} - {id(v) for _, v, _ in spares}
        untouched = frozenset(id(v) for v in writes if id(v) not in changed)
        donors = handover.donors(op, dropped + thinned) if plan.lean and place.kind == "cpu" \
            else ()
        steps.append(Step(op, ins, outs, writes, untouched, spares, tuple(dropped),
                          tuple(thinned), donors))
    return Compiled(tuple(steps), tuple(external), stale, place)


def _positions(bound):
    """(Variable, index) of each Variable a slot binds: index None for a lone Variable,
    its place for a list; nothing for an unbound slot."""
    if bound is None:
        return ()
    if isinstance(bound, list):
        return tuple((v, i) for i, v in enumerate(bound))
    return ((bound, None),)


def _data_read(ops):
    found = []
    for op in ops:
        for v in op.input_vars():
            if v.is_data and v not in found:
                found.append(v)
    return found


def _value_vars(op):
    """The Variables whose values `op` reads or writes (not its shape-only inputs)."""
    found = list(op.output_vars())
    for slot in op.schema.inputs:
        v = op.inputs.get(slot.name)
        if v is not None and slot.reads_values(op.attrs):
            found.extend(v if isinstance(v, list) else [v])
    return found
