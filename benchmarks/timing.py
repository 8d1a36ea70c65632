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


def alone_and_between_ms(before, fn, repeat, warmup=3, block=5, idle=None):
    """(alone, between, after idle): the medians in ms of fn()'s wall time over `repeat`
    calls each, alone (calls in a row), right after an untimed call of before() (an
    evaluation between training steps) and, where `idle` is given (else None), right
    after an untimed call of idle() (benchmarks/idle_loop.py's loop as long as before():
    what the machine alone takes from a call that follows other work), in alternating
    blocks of `block` calls of each kind (so that a machine whose speed drifts over
    seconds slows them alike), after `warmup` untimed calls of each kind (each
    call of before() or idle() followed by one of fn())."""
    def timed():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    kinds = {"alone": None, "between": before}
    if idle is not None:
        kinds["idle"] = idle
    for _ in range(warmup):
        for first in kinds.values():
            if first is not None:
                first()
            fn()
    times = {kind: [] for kind in kinds}
    while any(len(runs) < repeat for runs in times.values()):
        for kind, first in kinds.items():
            for _ in range(min(block, repeat - len(times[kind]))):
                if first is not None:
                    first()
                times[kind].append(timed())
    medians = {kind: statistics.median(runs) * 1e3 for kind, runs in times.items()}
    return medians["alone"], medians["between"], medians.get("idle")


def idle_as_long_as(ms):
    """A call of benchmarks/idle_loop.py's C loop for `ms` milliseconds (a training step's
    time, for alone_and_between_ms's idle), or None where no C compiler builds it."""
    from idle_loop import idle_loop

    idle = idle_loop()
    return None if idle is None else (lambda: idle(ms / 1e3))


def lockstep_commands(step, infer, repeat, warmup, block, between=None, modes=(None, None),
                      extras=None):
    """A worker's commands for benchmarks/lockstep.py's serve: "train" and "infer", the
    median ms of a block of `block` training steps or inferences (after lockstep's
    untimed calls; modes: callables run first, that put a model in training or
    evaluation mode, or None), and "steady": alone_and_between_ms's times of the
    inference alone, right after `between` (a training step that leaves the model as
    inference wants it; default `step`) and after an idle loop as long as the median
    training block so far ({"infer alone", "infer between", "infer after idle"}), with
    extras()'s items. The caller has warmed both up."""
    from lockstep import block_ms

    trained = []
    train_mode, infer_mode = (m or (lambda: None) for m in modes)

    def train():
        train_mode()
        trained.append(block_ms(step, block))
        return trained[-1]

    def inference():
        infer_mode()
        return block_ms(infer, block)

    def steady():
        infer_mode()
        idle = idle_as_long_as(statistics.median(trained)) if trained else None
        times = alone_and_between_ms(between or step, infer, repeat, warmup, idle=idle)
        return {**dict(zip(("infer alone", "infer between", "infer after idle"), times)),
                **(extras() if extras else {})}

    return {"train": train, "infer": inference, "steady": steady}
