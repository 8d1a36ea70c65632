"""Handing a dying input over to a kernel that may write its output into it
(OpSchema.reuse), in a training step on the CPU (minigraph.run).

At compile time `donors` picks, per op, the inputs whose value dies at that op
and that the op reads through one slot only; at run time `handed_over` keeps
those whose array nothing else refers to. Counting references decides it:
every Variable holding the array refers to it, and every view of an array
refers to the array that owns the memory, so an array no one else can see
has exactly the references of its own Variable. `_UNHELD` measures the count
of an array that nothing holds, through the same call, so the test does not
depend on how the interpreter counts the references of a call.
"""
from __future__ import annotations

import sys

import numpy as np


def donors(op, dying):
    """(input slot, Variable) pairs whose arrays `op` may write its outputs into
    (OpSchema.reuse): the Variable's value dies at this op (it is in `dying`), the op
    reads it through that slot only and does not write it."""
    found = []
    outs = op.output_vars()
    for out_slot, in_slots in op.schema.reuse.items():
        out = op.outputs.get(out_slot)
        if out is None or isinstance(out, list) or out.persistable:
            continue
        for slot in in_slots:
            v = op.inputs.get(slot)
            if v is None or isinstance(v, list) or any(v is f for f in found):
                continue
            if any(v is d for d in dying) and sum(v is u for u in op.input_vars()) == 1 \
                    and all(v is not o for o in outs):
                found.append((slot, v))
    return tuple(found)


def _refs(value):
    return sys.getrefcount(value)


_UNHELD = _refs(np.empty(0))     # the count of an array that nothing else refers to


def handed_over(donors):
    """The slots of `donors` whose arrays the kernel may overwrite: numpy arrays that
    only their Variable refers to (no other Variable holds the same array, as
    add_grad's dout passed through to dx and dy) and whose memory no one else can
    see: they own it, or they view an array that owns it and that nothing but them
    refers to (a reshaped product). Every view of an array refers to the array
    that owns the memory, so any other view alive shows in that count."""
    return tuple(slot for slot, var in donors if _sole(var.value))


def _sole(a):
    # + 2: the Variable's reference and `a`'s (for the base: the view's and `base`'s)
    if type(a) is not np.ndarray or not a.flags.writeable or _refs(a) != _UNHELD + 2:
        return False
    if a.flags.owndata:
        return True
    base = a.base
    return type(base) is np.ndarray and base.flags.owndata and base.nbytes == a.nbytes \
        and _refs(base) == _UNHELD + 2
