"""Training with small batches: batch_norm, group_norm and sync_batch_norm side by side.

    python examples/small_batch.py [--epochs 3] [--batch-size 4] [--seed 0]

Trains the residual digits net of examples/train_resnet_digits.py (AdamW, a
cosine schedule, the same seed and batch order) with a batch of --batch-size
digits per step, four ways, and prints a table of held-out accuracy and time:

- batch_norm on the whole batch, in one process;
- batch_norm on half of it: what each of two devices would see on its own;
- group_norm (groups of 4 channels), which needs no batch statistics;
- sync_batch_norm over 2 MPI ranks (the mpiexec next to this Python), each
  holding half of every global batch, with the gradients averaged
  (mg.distributed.data_parallel): the statistics are the whole batch's again.

Every run takes its batches from the same minigraph.data.DataLoader (seed
and epoch give the order); in the synced run the loader splits each global
batch across the ranks itself, and each rank runs its share of the host's
cores in threads (mg.distributed.init's default). Needs scikit-learn (the
digits) and, for the last row, mpi4py with an MPI.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import minigraph as mg
from minigraph.examples.train_digits import load_digits_split
from minigraph.examples.train_resnet_digits import build_net, make_loader, train

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def held_out(net, logits, test_x, test_y):
    (out,) = net.infer(feed={"image": test_x}, fetch=[logits])
    return float((out.argmax(axis=1) == test_y).mean())


def one_process(norm, batch_size, args):
    """(accuracy, seconds) of training in this process."""
    net, h, history = train(args.epochs, batch_size=batch_size, seed=args.seed, progress=False,
                            log=lambda *a: None, norm=norm)
    return history["accuracy"][-1], history["seconds"]


def synced_rank(args):
    """One rank of the synced run: its rows of every global batch, sync_batch_norm and
    averaged gradients; rank 0 prints (accuracy, seconds) as JSON."""
    comm = mg.distributed.init()
    train_x, train_y, test_x, test_y = load_digits_split()
    loader = make_loader(train_x, train_y, args.batch_size, args.seed)   # train()'s batches
    net, h = build_net(comm.place, args.seed, args.epochs, len(loader), norm="sync_batch_norm")
    mg.distributed.data_parallel(net, batch_size_from="label")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for feed in loader:                          # this rank's rows of each batch
            net.train(feed=feed, fetch=[h["loss"]])
    seconds = time.perf_counter() - start
    if comm.rank == 0:
        print(json.dumps([held_out(net, h["logits"], test_x, test_y), seconds]))


def synced(args):
    """(accuracy, seconds) of the 2-rank sync_batch_norm run, or None with the reason."""
    if not os.path.exists(MPIEXEC):
        return None, f"no mpiexec next to {sys.executable}"
    cmd = [MPIEXEC, "-n", "2", sys.executable, os.path.abspath(__file__), "--rank",
           "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
           "--seed", str(args.seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return None, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
    return tuple(json.loads(done.stdout.strip().splitlines()[-1])), None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 2 or args.batch_size < 4 or args.seed < 0:
        parser.error("--epochs must be >= 2 (one is warm-up), --batch-size >= 4 (two ranks of "
                     "at least two rows), --seed >= 0")
    if args.rank:
        return synced_rank(args)
    half = args.batch_size // 2
    rows = [(f"batch_norm, {args.batch_size} per step", *one_process("batch_norm",
                                                                     args.batch_size, args)),
            (f"batch_norm, {half} per step (one device's share)",
             *one_process("batch_norm", half, args)),
            (f"group_norm, {args.batch_size} per step",
             *one_process("group_norm", args.batch_size, args))]
    result, why = synced(args)
    name = f"sync_batch_norm, 2 ranks x {half} ({args.batch_size} per step)"
    rows.append((name, *result) if result else (name, None, why))
    print(f"residual digits net, {args.epochs} epochs, seed {args.seed}")
    print("| normalisation | held-out accuracy | training time |")
    print("|---|---|---|")
    for name, acc, seconds in rows:
        if acc is None:
            print(f"| {name} | not run: {seconds} | |")
        else:
            print(f"| {name} | {100 * acc:.1f}% | {seconds:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
