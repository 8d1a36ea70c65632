"""Work prepared once and kept: the bound form (minigraph.bound_run) of a kernel whose
work is one prepared call, and what a kernel makes once from an array no op writes
(fc_native's packed weights, conv_native's Winograd transforms of filters)."""
from __future__ import annotations

import math
import operator
import weakref

import numpy as np


def form(slots, prepare, lists=(), streamed=()):
    """A bound form's run(ins): prepare(*arrays) -> (call, outs), or None where the call
    does not apply, is asked again only when an input of `slots` (in order; every slot
    of the op's schema is in ins, None where unbound) holds another array than at the
    last run (the slots of `lists` hold lists of arrays, a duplicable slot's: compared
    array by array); each run then calls call() and returns outs. While prepare says
    None, run returns None (the kernel runs). The slots of `streamed` (in a form without
    lists) hold arrays that call() only reads as it runs, never what prepare made from
    them: there a read-only view of the same memory counts as the same array
    (same_memory: a batch fed again, which the executor stores as a new view every
    run)."""
    kept = {"inputs": None, "ready": None}
    pick = operator.itemgetter(*slots)
    if len(slots) == 1:
        one = pick
        pick = lambda ins: (one(ins),)        # noqa: E731 - itemgetter of one slot
    listed = [slot in lists for slot in slots]
    if (streamed and lists) or not set(streamed) <= set(slots):
        raise ValueError(f"prepared.form: streamed slots {streamed} must be of {slots}, "
                         "in a form without lists")
    by_memory = [slot in streamed for slot in slots] if streamed else None

    def arrays_of(picked):
        """The picked arrays, each list's in its place."""
        flat = []
        for value, is_list in zip(picked, listed):
            if is_list and value is not None:
                flat.extend(value)
            else:
                flat.append(value)
        return flat

    def run(ins):
        arrays = pick(ins)
        seen = arrays_of(arrays) if lists else arrays
        held = kept["inputs"]
        if held is None or len(seen) != len(held) or not all(map(operator.is_, seen, held)):
            if (held is None or by_memory is None or len(seen) != len(held)
                    or not all(a is b or (m and same_memory(a, b))
                               for a, b, m in zip(seen, held, by_memory))):
                kept["ready"] = prepare(*arrays)
            kept["inputs"] = seen
        ready = kept["ready"]
        if ready is None:
            return None
        ready[0]()
        return ready[1]
    return run


def same_memory(a, held):
    """True when a call prepared to read `held` as it runs (held alive by its form, so
    its memory is not reused) reads `a` as it is: the same object, or both read-only
    arrays (as the executor stores a fed batch) with the same data address, shape,
    strides and dtype."""
    return a is held or (type(a) is np.ndarray and type(held) is np.ndarray
                         and not a.flags.writeable and not held.flags.writeable
                         and a.shape == held.shape and a.strides == held.strides
                         and a.dtype == held.dtype
                         and a.__array_interface__["data"][0]
                         == held.__array_interface__["data"][0])


def output(kept, shape, dtype):
    """A bound form's output array: kept["out"] where it has this shape and dtype, else
    a new (uninitialised) one (aligned_empty), kept there for the next runs."""
    out = kept.get("out")
    if out is None or out.shape != tuple(shape) or out.dtype != dtype:
        out = kept["out"] = aligned_empty(shape, dtype)
    return out


def aligned_empty(shape, dtype):
    """An uninitialised C-contiguous array whose first value starts a 64-byte cache line
    (malloc aligns to 16 bytes): the native kernels' vector loads and stores of its rows
    then straddle no more lines than the rows' lengths make them, whatever malloc's
    state (fc_native's 128x784 and 128x2048 by 2048 products took 4-5% longer into
    outputs 32 or 48 bytes past a line, 1% at 16). For arrays kept and reused (bound
    forms' outputs, packed weights): it views a larger array, so it is never donated
    to a kernel to write into (minigraph.handover)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)   # no memory to align
    room = np.empty(size + 64, np.uint8)
    skip = -room.ctypes.data % 64
    return room[skip:skip + size].view(dtype).reshape(shape)


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
