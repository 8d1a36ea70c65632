"""The cost of making a training step all or nothing (minigraph/journal.py).

Before an op writes a persistable, a training step notes its old value so that a
failing step can put everything back. Ops that write out of place (optimizer
updates into a spare array the journal hands them) need no copy; only an op
that changes an array in place gets one. This times everything the journal
does inside training steps (save, spare, set_aside_values, commit, with a
timer around each) of the nets of benchmarks/nets_cpu.py, against the whole
step, and counts the bytes it copies: the mean over repeated steps after
warm-up, 2 threads, one process. The target (issue: CPU speed, second round)
is at most 2 % of a wide-MLP Adam step.

    python benchmarks/step_journal.py [--repeat 100] [--threads 2] [--nets ...] [--no-write]

It prints its table and writes it into the `step_journal` section of
docs/performance.md; --no-write only prints.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMED = ("save", "spare", "set_aside_values", "commit")
STEPS = {"digits": 1.0, "mnist": 0.5, "mlp": 0.3, "resnet": 0.1}   # share of --repeat


def timed_journal(journal_module):
    """Wrap the Journal's methods with timers; returns (spent seconds, copied bytes,
    undo) as one-element lists and a function putting the methods back."""
    cls = journal_module.Journal
    real = {name: getattr(cls, name) for name in (*TIMED, "_copy")}
    spent, copied = [0.0], [0]

    def timer(fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapped

    def counting_copy(self, var, value):
        copied[0] += getattr(value, "nbytes", 0)
        return real["_copy"](self, var, value)

    for name in TIMED:
        setattr(cls, name, timer(real[name]))
    cls._copy = counting_copy

    def undo():
        for name, fn in real.items():
            setattr(cls, name, fn)
    return spent, copied, undo


def measure(name, steps):
    """(step ms, journal ms per step, MiB copied per step, persistables written, their MiB)."""
    import nets_cpu

    from minigraph import journal as journal_module

    net, image, _, loss = nets_cpu.mg_net(name)
    x, y = nets_cpu.batch(name)
    feed = {image.name: x, "label": y}
    for _ in range(10):
        net.train(feed=feed, fetch=[loss])
    spent, copied, undo = timed_journal(journal_module)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            net.train(feed=feed, fetch=[loss])
        step = (time.perf_counter() - start) / steps
    finally:
        undo()
    written = {id(v): v for plan in net._plans.values()
               for op in plan.ops for v in op.output_vars() if v.persistable}
    state_mib = sum(v.value.nbytes for v in written.values()) / 2 ** 20
    return (1e3 * step, 1e3 * spent[0] / steps, copied[0] / steps / 2 ** 20, len(written),
            state_mib)


def main(argv=None):
    from report import machine_line, markdown_table, write_section

    import minigraph as mg

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100,
                        help="steps of the digits net; fewer for the larger nets")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--nets", nargs="+", default=list(STEPS), choices=list(STEPS))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    mg.set_num_threads(args.threads)
    header = ["net", "step ms", "journal ms per step", "share", "copied per step",
              "persistables written", "target"]
    rows = []
    for name in args.nets:
        step, journal, copied, count, state = measure(name, max(5, int(args.repeat * STEPS[name])))
        share = 100 * journal / step
        target = ("<= 2 % " + ("ok" if share <= 2 else "MISSED")) if name == "mlp" else ""
        rows.append([name, f"{step:.3f}", f"{journal:.4f}", f"{share:.2f} %",
                     f"{copied:.3f} MiB", f"{count} ({state:.2f} MiB)", target])
        print(" | ".join(rows[-1]))
    text = "\n".join([machine_line(f"{args.threads} threads, one process; means over "
                                   "repeated steps after 10 warm-up steps. The journal's "
                                   "time is inside the step time."), "",
                      markdown_table(header, rows)])
    write_section("step_journal", text, enabled=not args.no_write)


if __name__ == "__main__":
    main()
