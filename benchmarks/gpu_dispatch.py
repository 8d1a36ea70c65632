"""Host time per GPU op: the dispatch path with a fake launcher, on any machine.

Runs the ops of a small training net (conv2d, batch_norm, relu, pool2d, fc,
softmax_with_cross_entropy, mean, their grads, Momentum updates, and the
data-parallel gradient average c_allreduce_avg) through Executor.run_op on a
GPUPlace whose PyCUDA is the tests' fake driver (tests/kernel_emulator/
fake_pycuda.py) with kernels that do nothing: what is timed is minigraph's
own host work per op - checks, launch plans, pool allocations, argument
packing, context pushes - plus the fake driver's few Python calls standing
in for PyCUDA's C++ ones. Two columns: ops run as the Executor runs them
today, and ops run inside `with place.activate():` (one context push per
run instead of one per launch or allocation).

    python benchmarks/gpu_dispatch.py [--repeat 2000] [--batch 32]
"""
from __future__ import annotations

import argparse
import pathlib
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


def time_ops(executor, ops, repeat, activate, counts):
    """({op type: [us per run_op, ...]}, {op type: [(arrays, launches) per run, ...]})
    over `repeat` runs of each op; `counts` is the fake driver's call counter."""
    per_type, made = defaultdict(list), defaultdict(list)
    for op in ops:
        with activate():
            executor.run_op(op)                    # warm: plans, kernels, pool blocks
            before = (counts["array"], counts["launch"])
            start = time.perf_counter()
            for _ in range(repeat):
                executor.run_op(op)
            per_type[op.type].append((time.perf_counter() - start) / repeat * 1e6)
            made[op.type].append(((counts["array"] - before[0]) / repeat,
                                  (counts["launch"] - before[1]) / repeat))
    return per_type, made


def time_arrays(repeat):
    """Microseconds per pooled device array made and dropped (loader.empty)."""
    from minigraph.kernels import loader

    loader.empty((32, 16, 16, 16), np.float32)
    start = time.perf_counter()
    for _ in range(repeat * 10):
        loader.empty((32, 16, 16, 16), np.float32)
    return (time.perf_counter() - start) / (repeat * 10) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    import contextlib

    from kernel_emulator.fake_pycuda import FakeCuda

    import minigraph as mg
    from minigraph.ops import collective

    fake = FakeCuda(devices=1, run_kernels=False, strict=False, sm_count=132)
    with fake.install():
        place = mg.GPUPlace(0)
        net, loss, feed = build(place, args.batch)
        for name, value in feed.items():
            net.var(name).set(place.to_device(value))
        collective.communicator = LoopbackComm
        ops = list(net.ops("train")) + [averaging_op(net)]
        executor = mg.Executor(place)
        for op in ops:                                  # compiles (fake), fills every var
            executor.run_op(op)
        plain, _ = time_ops(executor, ops, args.repeat, contextlib.nullcontext, fake.counts)
        active, made = time_ops(executor, ops, args.repeat, place.activate, fake.counts)
        array_us = time_arrays(args.repeat)
    rows = [(t, len(plain[t]), float(np.mean(plain[t])), float(np.mean(active[t])),
             float(np.mean([m[0] for m in made[t]])), float(np.mean([m[1] for m in made[t]])))
            for t in plain]
    rows.sort(key=lambda r: -r[3])
    print(f"host time per op, fake launcher (kernels do nothing), batch {args.batch}, "
          f"{args.repeat} runs each, Python {sys.version.split()[0]}")
    print(f"{'op':<32} {'n':>3} {'us/op as today':>15} {'us/op activated':>16} "
          f"{'arrays/op':>10} {'launches/op':>12}")
    for name, n, us_plain, us_active, arrays, launches in rows:
        print(f"{name:<32} {n:>3} {us_plain:>15.1f} {us_active:>16.1f} {arrays:>10.1f} "
              f"{launches:>12.1f}")
    every_plain = [u for v in plain.values() for u in v]
    every_active = [u for v in active.values() for u in v]
    print(f"{'mean over the ' + str(len(every_plain)) + ' ops':<36} "
          f"{np.mean(every_plain):>15.1f} {np.mean(every_active):>16.1f}")
    print(f"one device array (pooled, the fake's GPUArray stand-in) costs {array_us:.1f} us "
          "of the above per array made")
    over = [r[0] for r in rows if r[3] > TARGET_US]
    print(f"target <= {TARGET_US:g} us/op (activated): "
          + ("met by every op" if not over else "missed by " + ", ".join(over)))


if __name__ == "__main__":
    main()
