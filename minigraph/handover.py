"""Handing a dying input over to a kernel that may write its output into it
(OpSchema.reuse), in a training step on the CPU (minigraph.executor).

At compile time `donors` picks, per op, the inputs whose value dies at that op
and that the op reads through one slot only; at run time `handed_over` keeps
those whose array nothing else refers to. Counting references decides it:
every Variable holding the array refers to it, and every view of an array
refers to the array that owns the memory, so an array no one else can see
has exactly the references of its own Variable. The counts to expect
(`_ALONE`, `_ALONE_VIEW`) are measured when the module loads, through the same
code on an array held as a Variable holds it, so the test does not depend on
how an interpreter counts the references a call makes.
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


def handed_over(donors):
    """The slots of `donors` whose arrays the kernel may overwrite: writeable numpy
    arrays that own their memory, or view all of an array that does (a reshaped
    product), and that nothing but their Variable refers to, nor to that owner but
    them: no other Variable holds the same array (as add_grad's dout passed through
    to dx and dy) and no other view of the memory is alive, since a view refers to
    the array that owns the memory."""
    found = ()
    for slot, var in donors:
        if _plain(var.value) and _counts(var) in _SOLE:
            found += (slot,)
    return found


def _plain(a):
    if type(a) is not np.ndarray or not a.flags.writeable:
        return False
    base = a.base
    return base is None or (type(base) is np.ndarray and base.flags.owndata
                            and base.nbytes == a.nbytes)


class _Held:
    """Holds an array as a Variable does (a slot), to measure the counts below."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _counts(var):
    """(references to var.value, to the array it views or None), as counted here."""
    a = var.value
    base = a.base
    return sys.getrefcount(a), None if base is None else sys.getrefcount(base)


_ALONE = _counts(_Held(np.empty(2)))                      # nothing else refers to them
_ALONE_VIEW = _counts(_Held(np.empty(2).reshape(2, 1)))
_SOLE = (_ALONE, _ALONE_VIEW)
