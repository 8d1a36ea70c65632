"""The cost of making a training step all or nothing (minigraph/run.py's journal).

Before an op writes a persistable, a training step copies it into a buffer
kept with the plan, so that a failing step can put everything back; that copy
is all the guarantee costs on the normal path. This times the journal's work
inside training steps of the demo net and of the CIFAR-sized ResNet of
benchmarks/nets_cpu.py (a timer around Journal.save) against the whole step:
the mean over repeated steps after warm-up, 2 threads, one process.

    python benchmarks/step_journal.py [--repeat 200] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    import nets_cpu

    import minigraph as mg
    from minigraph import journal as journal_module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200,
                        help="steps for the digits net; a tenth of them for the ResNet")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    mg.set_num_threads(args.threads)
    real_save = journal_module.Journal.save
    spent = [0.0]

    def timed_save(self, variables):
        start = time.perf_counter()
        real_save(self, variables)
        spent[0] += time.perf_counter() - start

    print(f"training steps, {args.threads} threads")
    print("| net | step ms | journal ms per step | share | state copied per step |")
    print("|---|---|---|---|---|")
    journal_module.Journal.save = timed_save
    try:
        for name, steps in (("digits", args.repeat), ("resnet", max(args.repeat // 10, 5))):
            net, image, _, loss = nets_cpu.mg_net(name)
            x, y = nets_cpu.batch(name)
            feed = {image.name: x, "label": y}
            for _ in range(10):
                net.train(feed=feed, fetch=[loss])
            spent[0] = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                net.train(feed=feed, fetch=[loss])
            step = (time.perf_counter() - start) / steps
            journal = spent[0] / steps
            written = {id(v): v for plan in net._plans.values()
                       for op in plan.ops for v in op.output_vars() if v.persistable}
            mib = sum(v.value.nbytes for v in written.values()) / 2 ** 20
            print(f"| {name} | {1e3 * step:.3f} | {1e3 * journal:.3f} | "
                  f"{100 * journal / step:.1f}% | {len(written)} arrays, {mib:.2f} MiB |")
    finally:
        journal_module.Journal.save = real_save


if __name__ == "__main__":
    main()
