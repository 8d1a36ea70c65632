"""The DataLoader's cost: resnet-digits train steps fed by the loader against ready arrays.

    python benchmarks/loader.py [--threads 2] [--rounds 12] [--no-write]

The residual digits net of examples/train_resnet_digits.py (AdamW, cosine
schedule, clipping), batch 64 of the digits training split. Three ways to feed
the same steps:

- ready arrays: the epoch's batches made beforehand (shuffled, cropped and
  flipped by the same loader), then net.train over the list: the step alone;
- loader, prefetch 2: DataLoader(shuffle, RandomCrop(8, padding=1),
  RandomHorizontalFlip(0.5)) with its background thread making the next
  batches while the step runs;
- loader, prefetch 0: the same loader making each batch in the loop itself.

A round trains one epoch each way, the same epoch (so the same batches), in
an order that rotates from round to round; one warm-up epoch first. A step's
time runs from asking for its batch to the end of net.train, so waiting for
the loader counts. The table shows each way's median step and mean step over
all rounds, and the median over rounds of its epoch time divided by the ready
arrays' epoch time in the same round (paired, so a busy spell on a shared
machine lands on both sides), and the time to make one batch without
training. Target: the prefetching loader within 5% of ready arrays. It prints
the table and writes it, with the machine and the date, into the `loader`
section of docs/performance.md; --no-write only prints.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

TARGET = 1.05
BATCH = 64
WAYS = ("ready arrays", "loader, prefetch 2", "loader, prefetch 0")


def make_loader(train, prefetch):
    """The benchmark's loader: shuffled, cropped and flipped, whole batches of BATCH."""
    from minigraph import data
    from minigraph.data import transforms as T

    augment = T.Compose([T.RandomCrop(8, padding=1), T.RandomHorizontalFlip(0.5)])
    return data.DataLoader(train, BATCH, shuffle=True, drop_last=True, seed=1,
                           transform=augment, prefetch=prefetch)


def step_times(net, loss, feeds):
    """The time of each step over `feeds` (an iterable), waiting for the feed included."""
    times, it = [], iter(feeds)
    while True:
        start = time.perf_counter()
        try:
            feed = next(it)
        except StopIteration:
            return times
        net.train(feed=feed, fetch=[loss])
        times.append(time.perf_counter() - start)


def measure(args):
    """{way: [per-round lists of step seconds]} and the steps per epoch."""
    import minigraph as mg
    from minigraph import data
    from minigraph.examples.train_resnet_digits import build_net

    mg.set_num_threads(args.threads)
    train = data.datasets.digits("train")
    loaders = {WAYS[1]: make_loader(train, 2), WAYS[2]: make_loader(train, 0)}
    steps = len(loaders[WAYS[1]])
    net, h = build_net(seed=0, epochs=len(WAYS) * args.rounds + 1, steps_per_epoch=steps)
    ready = make_loader(train, 0)

    def feeds(way, epoch):
        if way == WAYS[0]:
            ready.set_epoch(epoch)
            return list(ready)                        # made before the clock starts
        loaders[way].set_epoch(epoch)
        return loaders[way]

    step_times(net, h["loss"], feeds(WAYS[1], 0))     # warm-up: plans, kernels, caches
    start = time.perf_counter()
    made = sum(1 for _ in feeds(WAYS[2], 0))
    alone = (time.perf_counter() - start) / made      # making a batch, no training
    times = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            times[way].append(step_times(net, h["loss"], feeds(way, r + 1)))
        print(f"round {r + 1}: " + ", ".join(f"{w} {sum(t[-1]) / steps * 1e3:.2f} ms"
                                               for w, t in times.items()), flush=True)
    return times, steps, alone


def rows(times):
    ready_epochs = [sum(t) for t in times[WAYS[0]]]
    out = []
    for way in WAYS:
        every = [s for epoch in times[way] for s in epoch]
        paired = statistics.median(sum(t) / base for t, base in zip(times[way], ready_epochs))
        target = ""
        if way == WAYS[1]:
            target = f"<= {TARGET:.2f} " + ("ok" if paired <= TARGET else "MISSED")
        out.append([way, f"{statistics.median(every) * 1e3:.2f}",
                    f"{statistics.fmean(every) * 1e3:.2f}", f"{paired:.3f}", target])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="mg.set_num_threads (default 2)")
    p.add_argument("--rounds", type=int, default=12, help="rounds of the three ways (default 12)")
    p.add_argument("--no-write", action="store_true",
                   help="print only; do not replace the 'loader' section of docs/performance.md")
    args = p.parse_args(argv)
    if min(args.threads, args.rounds) < 1:
        p.error("--threads and --rounds must be >= 1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import machine_line, markdown_table, write_section

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    times, steps, alone = measure(args)
    table = rows(times)
    header = ["fed by", "median step ms", "mean step ms", "epoch time / ready arrays'",
              "target"]
    text = "\n".join([
        "The DataLoader feeding the resnet-digits train step (`benchmarks/loader.py`; "
        "[data.md](data.md)).", "",
        machine_line(f"{args.threads} threads; the resnet-digits train step, batch {BATCH}, "
                     f"{steps} steps per epoch, {args.rounds} rounds of one epoch each way "
                     "(order rotating) in one process; a step includes waiting for its batch; "
                     "the ratio is the median over rounds of the paired epoch times; load average "
                     f"{load:.1f} at the start."),
        "", markdown_table(header, table), "",
        f"Making one batch alone (index, crop, flip; no training): {alone * 1e3:.2f} ms."])
    print("\n" + text)
    write_section("loader", text, enabled=not args.no_write)
    return 0 if all("MISSED" not in r[-1] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
