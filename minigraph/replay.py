"""A compiled GPU plan replayed as a CUDA graph: one launch per step instead of one
Python call per kernel.

The Executor asks `run(plan, compiled, place, signature)` first on a GPU place; it
returns the fetched values when it ran the step as a graph, or None when the step
should run op by op. A plan is captured (kernels/cuda/graphs.py) on its
WARM_RUNS + 1-th run with one signature (after its checked run and a plain one:
kernels compiled, cuDNN's algorithms measured, library handles and scratch made),
and from then on each step
- copies each value the plan reads from outside that is not persistable (the feeds,
  fresh device arrays each step) into the buffer the graph reads (one device copy
  each, on the device's stream),
- launches the graph, and binds every Variable the step sets to the array the graph
  wrote (the same arrays every step: a device array a Variable holds after a step
  is rewritten by the next one; fetches are host copies and stay as they were),
- checks the device's error flags and fetches, as a plain step does. A training
  step that fails there puts every persistable back in place from the copies the
  journal's captured copies made (the gradients the step recomputed keep the
  failed step's values: the one difference from a plain step's rollback).

A new signature (other shapes) captures anew after its own warm-up. Not replayed,
and run op by op instead (a warning names the reason, once per plan):
- a capture that fails (an op reads the device from the host inside the step, a
  copy on the legacy stream, a library that cannot be captured...): nothing
  captured has run, every Variable is bound back as before, and the step runs as
  usual - never a wrong result;
- a plan whose op writes a persistable into a new array instead of in place (the
  graph would go on reading the old one);
- without cuda-bindings, or with MINIGRAPH_CUDA_GRAPHS=off.
Skipped for one step (replay resumes after): a persistable given a new array from
outside (a checkpoint load, a rollback: the plan is captured anew), kernels
wrapped by net.profile's timers.
"""
from __future__ import annotations

import warnings

from minigraph import device

WARM_RUNS = 2


class Replay:
    """What one compiled plan keeps for replay (see the module doc)."""

    def __init__(self):
        self.signature, self.runs, self.graph, self.off = None, 0, None, None
        self.feeds, self.persist, self.after, self.copies, self.kernels = (), (), (), (), ()

    def drop(self):
        """Forget the captured graph (its memory goes back to the pool)."""
        graph, self.graph = self.graph, None
        if graph is not None:
            try:
                graph.close()
            except Exception:  # noqa: BLE001 - a graph of a context already gone
                pass
        self.runs = 0

    def disable(self, compiled, reason):
        self.drop()
        self.off = reason
        warnings.warn(f"minigraph: a compiled plan of {len(compiled.steps)} ops runs op by op, "
                      f"not as a CUDA graph: {reason}", RuntimeWarning, stacklevel=4)


def _variables(compiled):
    """Every Variable the plan reads or sets, each once."""
    seen, found = set(), []
    for step in compiled.steps:
        for group in (step.inputs, step.outputs):
            for _, var, _ in group:
                for v in (var if isinstance(var, list) else [var]):
                    if v is not None and id(v) not in seen:
                        seen.add(id(v))
                        found.append(v)
    return found


def run(plan, compiled, place, signature):
    """Run one step of `plan` as a CUDA graph (capturing it first when it is time);
    returns the fetched values, or None: run it op by op. Call with the place's
    context current and after the plan's checked run."""
    r = compiled.replay
    if r is None:
        r = compiled.replay = Replay()
    if r.off is not None or any(getattr(k, "timed", False) for k in compiled.kernels) or \
            device.current().stream is None:
        return None
    if r.signature != signature:
        r.drop()
        r.signature = signature
    if r.graph is not None:
        if any(v.value is not a for v, a in r.persist) or tuple(compiled.kernels) != r.kernels:
            r.drop()
            return None
        return _replay(r, plan, place)
    r.runs += 1
    if r.runs <= WARM_RUNS:
        return None
    from minigraph.kernels.cuda import graphs

    why = graphs.unavailable()
    if why is not None:
        r.off = why             # silently: replay is not available on this machine
        return None
    return _capture(r, plan, compiled, place, graphs)


def _capture(r, plan, compiled, place, graphs):
    from minigraph.executor import _run_steps
    from minigraph.journal import Journal

    state = device.current()
    variables = _variables(compiled)
    before = [(v, v.value) for v in variables] + [(v, v.value) for v in compiled.stale]
    outside = [(v, v.value) for v in compiled.external]
    journal = Journal(place, plan.saved) if plan.lean else None
    capture = graphs.Capture(state)
    try:
        capture.begin()
        if journal is not None:
            journal.set_aside_values(compiled.stale)
        _run_steps(compiled, place.kind, False, journal, None)
        graph = capture.end()
    except Exception as e:  # noqa: BLE001 - any failure: nothing captured has run
        capture.abort()
        for v, value in before:
            v.value = value
        r.disable(compiled, f"the capture failed ({type(e).__name__}: {e})")
        return None
    moved = [v.name for v, value in outside if v.persistable and v.value is not value]
    if moved:
        graph.close()
        for v, value in before:
            v.value = value
        r.disable(compiled, f"an op writes persistable {moved[0]!r} into a new array, not in "
                            "place")
        return None
    r.graph, r.kernels = graph, tuple(compiled.kernels)
    r.feeds = tuple((v, value) for v, value in outside if not v.persistable)
    r.persist = tuple((v, value) for v, value in outside if v.persistable)
    r.after = tuple((v, v.value) for v in variables)
    r.copies = tuple((var, array, copy) for var, array, copy in
                     (journal.saved if journal is not None else ()) if copy is not None)
    return _replay(r, plan, place, fresh=True)


def _replay(r, plan, place, fresh=False):
    from minigraph.executor import _fetch

    be = device.backend()
    if not fresh:
        for v, buf in r.feeds:
            value = v.value
            if value is not buf and value is not None and getattr(value, "size", 0):
                be.copy_into(buf, value)
                v.value = buf
    r.graph.launch()
    for v, value in r.after:
        v.value = value
    if not plan.lean:
        return _fetch(place, plan.targets, check_errors=True)
    try:
        place.check_errors()
        return _fetch(place, plan.targets, check_errors=False)
    except BaseException:
        for _, array, copy in r.copies:
            be.copy_into(array, copy)
        raise
