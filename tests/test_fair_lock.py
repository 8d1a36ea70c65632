"""FairRLock: reentrant, handed to waiters in the order they asked, and the Net's
steps, saves and inferences from other threads take turns on it."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import minigraph as mg
from minigraph import fair_lock
from minigraph import layers as L
from minigraph.fair_lock import FairRLock


def wait_for(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def start(target):
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_the_holder_may_take_it_again_and_others_wait_for_the_last_release():
    lock, got = FairRLock(), []
    with lock:
        with lock:
            assert lock._owner == threading.get_ident() and lock._depth == 2
        other = start(lambda: (lock.acquire(), got.append(1), lock.release()))
        wait_for(lambda: len(lock._queue) == 1)
        assert got == []
    other.join(10)
    assert got == [1] and lock._owner is None


def test_releasing_a_lock_this_thread_does_not_hold_is_an_error():
    lock = FairRLock()
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()
    start(lock.acquire).join(10)
    with pytest.raises(RuntimeError, match="does not hold"):
        lock.release()


def test_waiters_get_it_in_the_order_they_asked_and_a_releaser_asking_again_queues():
    lock, order = FairRLock(), []

    def take(name):
        with lock:
            order.append(name)

    lock.acquire()
    threads = []
    for i, name in enumerate("abc"):
        threads.append(start(lambda name=name: take(name)))
        wait_for(lambda i=i: len(lock._queue) == i + 1)
    lock.release()
    take("releaser")                     # asks at once: behind the three
    for thread in threads:
        thread.join(10)
    assert order == ["a", "b", "c", "releaser"]


class InterruptedWaiter:
    """Stands in for a waiting thread's lock: its wait ends in a KeyboardInterrupt,
    at once (still queued) or once the lock was handed over (after_hand_over)."""

    def __init__(self, after_hand_over):
        self.lock = threading.Lock()
        self.lock.acquire()
        self.after_hand_over = after_hand_over

    def acquire(self):
        if self.after_hand_over:
            self.lock.acquire()
        raise KeyboardInterrupt

    def release(self):
        self.lock.release()


@pytest.mark.parametrize("after_hand_over", [False, True], ids=["queued", "handed-over"])
def test_an_interrupted_wait_leaves_the_queue_and_the_lock_free(monkeypatch, after_hand_over):
    lock, release = FairRLock(), threading.Event()

    def hold():
        with lock:
            if after_hand_over:          # released once the main thread waits
                wait_for(lambda: len(lock._queue) == 1)
            else:
                release.wait(10)

    holder = start(hold)
    wait_for(lambda: lock._owner is not None)
    monkeypatch.setattr(fair_lock, "_waiter", lambda: InterruptedWaiter(after_hand_over))
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    release.set()
    holder.join(10)
    assert not lock._queue and lock._owner is None and not lock._held.locked()
    start(lambda: (lock.acquire(), lock.release())).join(10)
    assert not lock._held.locked()


def test_a_release_between_a_failed_try_and_joining_the_queue_is_not_lost(monkeypatch):
    """The holder releases after the waiter found the lock taken and before it joined
    the queue, so the release saw no one to hand it to: the waiter takes it itself."""
    lock, go, released, got = FairRLock(), threading.Event(), threading.Event(), []

    def hold():
        with lock:
            go.wait(10)
        released.set()

    def late_waiter():
        go.set()
        released.wait(10)
        return real_waiter()

    real_waiter = fair_lock._waiter
    holder = start(hold)
    wait_for(lambda: lock._owner is not None)
    monkeypatch.setattr(fair_lock, "_waiter", late_waiter)
    waiter = start(lambda: (lock.acquire(), got.append(1), lock.release()))
    waiter.join(10)
    holder.join(10)
    assert got == [1] and not lock._held.locked()


class InterruptedLock:
    """A threading.Lock whose next acquire(False) takes it and whose next release
    does not, each then raising KeyboardInterrupt: a Ctrl-C that lands between
    FairRLock taking `_held` and owning it, or between disowning and releasing it."""

    def __init__(self, when):
        self.lock, self.when = threading.Lock(), when

    def acquire(self, blocking=True):
        got = self.lock.acquire(blocking)
        if self.when == "acquire":
            self.when = None
            raise KeyboardInterrupt
        return got

    def release(self):
        if self.when == "release":
            self.when = None
            raise KeyboardInterrupt
        self.lock.release()

    def locked(self):
        return self.lock.locked()


@pytest.mark.parametrize("when", ["acquire", "release"])
def test_a_ctrl_c_inside_acquire_or_release_leaves_the_lock_free(when):
    """Such an interrupt during io.load left `_held` taken with no owner, and the
    next load waited for ever."""
    lock = FairRLock()
    lock._held = InterruptedLock(when)
    if when == "release":
        lock.acquire()
    with pytest.raises(KeyboardInterrupt):
        lock.acquire() if when == "acquire" else lock.release()
    assert lock._owner is None and not lock._held.locked()
    taken = threading.Event()
    other = threading.Thread(target=lambda: (lock.acquire(), taken.set(), lock.release()))
    other.start()
    other.join(5)
    assert taken.is_set() and not lock._held.locked()


def test_a_training_loop_in_another_thread_lets_an_inference_in_after_its_step():
    """With Python's own lock the loop took it back at once: an inference asked for
    from another thread waited for hundreds of steps."""
    net = mg.Net(seed=0)
    h = L.data(net, "x", shape=(-1, 8))
    for i in range(6):
        h = L.tanh(net, L.fc(net, h, 8, name=f"fc{i}"))
    loss = L.mean(net, L.square(net, h))
    mg.optimizer.SGD(0.01).minimize(net, loss)
    feed = {"x": np.ones((4, 8), np.float32)}
    stop, steps = threading.Event(), []

    def train():
        while not stop.is_set():
            net.train(feed=feed)
            steps.append(1)

    trainer = start(train)
    wait_for(lambda: len(steps) >= 3)
    waited = []
    for _ in range(20):
        before = len(steps)
        net.infer(feed=feed, fetch=[h])
        waited.append(len(steps) - before)
    stop.set()
    trainer.join(30)
    assert max(waited) <= 2, waited
