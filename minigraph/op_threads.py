"""Threads per op of a CPU training step, chosen by measuring its first steps.

An op on a few hundred kilobytes often runs faster on the one thread that made its
inputs, whose core's cache holds them, than split over threads that must first
fetch them and then wait for each other: in the digits net's step on a 2-core
machine, its 64x256 product took 33 us on one thread and 79 us on two, and the
whole step 0.92 ms against 1.21 (benchmarks/nets_cpu.py; docs/performance.md).
Larger ops gain from every thread. Which op is which depends on the machine, so
it is measured:

- A CPU training plan, once its check run has picked its kernels, runs its next
  2 * ROUNDS steps with every op alternately on all the threads (`get_num_threads()`)
  and on one, step by step, timing each kernel call.
- An op stops being tried on one thread once it has taken LONG_OP (1 ms) on all
  of them, or on one SLOWER (2x) its time on all: on a machine of many cores a
  large op's run on one thread could take that many times longer, so each op
  costs at most one such run.
- Then an op runs on one thread where its least time on one is below MARGIN times
  its least on all, on all where the reverse holds or it was no longer tried,
  and else (a close call) on the count of the op before it; later steps set the
  threads op by op:
  `blocks.cap_threads` for the native kernels and numpy's engine (this thread
  only), `blas_threads.set_threads` for OpenBLAS (the process's); after the step,
  every thread again.
- While another process wants the cores (kernels/cpu/native_pool.h counts them
  contended), a step runs every op on one thread and measures nothing: a split op
  would wait for a thread that has no core, and the times would not be the
  machine's.
- A plan keeps a choice per input signature (a last short batch has its own)
  and thread count (`mg.set_num_threads`), the last KEPT of them; a step on one
  thread measures nothing. With one thread, or MINIGRAPH_TUNE=0 (or MINIGRAPH_NATIVE=0),
  nothing is measured and every op runs on all the threads.

Every native kernel computes each value on one thread in one way, so its results
do not depend on the count; OpenBLAS's products of some shapes round differently
on one thread than on two (as they do between any two thread counts).
"""
from __future__ import annotations

import time

# minigraph.kernels.cpu is imported inside the functions: its native build imports
# minigraph.io, which imports minigraph.net, which imports the executor and this.

ROUNDS = 8          # steps on each count before choosing (after the check run)
KEPT = 8            # choices a plan keeps (by input signature and thread count)
MARGIN = 0.95       # a count wins where it takes less than this share of the other's time
LONG_OP = 1e-3      # seconds on all threads from which an op is no longer tried on one
SLOWER = 2.0        # an op this many times slower on one thread is no longer tried there


class Choice:
    """A plan's threads per op: measured over its first steps, then fixed.
    `threads`: the count it was measured for; `counts`: per op, None (all) or 1,
    once chosen; `times`: {count: per op, the least seconds so far} while measuring;
    `tried`: per op, whether its measuring steps on one thread still try it there."""

    def __init__(self, threads, ops):
        self.threads, self.steps = threads, 0
        self.counts = None
        self.times = {threads: [float("inf")] * ops, 1: [float("inf")] * ops}
        self.tried = [True] * ops

    def count_for(self, i):
        """The count op i runs on in this measuring step (None: all): every op on all
        threads in even steps, on one in odd steps where it is still tried there."""
        return 1 if self.steps % 2 and self.tried[i] else None

    def ran(self, i, count, seconds):
        """Op i ran on `count` (None: all) for `seconds`. An op stops being tried on one
        thread once it took LONG_OP on all (one thread cannot gain much where the split
        costs so little of its time) or SLOWER times its time on all on one (so that on
        many cores the measuring costs a big op one slow run at most)."""
        everyone, one = self.times[self.threads], self.times[1]
        row = everyone if count is None else one
        if seconds < row[i]:
            row[i] = seconds
        if everyone[i] > LONG_OP or (count == 1 and one[i] > SLOWER * everyone[i]):
            self.tried[i] = False

    def step_done(self):
        """A measured step is over: after 2 * ROUNDS of them, choose."""
        self.steps += 1
        if self.steps == 2 * ROUNDS:
            counts, count = [], None
            for everyone, one, tried in zip(self.times[self.threads], self.times[1],
                                            self.tried):
                if not tried:
                    count = None
                elif one < MARGIN * everyone:
                    count = 1
                elif everyone < MARGIN * one:
                    count = None
                counts.append(count)        # a close call keeps the op before's count
            self.counts, self.times = tuple(counts), None


def contended():
    """Whether another process lately wanted the cores (the native pool saw a yield
    give its core away: kernels/cpu/native_pool.h). A step then runs every op on one
    thread, and measures nothing: a split op would wait for a thread that has no
    core, and its times would not be the machine's."""
    from minigraph.kernels.cpu import native

    return native.pool_contended()


def choice_for(c, check):
    """The compiled CPU training plan `c`'s Choice for a step with the signature in use
    and the thread count now (made at its first step after the check run), or None:
    nothing to measure or set."""
    from minigraph.kernels.cpu import blocks, choices

    threads = blocks.get_num_threads()
    if check or threads == 1 or not choices.enabled():
        return None
    key = (c.in_use, threads)
    choice = c.op_threads.get(key)
    if choice is None:
        if len(c.op_threads) >= KEPT:
            del c.op_threads[next(iter(c.op_threads))]
        choice = c.op_threads[key] = Choice(threads, len(c.steps))
    return choice


def settled(plan, place):
    """Whether `plan`'s next steps on `place` run on a choice already made, or on every
    thread with nothing to measure (an inference plan, a GPU, one thread), rather than
    on the counts of the steps that measure them (net.profile warms up past those)."""
    from minigraph.kernels.cpu import blocks, choices

    threads = blocks.get_num_threads()
    if not plan.lean or place.kind != "cpu" or threads == 1 or not choices.enabled():
        return True
    c = plan.compiled(place)
    choice = c.op_threads.get((c.in_use, threads))
    return choice is not None and choice.counts is not None


def use(count):
    """Run the next kernels on `count` threads (None: all of get_num_threads())."""
    from minigraph.kernels.cpu import blas_threads, blocks

    blocks.cap_threads(count)
    blas_threads.set_threads(count or blocks.get_num_threads())


clock = time.perf_counter
