"""Train the digits net on K processes with synchronized batch norm.

    mpiexec -n 4 python examples/train_digits_sync.py            # CPUs, MPI
    mpiexec -n 2 python examples/train_digits_sync.py --device gpu   # GPUs, NCCL

Every rank builds the digits net of examples/train_digits.py, turns its
batch norms into sync_batch_norm and makes it data-parallel: parameters are
broadcast from rank 0, the loader (minigraph.data.DataLoader, after
mg.distributed.init()) splits each global batch across the ranks (uneven
splits are fine), batch statistics are those of the whole batch and the
gradients are averaged. The result is the training of one process on the
whole batch. Each rank runs its share of the host's cores in threads (init's
default). Rank 0 prints the progress and writes the checkpoint.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

import minigraph as mg
from minigraph import data
from minigraph.cli import Parser, fail, int_at_least, launcher_rank, out_folder_problem
from minigraph.examples.train_digits import LEARNING_RATE, build_net, load_digits_split

PROG = "train_digits_sync.py"


def parse_args(argv=None):
    """The parsed options; a bad value (--epochs 0, --seed -1, --batch-size 1, an
    --out that is a file or cannot be written) prints one line naming the option
    and exits with code 2 (printed by rank 0 only when a launcher says ranks)."""
    parser = QuietRanksParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="cpu (MPI, default) or gpu (NCCL; GPU local_rank %% device count)")
    parser.add_argument("--epochs", type=int_at_least(1), default=4,
                        help="training epochs, >= 1 (default 4)")
    parser.add_argument("--batch-size", type=int_at_least(2), default=64,
                        help="GLOBAL batch size, split across the ranks: at least 2 per rank "
                             "and at most the training set (default 64)")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        help="parameters and batch order, >= 0 (default 0)")
    parser.add_argument("--out", default="demo_out",
                        help="folder for the checkpoint digits_sync.npz (default demo_out)")
    args = parser.parse_args(argv)
    problem = out_folder_problem(args.out)
    if problem:
        parser.error(f"argument --out: {problem}")
    return args


class QuietRanksParser(Parser):
    """One-line errors, printed by the launcher's rank 0 only (every rank exits 2)."""

    def exit(self, status=0, message=None):
        if launcher_rank() != 0:
            message = None
        super().exit(status, message)


def main(argv=None):
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code
    try:
        comm = mg.distributed.init(place=args.device)
    except mg.GPUError as e:                    # the same on every rank: all stop here
        print(f"error: {e}", file=sys.stderr)
        return 1
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    train_x, train_y, test_x, test_y = load_digits_split()
    if args.batch_size < 2 * comm.size:        # the same on every rank: all stop here
        return fail(PROG, "--batch-size", f"must be at least 2 per rank ({2 * comm.size} for "
                    f"{comm.size} ranks), got {args.batch_size}", comm.rank)
    if args.batch_size > len(train_x):
        return fail(PROG, "--batch-size", f"must be at most the {len(train_x)} training "
                    f"digits (one step per epoch), got {args.batch_size}", comm.rank)
    net, h = build_net(place=comm.place, seed=args.seed)
    mg.distributed.convert_sync_batchnorm(net)
    mg.distributed.data_parallel(net, batch_size_from="label")
    say(f"{comm.size} ranks, backend {comm.backend}, global batch {args.batch_size} "
        f"(per rank {', '.join(map(str, split_sizes(args.batch_size, comm.size)))})")

    loader = data.DataLoader(data.ArrayDataset(image=train_x, label=train_y), args.batch_size,
                             shuffle=True, drop_last=True, seed=args.seed)   # this rank's rows
    steps = len(loader)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        net.optimizer.set_learning_rate(
            LEARNING_RATE * 0.5 * (1 + math.cos(math.pi * (epoch - 1) / args.epochs)))
        loader.set_epoch(epoch - 1)
        total = 0.0
        for feed in loader:
            (loss,) = net.train(feed=feed, fetch=[h["loss"]])
            total += float(loss) * len(feed["label"])
        mean_loss = comm.allreduce(np.array([total]), what="epoch loss")[0] / (
            steps * args.batch_size)
        (logits,) = net.infer(feed={"image": test_x}, fetch=[h["logits"]])
        acc = float((logits.argmax(axis=1) == test_y).mean())
        say(f"epoch {epoch}/{args.epochs}  loss {mean_loss:.4f}  held-out accuracy "
            f"{100 * acc:.1f}%")
    seconds = time.perf_counter() - start
    if comm.rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    path = mg.distributed.save(net, Path(args.out) / "digits_sync.npz")   # rank 0 writes
    say(f"trained in {seconds:.1f} s ({seconds / args.epochs:.2f} s per epoch) on {comm.size} "
        f"x {comm.place!r}, threads per rank: {mg.get_num_threads()}; checkpoint {path}")
    return 0


def split_sizes(batch, ranks):
    """Rows per rank for a global batch (np.array_split's sizes)."""
    return [len(a) for a in np.array_split(np.arange(batch), ranks)]


if __name__ == "__main__":
    sys.exit(main())
