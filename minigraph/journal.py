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
`buffers`, kept with the plan from step to step. The kept gradients a step
computes anew are set aside (`set_aside_values`), not copied: a failed step
gives them back.

Rolling back finishes whatever arrives: signals with Python handlers (Ctrl-C's
KeyboardInterrupt, a SIGTERM handler) are held while it runs and delivered
once it is done (`deferred_signals`).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

import numpy as np

# the signals whose Python handlers could raise in the middle of a rollback
DEFERRED = tuple(getattr(signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
    if hasattr(signal, name))
_RETRIES = 8


@contextlib.contextmanager
def deferred_signals(signals=DEFERRED):
    """Hold `signals` while the block runs, then deliver each one that arrived (once,
    in arrival order) to the handler it had: a Ctrl-C in the block raises its
    KeyboardInterrupt after the block, not inside it. Only signals with a Python
    handler are held (the default action of an unhandled SIGTERM still ends the
    process at once). Outside the main thread, where Python runs no signal
    handler, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending, saved = [], []

    def hold(signum, frame):
        if signum not in pending:
            pending.append(signum)

    try:
        for signum in signals:
            handler = signal.getsignal(signum)
            if callable(handler):
                saved.append((signum, handler))
                signal.signal(signum, hold)
        yield
    finally:
        for signum, handler in saved:
            signal.signal(signum, handler)
        for signum in pending:
            signal.raise_signal(signum)


class Journal:
    """The values of the persistables a step writes, to put back on failure (see the
    module doc). `buffers` ({id(var): array}) keeps copies and spares between steps."""

    def __init__(self, place, buffers=None):
        self.place = place
        self.buffers = {} if buffers is None else buffers
        self.saved = []
        self.set_aside = []
        self._seen = set()

    def set_aside_values(self, variables):
        """Drop the values of `variables` (gradients the step computes anew), keeping
        them to give back if the step fails."""
        for var in variables:
            self.set_aside.append((var, var.value))
            var.value = None

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
        self.set_aside = []

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
        where it can (numpy arrays), else by rebinding the copy; and the set-aside
        values. Signals are held meanwhile (deferred_signals); one that arrives in
        the instant before they are held starts the rollback again (putting back is
        idempotent) and is raised once it is complete."""
        interrupt = None
        for _ in range(_RETRIES):
            started = False
            try:
                with deferred_signals():
                    started = True
                    self._restore()
                break
            except BaseException as e:
                if started:
                    raise                   # from the restore itself, or delivered after it
                interrupt = interrupt or e
        if interrupt is not None:
            raise interrupt

    def _restore(self):
        for var, array, copy in reversed(self.saved):
            if copy is None:
                var.value = array
            elif isinstance(array, np.ndarray):
                np.copyto(array, copy)
                var.value = array
            else:
                var.value = copy
        for var, value in self.set_aside:
            var.value = value


def _refs(entry):
    """The references to the array of a saved entry, counted here."""
    return sys.getrefcount(entry[1])


_UNSHARED = _refs((None, np.empty(1), None))      # held by its entry alone
