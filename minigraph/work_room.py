"""Room for work arrays: how much memory an op of a training step may take for
its work without raising the step's peak (OpSchema.work_room; minigraph.executor).

A training step's values peak where the most of them are alive: late in the
forward pass and as the backward pass starts, when every activation the
gradients need is held. Ops elsewhere run beside much less, and a kernel whose
speed grows with its work arrays (conv2d's: the im2col engine's columns, cut in
chunks of images; Winograd's scratch, where it outgrows the output) can take that
difference. Kernels keep their work lean at the peak
and take the room elsewhere, so the peak stays where it was.

The first run of a plan with a signature (minigraph.executor's check run, which
gives no room) measures with a `Meter` the memory the step's values hold
after each op: each output's memory, counted once however many Variables and
views refer to it (by the array that owns it), from the op that makes it to
the op after which no Variable of the step refers to it. An output written
into a handed-over input (OpSchema.reuse) or a view of one takes nothing new.
Then room(op i) = max over ops of held - held at op i (its inputs and its
outputs). Persistables, feeds and what a previous step left are not counted:
they are the same at every op.
"""
from __future__ import annotations

import numpy as np


class Meter:
    """Records the memory a training step's values hold, op by op, without keeping a
    reference to any array (handover counts references)."""

    def __init__(self):
        self._owners = {}       # id(owning array) -> [bytes, {id(Variable)}]
        self._held_by = {}      # id(Variable) -> id(owning array)
        self._total = 0
        self.held = []          # bytes held after each op, before its releases

    def ran(self, outputs, releases):
        """After an op: its output Variables (compiled (slot, var, how) triples, a
        list of Variables when `how` is a list) now hold their values; then the
        Variables in `releases` let go of theirs."""
        for _, var, _ in outputs:
            for v in var if isinstance(var, list) else (var,):
                if not v.persistable:
                    self._hold(v)
        self.held.append(self._total)
        for v in releases:
            self._drop(id(v))

    def _hold(self, var):
        self._drop(id(var))
        owner = _owner(var.value)
        if owner is None:
            return
        key = id(owner)
        entry = self._owners.get(key)
        if entry is None:
            entry = self._owners[key] = [owner.nbytes, set()]
            self._total += owner.nbytes
        entry[1].add(id(var))
        self._held_by[id(var)] = key

    def _drop(self, var_id):
        key = self._held_by.pop(var_id, None)
        if key is None:
            return
        nbytes, holders = self._owners[key]
        holders.discard(var_id)
        if not holders:
            del self._owners[key]
            self._total -= nbytes

    def rooms(self, ops):
        """Per op of the step, in order, the bytes of work memory its kernel may take
        (the step's peak minus what is held at that op) for ops that declare
        OpSchema.work_room, else None."""
        peak = max(self.held, default=0)
        return tuple(peak - held if op.schema.work_room else None
                     for op, held in zip(ops, self.held))


def _owner(value):
    """The ndarray that owns value's memory (value itself, or the base of a view);
    None for anything else."""
    if not isinstance(value, np.ndarray):
        return None
    while isinstance(value.base, np.ndarray):
        value = value.base
    return value
