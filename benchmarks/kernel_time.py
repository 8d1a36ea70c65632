"""Time outside the kernels, for nets_cpu.py's notes: every registered CPU kernel
wrapped with a timer (a training step's time minus its kernels' time, per op run), and
the executor's overhead per op on a net of tiny relus against calling their kernel."""
from __future__ import annotations

import dataclasses
import statistics
import time

from timing import median_ms


def wrap_kernels():
    """Wrap every registered CPU kernel with a timer; returns [seconds inside kernels]."""
    from minigraph.schema import get_schema, registered_ops

    spent = [0.0]
    for op_type in registered_ops():
        kernels = get_schema(op_type).kernels
        if "cpu" in kernels:
            kernels["cpu"] = tuple(dataclasses.replace(k, fn=_timed(k.fn, spent))
                                   for k in kernels["cpu"])
    return spent


def _timed(fn, spent):
    clock = time.perf_counter

    def timed(op, ins, ctx):
        t = clock()
        try:
            return fn(op, ins, ctx)
        finally:
            spent[0] += clock() - t
    return timed


def kernel_share(step, spent, ops, repeat, warmup):
    """{"overhead_us": the median over `repeat` calls of step() (after `warmup`) of its
    time outside the kernels wrap_kernels timed (`spent`) per op, in us; "ops": ops}."""
    for _ in range(warmup):
        step()
    per_op = []
    for _ in range(repeat):
        spent[0] = 0.0
        t = time.perf_counter()
        step()
        total = time.perf_counter() - t
        per_op.append((total - spent[0]) / ops * 1e6)
    return {"overhead_us": statistics.median(per_op), "ops": ops}


def tiny_overhead(repeat, count=100):
    """Per-op executor overhead on `count` relus over a (2, 3) tensor, through net.infer."""
    import numpy as np

    import minigraph as mg
    from minigraph import layers
    from minigraph.schema import KernelContext

    net = mg.Net(seed=0)
    h = x = layers.data(net, "x", shape=(2, 3))
    for _ in range(count):
        h = layers.relu(net, h)
    value = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    op = net.ops("infer")[0]
    ins = {"x": value}
    kernel, ctx = op.schema.kernel_for("cpu", ins), KernelContext()

    def kernels():
        for _ in range(count):
            kernel(op, ins, ctx)

    run = median_ms(lambda: net.infer(feed={x.name: value}, fetch=[h]), repeat * 5, 5)
    bare = median_ms(kernels, repeat * 5, 5)
    return {"tiny_run_us": run * 1e3 / count, "tiny_kernel_us": bare * 1e3 / count}
