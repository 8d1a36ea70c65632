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


def between_ms(before, fn, repeat, warmup=3):
    """The median over `repeat` calls of fn() of its wall time in ms, each call right
    after an untimed call of before() (an evaluation between training steps), after
    `warmup` untimed pairs."""
    def pair():
        before()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for _ in range(warmup):
        pair()
    return statistics.median(pair() for _ in range(repeat)) * 1e3
