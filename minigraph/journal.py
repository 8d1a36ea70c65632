"""The journal that makes a training step all or nothing.

Before the first op that writes a persistable runs, the step notes its value;
if any op raises, every noted value is put back, so parameters, estimates,
counters and optimizer state are exactly as before the step.

Noting costs nothing where the op leaves the old array as it is: an op that
writes the persistable without an in-place pair (kernels never write their
inputs), and, on the CPU, an op whose schema declares `spares`, which writes the
new values into a spare array the journal hands it (`spare`) - the old array
then stays the value to put back. Only an op that changes the array in place
gets a copy of it first. At commit the old arrays become the next step's spares
(unless something else still refers to one), so an optimizer step writes each
parameter and state once and copies nothing. Spares and copies live in
`buffers`, kept with the plan from step to step.
"""
from __future__ import annotations

import sys

import numpy as np


class Journal:
    """The values of the persistables a step writes, to put back on failure (see the
    module doc). `buffers` ({id(var): array}) keeps copies and spares between steps."""

    def __init__(self, place, buffers=None):
        self.place = place
        self.buffers = {} if buffers is None else buffers
        self.saved = []
        self._seen = set()

    def save(self, variables, untouched=()):
        """Note each Variable's value (once per step): a copy, or for those whose id is
        in `untouched` (their op leaves the array as it is) the array itself. Returns
        the ids of the Variables noted now, their first write this step."""
        first = set()
        for var in variables:
            value = var.value
            if id(var) not in self._seen and value is not None:
                self._seen.add(id(var))
                first.add(id(var))
                copy = None if id(var) in untouched else self._copy(var, value)
                self.saved.append((var, value, copy))
        return first

    def spare(self, var):
        """An array of var's shape and dtype, no one else's, for an op to write var's
        new values into (kept in `buffers`; its contents are undefined)."""
        value = var.value
        buf = self.buffers.pop(id(var), None)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = np.empty_like(value)
        return buf

    def commit(self):
        """The step succeeded: an old array that was put aside uncopied and is no
        longer the value becomes the Variable's next spare, when nothing else refers
        to it (a caller's reference keeps its values)."""
        for entry in self.saved:           # entry[1] never bound to a name: see _refs
            var, copy = entry[0], entry[2]
            if copy is None and var.value is not entry[1] and type(entry[1]) is np.ndarray \
                    and _refs(entry) <= _UNSHARED:
                self.buffers[id(var)] = entry[1]
        self.saved = []

    def _copy(self, var, value):
        if not isinstance(value, np.ndarray):
            return self.place.copy(value)
        buf = self.buffers.get(id(var))
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = self.buffers[id(var)] = np.empty_like(value)
        np.copyto(buf, value)
        return buf

    def roll_back(self):
        """Give every saved Variable its saved value back, in the same array object
        where it can (numpy arrays), else by rebinding the copy."""
        for var, array, copy in reversed(self.saved):
            if copy is None:
                var.value = array
            elif isinstance(array, np.ndarray):
                np.copyto(array, copy)
                var.value = array
            else:
                var.value = copy


def _refs(entry):
    """The references to the array of a saved entry, counted here."""
    return sys.getrefcount(entry[1])


_UNSHARED = _refs((None, np.empty(1), None))      # held by its entry alone
