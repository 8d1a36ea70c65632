"""FairRLock: reentrant, handed to waiters in the order they asked, and the Net's
steps, saves and inferences from other threads take turns on it."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import minigraph as mg
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
            assert lock.held()
        other = start(lambda: (lock.acquire(), got.append(1), lock.release()))
        wait_for(lambda: len(lock._queue) == 1)
        assert got == []
    other.join(10)
    assert got == [1] and not lock.held()


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


def test_an_interrupted_wait_leaves_the_queue(monkeypatch):
    lock, release = FairRLock(), threading.Event()
    holder = start(lambda: (lock.acquire(), release.wait(10), lock.release()))
    wait_for(lambda: lock._owner is not None)

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(lock._cond, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    monkeypatch.undo()
    assert not lock._queue
    release.set()
    holder.join(10)
    with lock:
        assert lock.held()


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
