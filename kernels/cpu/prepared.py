"""Work prepared once and kept: the bound form (minigraph.bound_run) of a kernel whose
work is one prepared call, and what a kernel makes once from an array no op writes
(fc_native's packed weights, conv_native's Winograd transforms of filters)."""
from __future__ import annotations

import operator
import weakref


def form(slots, prepare):
    """A bound form's run(ins): prepare(*arrays) -> (call, outs), or None where the call
    does not apply, is asked again only when an input of `slots` (in order; every slot
    of the op's schema is in ins, None where unbound) holds another array than at the
    last run; each run then calls call() and returns outs. While prepare says None, run
    returns None (the kernel runs)."""
    kept = {"inputs": None, "ready": None}
    pick = operator.itemgetter(*slots)
    if len(slots) == 1:
        one = pick
        pick = lambda ins: (one(ins),)        # noqa: E731 - itemgetter of one slot

    def run(ins):
        arrays = pick(ins)
        held = kept["inputs"]
        if held is None or not all(map(operator.is_, arrays, held)):
            kept["inputs"], kept["ready"] = arrays, prepare(*arrays)
        ready = kept["ready"]
        if ready is None:
            return None
        ready[0]()
        return ready[1]
    return run


def kept(table, array, tag, make):
    """make()'s value for `array`, made at its first use and kept in `table` (id(array) ->
    (weakref to it, tag, value)) while the array lives; made again where `tag` (what
    else the value depends on) differs or the array was made writeable since. The
    array is made read-only first, so that what was made from it stays what it holds:
    a write into it is an error, not a stale result; a new value is a new array."""
    found = table.get(id(array))
    if (found is not None and found[0]() is array and found[1] == tag
            and not array.flags.writeable):
        return found[2]
    array.flags.writeable = False
    value = make()
    key = id(array)
    table[key] = (weakref.ref(array, lambda _, key=key: table.pop(key, None)), tag, value)
    return value
