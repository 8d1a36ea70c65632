"""Timing for the benchmark scripts: the median wall time of a call, after warm-up."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, repeat, warmup=3, cycle=1):
    """The median over `repeat` calls of fn() of its wall time in ms, after `warmup`
    untimed calls. With `cycle` > 1, calls come in cycles of that many (a training step
    with GradientMerge(k) updates the parameters on every k-th call only): the warm-up
    is rounded up to whole cycles, each of the `repeat` samples times a whole cycle, and
    the result is the median cycle's time per call (a median over single calls would
    fall between the cheap calls and the updating ones)."""
    for _ in range(-(-warmup // cycle) * cycle):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(cycle):
            fn()
        times.append((time.perf_counter() - t) / cycle)
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
