"""An inference plan run again on the CPU, each op through its kernel's bound form.

A CPU kernel may register a bound form (`schema.kernel(..., bind=)`): `bind(op)` gives a
function `run(ins) -> outs` (or None: nothing to bind for this op), made once per op of
a compiled plan and called on its later runs instead of the kernel. It may keep what
follows from its inputs' shapes and arrays between calls (their addresses, a C call's
arguments) and its output arrays, which it writes anew every run. `run` returns None
where it does not apply to the inputs it is given (a dtype, a layout): the kernel runs
instead. It gives the kernel's bits.

The Executor runs a plan this way in mode "infer" once a run with the same signature has
passed its checks: a generated token's pass, an evaluation loop's batches of one shape.
A kernel's Python launcher costs a few microseconds an op, as much as the arithmetic of
a token's small products; bound forms skip most of it (the allocation of each output,
the shape arithmetic, the argument conversions). A form returns an in-place output as
its kernel does (its input's array, a persistable's too), and a list of arrays for a
list of outputs; ops that write a persistable into a new array are never bound. Since
the output arrays are reused:
- a run fetches copies of its values (a fetched value may also be a view of one);
- a Variable's value after a run is rewritten by the plan's next run (as with CUDA
  graphs on the GPU, minigraph.replay);
- a run of the plan that starts while another is in progress (a kernel calling
  net.infer, another thread) runs op by op, with new arrays.
"""
from __future__ import annotations

import threading

from minigraph.plan import LIST, ONE, UNBOUND


class Bound:
    """A compiled plan's bound forms (None where an op has none); `reuses`: whether
    any op has one (then the values a run leaves may be, or view, reused arrays);
    `slots`: per step, its inputs and outputs as run_steps reads and stores them."""

    def __init__(self, compiled):
        self.lock = threading.Lock()
        self.forms = tuple(_form(step, fn) for step, fn in zip(compiled.steps,
                                                                compiled.kernels))
        self.reuses = any(form is not None for form in self.forms)
        self.slots = tuple(_slots(step) for step in compiled.steps)


def _slots(step):
    """(the (slot, Variable) inputs, the (slot, [Variables]) inputs, the unbound input
    slots, the (slot, Variable) outputs, the (slot, [Variables]) outputs) of a step."""
    def of(slots, kind):
        return tuple((slot, var) for slot, var, how in slots if how == kind)

    return (of(step.inputs, ONE), of(step.inputs, LIST),
            tuple(slot for slot, _, how in step.inputs if how == UNBOUND),
            of(step.outputs, ONE), of(step.outputs, LIST))


def _form(step, fn):
    op = step.op
    in_place = {id(v) for v in op.in_place_outputs()}
    if any(id(v) not in in_place for v in step.writes):
        return None
    bind = next((k.bind for k in op.schema.kernels.get("cpu", ()) if k.fn is fn), None)
    return None if bind is None else bind(op)


def hold(compiled):
    """The compiled plan's Bound (made on first use after a checked run picked its
    kernels; the executor drops it when a checked run of other shapes picks other
    kernels, and the forms follow new shapes themselves), its lock taken for one run
    (release it after), or None while another run of the plan holds it."""
    bound = compiled.bound
    if bound is None:
        bound = compiled.bound = Bound(compiled)
    return bound if bound.lock.acquire(blocking=False) else None


def run_steps(compiled, bound):
    """Run the compiled steps (an inference plan's, whose signature a checked run has
    passed) through their bound forms, the kernels where a form has none or declines;
    `bound` is held (hold)."""
    ctx = compiled.plain
    for step, fn, form, slots in zip(compiled.steps, compiled.kernels, bound.forms,
                                     bound.slots):
        ones, lists, unbound, outputs, output_lists = slots
        ins = {slot: var.value for slot, var in ones}
        for slot, group in lists:
            ins[slot] = [var.value for var in group]
        for slot in unbound:
            ins[slot] = None
        outs = None if form is None else form(ins)
        if outs is None:
            outs = fn(step.op, ins, ctx)
        for slot, var in outputs:
            if slot in outs:
                var.value = outs[slot]
        for slot, group in output_lists:
            if slot in outs:
                for var, value in zip(group, outs[slot]):
                    var.value = value
