"""Host time per GPU op: the dispatch path with a fake launcher, on any machine.

Runs the ops of a small training net (conv2d, batch_norm, relu, pool2d, fc,
softmax_with_cross_entropy, mean, their grads, Momentum updates, and the
data-parallel gradient average c_allreduce_avg) on a GPUPlace whose PyCUDA is
the tests' fake driver (tests/kernel_emulator/fake_pycuda.py) with kernels that
do nothing: what is timed is minigraph's own host work per op - checks, launch
plans, pool allocations, argument packing, context pushes - plus the fake
driver's few Python calls standing in for PyCUDA's C++ ones. Three columns:

  Net step       as Net.train runs a step whose input signature it has checked
                 before: the plan's compiled steps (minigraph.executor), checks
                 skipped, inside one `with place.activate():`
  Executor.run   as Executor.run runs them: a plan of one op, its inputs
                 checked and its kernel picked every time, inside one
                 `with place.activate():`
  not activated  Executor.run outside any activate block: one context push and
                 pop per launch, allocation and copy (code that runs ops by hand)

The target (<= 20 us/op) is for the two activated columns. A training step
also saves the persistables it writes (the Journal: one device copy each),
reported per step below the table.

Each cell is the median over --processes fresh processes (default 5) of the
median of 7 rounds (see time_ops): on a shared machine one process can run
the same Python code up to twice as slowly as the next, for its whole life.

    python benchmarks/gpu_dispatch.py [--repeat 2000] [--batch 32] [--processes 5]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

TARGET_US = 20.0


class LoopbackComm:
    """A communicator of two ranks whose collectives return this rank's values:
    c_allreduce_avg then packs, reduces and unpacks as on real ranks."""

    backend = "loopback"
    size, rank = 2, 0

    def allreduce(self, x, what=""):
        return x


def build(place, batch):
    import minigraph as mg
    from minigraph import layers

    net = mg.Net(place=place, seed=1)
    image = layers.data(net, "image", shape=(-1, 3, 16, 16))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, image, num_filters=16, filter_size=3, padding=1)
    h = layers.relu(net, layers.batch_norm(net, h))
    h = layers.pool2d(net, h, 2)
    logits = layers.fc(net, h, size=10)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Momentum(learning_rate=0.1).minimize(net, loss)
    rng = np.random.default_rng(0)
    feed = {"image": rng.standard_normal((batch, 3, 16, 16)).astype(np.float32),
            "label": rng.integers(0, 10, batch).astype(np.int64)}
    return net, loss, feed


def averaging_op(net):
    """A c_allreduce_avg over every parameter's gradient (data_parallel's op)."""
    import minigraph as mg

    grads = [net.grad(p) for p in net.parameters()]
    return mg.Operator("c_allreduce_avg", x=grads, out=grads)


def net_steps(net, loss, extra):
    """{id(op): a compiled plan of one step} of the training plan of `net` plus the ops
    `extra`, each releasing nothing (so that it can run again on the same values) and
    with its kernel picked by one checked run."""
    from minigraph import executor
    from minigraph.plan import Compiled, Plan

    plan = Plan(list(net.ops("train")) + list(extra), "train", (loss,))
    found = {}
    for step in plan.compiled(net.place).steps:
        one = Compiled((step._replace(drops=(), thins=(), donors=()),), (), (),
                                net.place)
        executor._run_steps(one, "gpu", check=True)
        found[id(step.op)] = one
    return found


ROUNDS = 7


def time_ops(ops, ways, repeat, counts):
    """{way: ({op type: [us per run, ...]}, {op type: [(arrays, launches) per run, ...]})}
    for `ways` = {way: (run_one, activate)}: `repeat` runs of `run_one(op)` for each
    op inside `activate()`, in ROUNDS rounds, each of which visits every op and
    every way in turn, so that the rounds of one op are spread over the whole
    run and a slow spell of the machine hits one of them, not all; the median
    of the rounds' means is kept. `counts` is the fake driver's call counter."""
    from kernel_emulator.fake_memory import FakeArray

    runs = max(1, repeat // ROUNDS)
    for run_one, activate in ways.values():    # warm: plans, kernels, pool blocks, caches
        with activate():
            for _ in range(max(1, runs // 4)):
                for op in ops:
                    run_one(op)
    rounds, made = defaultdict(list), {}
    for _ in range(ROUNDS):
        for i, op in enumerate(ops):
            for way, (run_one, activate) in ways.items():
                with activate():
                    before = (FakeArray.made, counts["launch"])
                    start = time.perf_counter()
                    for _ in range(runs):
                        run_one(op)
                    rounds[way, i].append((time.perf_counter() - start) / runs * 1e6)
                made.setdefault((way, i), ((FakeArray.made - before[0]) / runs,
                                           (counts["launch"] - before[1]) / runs))
    found = {way: (defaultdict(list), defaultdict(list)) for way in ways}
    for i, op in enumerate(ops):
        for way in ways:
            found[way][0][op.type].append(float(np.median(rounds[way, i])))
            found[way][1][op.type].append(made[way, i])
    return found


def time_journal(net, place, repeat):
    """(microseconds per training step spent saving persistables, how many are saved):
    Journal.save of every persistable the train plan's ops write."""
    from minigraph.journal import Journal

    writes = [v for op in net.ops("train") for v in op.output_vars() if v.persistable]
    with place.activate():
        Journal(place).save(writes)
        start = time.perf_counter()
        for _ in range(repeat):
            Journal(place).save(writes)
    return (time.perf_counter() - start) / repeat * 1e6, len({id(v) for v in writes})


def time_arrays(repeat):
    """Microseconds per pooled device array made and dropped (loader.empty)."""
    from minigraph.kernels.cuda import loader

    loader.empty((32, 16, 16, 16), np.float32)
    start = time.perf_counter()
    for _ in range(repeat * 10):
        loader.empty((32, 16, 16, 16), np.float32)
    return (time.perf_counter() - start) / (repeat * 10) * 1e6


COLUMNS = ("Net step", "Executor.run", "not activated")


def measure(repeat, batch):
    """One process's measurements: {"rows": [[op type, count, us per column...,
    arrays, launches]], "array_us", "journal_us", "saved"}."""
    import contextlib

    from kernel_emulator.fake_pycuda import FakeCuda

    import minigraph as mg
    from minigraph import executor
    from minigraph.distributed import world

    fake = FakeCuda(devices=1, run_kernels=False, strict=False, sm_count=132)
    with fake.install():
        place = mg.GPUPlace(0)
        net, loss, feed = build(place, batch)
        net.train(feed, fetch=[loss])                   # compiles (fake), checks the plan
        world.get_comm = LoopbackComm
        average = averaging_op(net)
        ops = list(net.ops("train")) + [average]
        runner = mg.Executor(place)
        runner.run(ops)                                 # fills every var
        steps = net_steps(net, loss, [average])

        def step(op):
            executor._run_steps(steps[id(op)], "gpu", check=False)

        def run_one(op):
            runner.run([op])

        ways = dict(zip(COLUMNS, ((step, place.activate), (run_one, place.activate),
                                  (run_one, contextlib.nullcontext)), strict=True))
        timed = time_ops(ops, ways, repeat, fake.counts)
        with place.activate():
            array_us = time_arrays(repeat)
        journal_us, saved = time_journal(net, place, repeat)
    made = timed["Net step"][1]
    rows = [[t, len(made[t]), *(float(np.mean(timed[c][0][t])) for c in COLUMNS),
             float(np.mean([m[0] for m in made[t]])), float(np.mean([m[1] for m in made[t]]))]
            for t in made]
    return {"rows": rows, "array_us": array_us, "journal_us": journal_us, "saved": saved}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--processes", type=int, default=5,
                        help="fresh processes measured; each cell is their median")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        json.dump(measure(args.repeat, args.batch), sys.stdout)
        return
    found = []
    for _ in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--child", "--repeat", str(args.repeat),
                               "--batch", str(args.batch)], capture_output=True, text=True,
                              check=True)
        found.append(json.loads(done.stdout))
    report(found, args)


def report(found, args):
    """Print the table: per op and column the median over the processes."""
    rows = []
    for i, (name, n, *_) in enumerate(found[0]["rows"]):
        cells = np.array([f["rows"][i][2:] for f in found])
        rows.append((name, n, *np.median(cells, axis=0)))
    rows.sort(key=lambda r: -max(r[2], r[3]))
    print(f"host time per op (us), fake launcher (kernels do nothing), batch {args.batch}: "
          f"the median over {len(found)} processes of the median of {ROUNDS} rounds' means "
          f"({args.repeat} runs per op and column), Python {sys.version.split()[0]}")
    print(f"{'op':<32} {'n':>3} " + " ".join(f"{c:>13}" for c in COLUMNS) +
          f" {'arrays/op':>10} {'launches/op':>12}")
    for name, n, *us, arrays, launches in rows:
        print(f"{name:<32} {n:>3} " + " ".join(f"{u:>13.1f}" for u in us) +
              f" {arrays:>10.1f} {launches:>12.1f}")
    ops = sum(r[1] for r in rows)
    means = [sum(r[1] * r[2 + c] for r in rows) / ops for c in range(len(COLUMNS))]
    print(f"{'mean over the ' + str(ops) + ' ops':<36} " + " ".join(f"{m:>13.1f}" for m in means))
    median = {k: float(np.median([f[k] for f in found])) for k in ("array_us", "journal_us")}
    print(f"one device array (pooled, the fake's GPUArray stand-in) costs "
          f"{median['array_us']:.1f} us of the above per array made")
    print(f"a training step's journal saves {found[0]['saved']} persistables: "
          f"{median['journal_us']:.1f} us per step (not in the table)")
    slowest = max(max(r[2], r[3]) for r in rows)
    spread = [max(max(row[2:4]) for row in f["rows"]) for f in found]
    print("slowest op (Net step or Executor.run) per process: "
          + ", ".join(f"{u:.1f}" for u in spread) + " us")
    over = [r[0] for r in rows if max(r[2], r[3]) > TARGET_US]
    print(f"target <= {TARGET_US:g} us/op (Net step and Executor.run): "
          + (f"met by every op (slowest {slowest:.1f})" if not over
             else "missed by " + ", ".join(over)))


if __name__ == "__main__":
    main()
