"""The executor's own cost: per-op overhead of a training step, and the first step's
compile and checks as the graph grows.

    python benchmarks/executor_cpu.py [--repeat 30] [--no-write]

Nets: deep MLPs of tiny layers (fc 16 -> relu, repeated; batch 8, SGD), so kernel
time is small and the executor's share shows.
- overhead: every CPU kernel wrapped with a timer (benchmarks/nets_cpu.py's
  wrap_kernels); (step time - time inside kernels) / ops run, the timer's own cost
  included; the median over --repeat steps, of a net of about 800 ops.
- first step: the wall time of the first training step (plan compile, checks, the
  memory measurement) less a later step's, per op, at about 300 and 2,400 ops; the
  target is at most 1.5x per op at 8x the ops (linear in the graph).
One thread; each measurement in a fresh process (this script with --worker).
Writes the `executor_cpu` section of docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEPTHS = {"overhead": 100, "small": 37, "large": 298}     # about 800, 300, 2,400 ops


def build(depth):
    import numpy as np

    import minigraph as mg
    from minigraph import layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 16))
    y = L.data(net, "y", (-1,), "int64")
    h = x
    for _ in range(depth):
        h = L.relu(net, L.fc(net, h, 16))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, h, 4), y))
    mg.optimizer.SGD(0.01).minimize(net, loss)
    feed = {"x": np.ones((8, 16), np.float32), "y": np.zeros(8, np.int64)}
    return net, loss, feed


def worker(what, repeat):
    import minigraph as mg

    mg.set_num_threads(1)
    if what == "overhead":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from nets_cpu import kernel_share, wrap_kernels

        spent = wrap_kernels()
        net, loss, feed = build(DEPTHS[what])
        ops = len(net.plan("train", (loss,)).ops)
        return kernel_share(lambda: net.train(feed=feed, fetch=[loss]), spent, ops, repeat, 5)
    net, loss, feed = build(DEPTHS[what])
    ops = len(net.ops("train"))
    t = time.perf_counter()
    net.train(feed=feed, fetch=[loss])
    first = time.perf_counter() - t
    later = []
    for _ in range(repeat):
        t = time.perf_counter()
        net.train(feed=feed, fetch=[loss])
        later.append(time.perf_counter() - t)
    step = statistics.median(later)
    return {"ops": ops, "first_ms": first * 1e3, "step_ms": step * 1e3,
            "first_us_per_op": (first - step) / ops * 1e6}


def run(what, repeat):
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", what,
                           "--repeat", str(repeat)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--worker", choices=sorted(DEPTHS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.repeat)))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import machine_line, markdown_table, write_section

    rounds = [{w: run(w, args.repeat) for w in DEPTHS} for _ in range(args.rounds)]
    over = statistics.median(r["overhead"]["overhead_us"] for r in rounds)
    small = statistics.median(r["small"]["first_us_per_op"] for r in rounds)
    large = statistics.median(r["large"]["first_us_per_op"] for r in rounds)
    first = rounds[0]
    rows = [["executor overhead per op", f"{first['overhead']['ops']} ops", f"{over:.1f} us",
             "<= 10 us " + ("ok" if over <= 10 else "MISSED")],
            ["first step, per op", f"{first['small']['ops']} ops", f"{small:.0f} us", ""],
            ["first step, per op", f"{first['large']['ops']} ops", f"{large:.0f} us",
             f"{large / small:.2f}x the small net's; <= 1.5x "
             + ("ok" if large / small <= 1.5 else "MISSED")]]
    for row in rows:
        print(" | ".join(row))
    text = "\n".join([machine_line(f"1 thread; medians over {args.rounds} rounds of fresh "
                                   "processes."), "",
                      markdown_table(["what", "net", "measured", "target"], rows)])
    write_section("executor_cpu", text, enabled=not args.no_write)


if __name__ == "__main__":
    main()
