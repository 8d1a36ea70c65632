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


def time_ops(executor, ops, repeat, activate):
    """{op type: [microseconds per run_op, ...]} over `repeat` runs of each op."""
    per_type = defaultdict(list)
    for op in ops:
        with activate():
            executor.run_op(op)                    # warm: plans, kernels, pool blocks
            start = time.perf_counter()
            for _ in range(repeat):
                executor.run_op(op)
            per_type[op.type].append((time.perf_counter() - start) / repeat * 1e6)
    return per_type


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
        plain = time_ops(executor, ops, args.repeat, contextlib.nullcontext)
        active = time_ops(executor, ops, args.repeat, place.activate)
    rows = [(t, len(plain[t]), float(np.mean(plain[t])), float(np.mean(active[t])))
            for t in plain]
    rows.sort(key=lambda r: -r[2])
    print(f"host time per op, fake launcher (kernels do nothing), batch {args.batch}, "
          f"{args.repeat} runs each, Python {sys.version.split()[0]}")
    print(f"{'op':<32} {'n':>3} {'us/op as today':>15} {'us/op activated':>16}")
    for name, n, us_plain, us_active in rows:
        print(f"{name:<32} {n:>3} {us_plain:>15.1f} {us_active:>16.1f}")
    every_plain = [u for v in plain.values() for u in v]
    every_active = [u for v in active.values() for u in v]
    print(f"{'mean over the ' + str(len(every_plain)) + ' ops':<36} "
          f"{np.mean(every_plain):>15.1f} {np.mean(every_active):>16.1f}")
    over = [r[0] for r in rows if r[3] > TARGET_US]
    print(f"target <= {TARGET_US:g} us/op (activated): "
          + ("met by every op" if not over else "missed by " + ", ".join(over)))


if __name__ == "__main__":
    main()
