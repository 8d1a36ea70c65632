"""A reentrant lock that goes to the threads waiting for it in the order they asked.

A Net serialises its steps, saves and loads on one lock. Python's own locks are
not fair: a thread that releases one and asks again at once (a training loop)
nearly always gets it back before a waiting thread wakes, so a save or an
inference asked for from another thread could wait for hundreds of steps.
FairRLock hands itself to the longest waiter on release; a thread that holds
it may take it again (a nested infer inside a step)."""
from __future__ import annotations

import threading
from collections import deque


class FairRLock:
    """Reentrant, first come first served. Use as a context manager."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._owner = None
        self._depth = 0
        self._queue = deque()            # idents of the waiting threads, oldest first

    def acquire(self):
        """Take the lock, waiting behind every thread that asked before; return True.
        If the wait is interrupted (KeyboardInterrupt), the thread leaves the queue."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return True
            self._queue.append(me)
            try:
                while self._owner is not None or self._queue[0] != me:
                    self._cond.wait()
            except BaseException:
                self._queue.remove(me)
                self._cond.notify_all()
                raise
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self):
        """Give the lock up once; the last release hands it to the oldest waiter.
        RuntimeError if the calling thread does not hold it."""
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairRLock: release of a lock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                if self._queue:
                    self._cond.notify_all()

    def held(self):
        """Whether the calling thread holds the lock."""
        return self._owner == threading.get_ident()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()
