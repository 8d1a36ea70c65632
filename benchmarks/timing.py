"""Timing for the benchmark scripts: the median wall time of a call, after warm-up."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, repeat, warmup=3):
    """The median over `repeat` calls of fn() of its wall time in ms, after `warmup`
    untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def alone_and_between_ms(before, fn, repeat, warmup=3, block=5):
    """(alone, between): the medians in ms of fn()'s wall time over `repeat` calls
    each, alone (calls in a row) and right after an untimed call of before() (an
    evaluation between training steps), in alternating blocks of `block` calls of
    either kind (so that a machine whose speed drifts over seconds slows both
    alike), after `warmup` untimed calls of each kind."""
    def timed():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for _ in range(warmup):
        fn()
        before()
    alone, between = [], []
    while len(alone) < repeat or len(between) < repeat:
        for _ in range(min(block, repeat - len(alone))):
            alone.append(timed())
        for _ in range(min(block, repeat - len(between))):
            before()
            between.append(timed())
    return statistics.median(alone) * 1e3, statistics.median(between) * 1e3
