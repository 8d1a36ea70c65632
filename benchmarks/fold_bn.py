"""What mg.passes.fold_batch_norm does to the demo net: inference op count and time.

Trains the demo net (minigraph.examples.train_digits.build_net) for a few
steps, folds its batch norms, and times `net.infer` on the original and on
the folded net (median of repeated runs, 2 threads) at two batch sizes; also
the largest difference between the two. One framework, one process.

    python benchmarks/fold_bn.py [--repeat 200] [--threads 2]
"""
from __future__ import annotations

import argparse

import numpy as np
from timing import median_ms

import minigraph as mg
from minigraph.examples.train_digits import build_net


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    mg.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    net, h = build_net(seed=0)
    for _ in range(5):
        net.train(feed={"image": rng.random((32, 1, 8, 8), dtype=np.float32),
                        "label": rng.integers(0, 10, 32)})
    folded = mg.passes.fold_batch_norm(net)
    logits = h["logits"].name
    print(f"demo net, {args.threads} threads, median of {args.repeat} runs")
    print(f"inference ops: {len(net.ops('infer'))} -> {len(folded.ops('infer'))} "
          f"({', '.join(str(n) for n in folded.reports['fold_batch_norm'])})")
    print("| batch | net.infer ms | folded ms | folded / net | max |difference| |")
    print("|---|---|---|---|---|")
    for batch in (1, 64):
        x = rng.random((batch, 1, 8, 8), dtype=np.float32)
        (a,) = net.infer(feed={"image": x}, fetch=[logits])
        (b,) = folded.infer(feed={"image": x}, fetch=[logits])
        warmup = max(3, args.repeat // 10)
        t_net = median_ms(lambda x=x: net.infer(feed={"image": x}, fetch=[logits]), args.repeat,
                          warmup)
        t_fold = median_ms(lambda x=x: folded.infer(feed={"image": x}, fetch=[logits]),
                           args.repeat, warmup)
        print(f"| {batch} | {t_net:.3f} | {t_fold:.3f} | {t_fold / t_net:.2f} | "
              f"{float(np.abs(a - b).max()):.1e} |")


if __name__ == "__main__":
    main()
