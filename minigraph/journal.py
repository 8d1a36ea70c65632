"""The journal that makes a training step all or nothing.

Before the first op that writes a persistable runs, the step saves a copy of
its value; if any op raises, every saved value is put back (into the same
array object), so parameters, estimates, counters and optimizer state are
exactly as before the step. The copies cost one read and write of the state
the step updates; on the CPU they go into arrays kept with the plan, reused
from step to step.
"""
from __future__ import annotations

import numpy as np


class Journal:
    """Copies of the persistables a step is about to write, to put back on failure.
    `buffers` ({id(var): array}) keeps host copies from step to step."""

    def __init__(self, place, buffers=None):
        self.place = place
        self.buffers = {} if buffers is None else buffers
        self.saved = []
        self._seen = set()

    def save(self, variables):
        """Keep a copy of each Variable's value (once per step)."""
        for var in variables:
            value = var.value
            if id(var) not in self._seen and value is not None:
                self._seen.add(id(var))
                self.saved.append((var, value, self._copy(var, value)))

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
            if isinstance(array, np.ndarray):
                np.copyto(array, copy)
                var.value = array
            else:
                var.value = copy
