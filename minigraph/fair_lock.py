"""A reentrant lock that goes to the threads waiting for it in the order they asked.

A Net serialises its steps, saves and loads on one lock. Python's own locks are
not fair: a thread that releases one and asks again at once (a training loop)
nearly always gets it back before a waiting thread wakes, so an inference or a
save asked for from another thread waited for hundreds of steps. FairRLock,
released while threads wait, hands itself to the oldest of them; a thread that
holds it may take it again (a nested infer inside a step)."""
from __future__ import annotations

import threading
from collections import deque


def _waiter():
    """A lock the waiting thread blocks on until a release hands it the FairRLock."""
    waiter = threading.Lock()
    waiter.acquire()
    return waiter


class FairRLock:
    """Reentrant, first come first served. Use as a context manager.

    `_held` is locked while a thread owns the lock; uncontended, acquire and
    release touch only it. A thread that finds it locked joins the queue and
    blocks on a lock of its own, which the thread that hands it the FairRLock
    releases after setting `_owner`. A Ctrl-C that lands between taking `_held` and
    owning it, or between disowning it and releasing it, gives it back before the
    KeyboardInterrupt goes on."""

    def __init__(self):
        self._held = threading.Lock()
        self._mutex = threading.Lock()   # guards the queue and hand-overs
        self._owner = None
        self._depth = 0
        self._queue = deque()            # (ident, waiter) of the waiting threads, oldest first

    def acquire(self):
        """Take the lock, behind every thread that asked before; return True. A wait
        interrupted (KeyboardInterrupt) leaves the queue, or passes the lock on if it
        was handed over meanwhile, and raises."""
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        try:
            if self._held.acquire(False):
                self._owner, self._depth = me, 1
                return True
        except BaseException:            # an interrupt between taking _held and owning it
            if self._owner is None and self._held.locked():
                self._held.release()
            raise
        entry = (me, _waiter())
        with self._mutex:
            self._queue.append(entry)
            self._hand_over_if_free()
        self._wait(entry)
        return True

    def _wait(self, entry):
        try:
            entry[1].acquire()           # released by the hand-over, which sets _owner
        except BaseException:
            with self._mutex:
                waiting = entry in self._queue
                if waiting:
                    self._queue.remove(entry)
            if not waiting:
                self.release()
            raise

    def release(self):
        """Give the lock up once; the last release hands it to the oldest waiting
        thread, if any. RuntimeError if the calling thread does not hold it."""
        if self._owner != threading.get_ident():
            raise RuntimeError("FairRLock: release of a lock this thread does not hold")
        if self._depth > 1:
            self._depth -= 1
            return
        try:
            self._owner, self._depth = None, 0
            self._held.release()
        except BaseException:            # an interrupt between disowning and releasing
            if self._owner is None and self._held.locked():
                self._held.release()
            raise
        if self._queue:
            with self._mutex:
                self._hand_over_if_free()

    def _hand_over_if_free(self):
        """With the mutex held: if the lock is free and a thread waits, give it to the
        oldest. Run by every release that sees a queue and by every thread that joins
        it, so the last one to act on a free lock hands it over."""
        if self._queue and self._held.acquire(False):
            ident, waiter = self._queue.popleft()
            self._owner, self._depth = ident, 1
            waiter.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()
