"""The bound form (minigraph.bound_run) of a kernel whose work is one prepared call."""
from __future__ import annotations

import operator


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
