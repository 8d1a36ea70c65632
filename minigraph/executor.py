"""The runner: a plan of ops is compiled once per device kind and run step by step.

Every run goes through here: parameter initialisers and `Executor.run` (a
plan of the ops given, mode "run"), `Net.infer` (mode "infer", pruned to what
the fetches need) and `Net.train` (mode "train"). A Net keeps its plans until
its ops change.

Compiling binds each op's slots (`Step`) and, in a training step, finds the
temporaries no later op reads; they are released as soon as their last reader
has run, so a step's peak memory is what backward still needs rather than
every value computed. A value later ops read only for its shape
(`Slot.shape_only`) is replaced by a stand-in of that shape and dtype that
holds no memory. On the CPU, an input whose value dies at the op that reads
it may be handed over to a kernel that declares it may write its output
there (`OpSchema.reuse`, `KernelContext.donated`), when at run time nothing
else refers to its memory (minigraph.handover). The first training run with
a signature measures the memory its values hold op by op
(minigraph.work_room); later ones give the kernels that declare
`OpSchema.work_room` the room the step's peak leaves them.

Checks: while the signature of what the plan reads from outside (feeds,
persistables) is new, each op's inputs go through its schema's inference and
its kernel is picked for their dtypes (`OpSchema.kernel_for`); once a run with
that signature has succeeded, later runs with it skip both, since every value inside
follows from it: the compiled plan keeps the picks of its last CHECKED_SIGNATURES
signatures (minigraph.plan), so that runs alternating between shapes (a prompt's
pass and a generated token's, an epoch's last short batch) are checked once each.
This is the only check cache. Such a run outside training (an
inference plan run again with the same shapes: a generated token's pass) goes
through one tight loop of kernel calls, with no journal, meter or checks; in mode
"infer" on the CPU, through the kernels' bound forms (minigraph.bound_run).

A step whose ops make collectives (OpSchema.collectives) announces them to the
communicator first (Communicator.begin_step): the order check verifies them in one
exchange.

A training step keeps the values it fetches, the persistables and the
gradients of the persistables (as PyTorch keeps `.grad`); the gradients it
computes anew are dropped as it starts (zero_grad(set_to_none=True)).
It is all or nothing (minigraph.journal). Inference keeps every value. (Net
lets go of the feeds, read-only views of the caller's arrays, after a run.)
"""
from __future__ import annotations

import itertools

import numpy as np

from minigraph import bound_run, handover, op_threads, work_room
from minigraph.feeds import check_feed, check_feed_mapping, scope_targets
from minigraph.journal import Journal
from minigraph.place import CPUPlace
from minigraph.plan import LIST, ONE, Plan
from minigraph.schema import KernelContext, OpError


def check_place(place, who):
    """`place`, or CPUPlace() for None; a TypeError naming `who` for anything that is
    not a place object (a string such as 'cpu' included)."""
    if place is None:
        return CPUPlace()
    if getattr(place, "kind", None) not in ("cpu", "gpu") or not hasattr(place, "activate"):
        raise TypeError(f"{who}: place must be a place object (mg.CPUPlace() or "
                        f"mg.GPUPlace(i)), got {type(place).__name__} {place!r:.60}")
    return place


class Executor:
    """Runs plans on a place (CPUPlace by default) with the kernels registered for
    its kind. `run` keeps the plans of the last PLAN_CACHE op lists it ran."""

    PLAN_CACHE = 32

    def __init__(self, place=None):
        self.place = check_place(place, "Executor")
        self._plans = {}                # (op ids, target ids) -> Plan, oldest first

    def run(self, ops, scope=None, feed=None, fetch=None):
        """Feed, run `ops` in order, fetch.

        feed: {name: array}, each checked against the variable of that name in
        `scope` (declared dtype and shape, -1 matching any size) and copied to
        the place. fetch: Variables or names looked up in `scope`; returned as
        numpy arrays in the same order. The plan of the same ops and fetches is
        reused, so ops are checked again only when what they read from outside
        changes shape or dtype."""
        feed = check_feed_mapping(feed, "Executor.run")
        fetch = [] if fetch is None else fetch
        if (feed or any(isinstance(f, str) for f in fetch)) and scope is None:
            raise ValueError("Executor.run: feeding or fetching by name needs a scope")
        targets = scope_targets(scope, fetch)
        with self.place.activate():
            for name, value in feed.items():
                var = scope.find_var(name)
                if var is None:
                    raise KeyError(f"feed {name!r}: no such variable in the scope")
                var.set(self.place.to_device(check_feed(var, value)))
            return self.run_plan(self._plan(ops, targets))

    def _plan(self, ops, targets):
        key = (tuple(map(id, ops)), tuple(map(id, targets)))   # the plan holds them all
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = Plan(ops, "run", targets)
            if len(self._plans) >= self.PLAN_CACHE:
                del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def run_plan(self, plan):
        """Run `plan` once and return the values of its targets as numpy arrays.

        Mode "train" is all or nothing: if an op or a fetch raises (or, on a GPU, a
        kernel flagged an error on the device), every persistable it wrote and the
        kept gradients are put back and the error propagates. Device errors of other
        modes surface when their targets are fetched."""
        place = self.place
        c = plan.compiled(place)
        signature = tuple(None if v.value is None else (v.value.shape, v.value.dtype)
                          for v in c.external)
        check = not c.recall(signature)
        comm = _announce_collectives(c)
        try:
            return self._run_compiled(plan, c, signature, check)
        finally:
            if comm is not None:
                comm.end_step()

    def _run_compiled(self, plan, c, signature, check):
        place = self.place
        with place.activate():          # a GPU's context, once for the whole run
            if place.kind == "gpu" and not check:
                from minigraph import replay

                fetched = replay.run(plan, c, place, signature)
                if fetched is not None:
                    return fetched
            if not plan.lean:
                reuses = _run_steps(c, place.kind, check,
                                    bound=plan.mode == "infer" and place.kind == "cpu")
                if check:
                    c.remember(signature)
                return _fetch(place, plan.targets, check_errors=True, copy=reuses)
            journal = Journal(place, plan.saved)
            journal.set_aside_values(c.stale)
            meter = work_room.Meter() if check and place.kind == "cpu" else None
            try:
                _run_steps(c, place.kind, check, journal, meter)
                place.check_errors()
                fetched = _fetch(place, plan.targets, check_errors=False)
            except BaseException:
                journal.roll_back()
                raise
            journal.commit()
            if meter is not None:
                rooms = meter.rooms([s.op for s in c.steps])
                c.roomy = tuple(c.plain if room is None else KernelContext(place, (), room)
                                for room in rooms)
            if check:
                c.remember(signature)
            return fetched


def _announce_collectives(c):
    """Announce the step's collectives; the communicator, or None when there are none."""
    if not c.collective_ops:            # before the import, which took 4 us a run
        return None
    from minigraph.distributed import world

    if not world.is_initialized():      # its first use checks per call
        return None
    comm = world.get_comm()
    calls = []
    for op in c.collective_ops:
        made = op.schema.collectives(op, comm)
        if made is None:
            calls = None
            break
        calls.extend(made)
    comm.begin_step(calls)
    return comm


def _run_steps(c, kind, check, journal=None, meter=None, bound=False):
    """Run the compiled steps: with a journal (training), save persistables first,
    hand over the inputs kernels may write into, and release temporaries. With
    `bound`, a run without checks goes through the kernels' bound forms
    (minigraph.bound_run). Returns True when the values it leaves may be arrays a later
    run rewrites (a fetch copies them)."""
    contexts = c.roomy if c.roomy is not None and not check else itertools.repeat(c.plain)
    if journal is None and meter is None and not check:
        held = bound_run.hold(c) if bound else None
        if held is None:
            _run_checked_steps(c, contexts)
            return False
        try:
            bound_run.run_steps(c, held)
        finally:
            held.lock.release()
        return held.reuses
    picked = tuple(c.kernels) if check else None
    choice = op_threads.choice_for(c, check) if journal is not None and kind == "cpu" \
        else None
    alone = choice is not None and op_threads.contended()       # every op on one thread
    measuring = choice is not None and choice.counts is None and not alone
    now = None                          # the threads the kernels run on (None: all)
    try:
        for i, (step, ctx) in enumerate(zip(c.steps, contexts)):
            if choice is not None:
                count = 1 if alone else choice.count_for(i) if measuring else \
                    choice.counts[i]
                if count != now:
                    op_threads.use(count)
                    now = count
            if journal is not None:
                if step.writes:
                    first = journal.save(step.writes, step.untouched)
                    if step.spares:
                        spares = _spares(step, journal, first)
                        if spares:
                            ctx = ctx.with_spares(spares)
                if step.donors:
                    donated = handover.handed_over(step.donors)
                    if donated:
                        ctx = ctx.with_donated(donated)
            if check:
                c.kernels[i] = _run_op(step, None, ctx, kind)
            elif measuring:
                start = op_threads.clock()
                _run_op(step, c.kernels[i], ctx, kind)
                choice.ran(i, now, op_threads.clock() - start)
            else:
                _run_op(step, c.kernels[i], ctx, kind)
            if meter is not None:
                meter.ran(step.outputs, step.drops + step.thins)
            if journal is not None:
                for var in step.drops:
                    var.value = None
                for var in step.thins:
                    if var.value is not None:
                        var.value = _stand_in(var.value)
    finally:
        if now is not None:
            op_threads.use(None)
    if measuring:
        choice.step_done()
    if check and tuple(c.kernels) != picked:
        c.bound = None                  # its forms were made for the kernels before
    return False


def _spares(step, journal, first):
    """{in-place output slot: spare array (a list for a list slot, None where it gets
    none)} for the step's persistables the journal noted first now."""
    spares = {}
    for slot, var, i in step.spares:
        if id(var) in first:
            if i is None:
                spares[slot] = journal.spare(var)
            else:
                spares.setdefault(slot, [None] * len(step.op.outputs[slot]))[i] = \
                    journal.spare(var)
    return spares


def _run_checked_steps(c, contexts):
    """_run_steps without a journal, a meter or checks (a run whose signature has run
    before, outside training: inference run again and again): each step's kernel on
    its inputs, its outputs stored, with nothing else in between."""
    for step, fn, ctx in zip(c.steps, c.kernels, contexts):
        op = step.op
        ins = {}
        for slot, var, how in step.inputs:
            if how == ONE:
                value = var.value
                ins[slot] = value if value is not None else _value_of(op, slot, var)
            elif how == LIST:
                ins[slot] = [_value_of(op, slot, v) for v in var]
            else:
                ins[slot] = None
        _store(step, fn(op, ins, ctx))


def _run_op(step, fn, ctx, kind):
    """One op: gather its inputs, check them and pick its kernel when `fn` is None,
    call it, store its outputs; returns the kernel. (A function of its own so that
    nothing of one op - its inputs, its outputs dict - is still referred to when the
    next one asks whether an array is held elsewhere.)"""
    op = step.op
    ins = {}
    for slot, var, how in step.inputs:
        if how == ONE:
            ins[slot] = _value_of(op, slot, var)
        elif how == LIST:
            ins[slot] = [_value_of(op, slot, v) for v in var]
        else:
            ins[slot] = None
    if fn is None:
        op.check_inputs(ins)
        fn = op.schema.kernel_for(kind, ins)
    _store(step, fn(op, ins, ctx))
    return fn


def _store(step, outs):
    """The values a kernel returned (`outs`, by slot) into the step's output variables."""
    for slot, var, how in step.outputs:
        if slot in outs:
            if how == ONE:
                var.value = outs[slot]
            else:
                for v, x in zip(var, outs[slot]):
                    v.value = x


def _value_of(op, slot, var):
    value = var.value
    if value is None:
        raise OpError(f"{op.type}: input {slot!r} (variable {var.name!r}) has no value; "
                      "feed it or initialise it first")
    return value


def _fetch(place, targets, check_errors, copy=False):
    """The values of `targets` as numpy arrays, copied out once each; first, when
    there is anything to fetch and `check_errors`, the errors the place's kernels
    flagged on the device (GPU kernels cannot raise inside a step). A persistable
    comes back as a copy (the caller's: later steps change the net's array in
    place), and so does a feed (a view of the caller's array), and with `copy` every
    value (the run's arrays may be written again by its next run: bound forms); other
    values are the step's own new arrays."""
    for var in targets:
        if var.value is None:
            raise ValueError(f"fetch {var.name!r}: the variable has no value "
                             "(no op that ran produced it)")
    if targets and check_errors:
        place.check_errors()
    out = []
    for var in targets:
        host = place.to_host(var.value)
        out.append(host.copy() if (copy or var.persistable or var.is_data)
                   and host is var.value else host)
    return out


def _stand_in(value):
    """A read-only array of `value`'s shape and dtype that holds no memory (for ops that
    read only the shape)."""
    return np.broadcast_to(np.zeros((), dtype=value.dtype), value.shape)
