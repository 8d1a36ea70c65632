"""Rank script: the sharded DataLoader with sync batch norm and data_parallel trains
like one process with the whole batch.

Every rank trains helpers.tiny_bn_net (conv, sync batch norm, relu, fc;
Momentum) on 50 rows of (2, 4, 4) images whose label (one of 4) is their
brightest quadrant, for 2 epochs with a global batch of 16 (the last batch
holds 2 rows) from a DataLoader with crop, flip and prefetching, its
gradients averaged (data_parallel, batch_size_from="label"); alongside, the
same net with a plain batch norm trains in this process on the whole batches
of the same loader (shard=False, no prefetching). Checked: each rank's batch is its np.array_split part of the
whole batch, the loss over all ranks equals the one-process loss to 1e-5
relative at every step, and afterwards every persistable does too (relative
to its largest value; c1.b feeds the batch norm, so its velocity is zero up
to rounding and is held to ROUNDING absolute) and is bitwise the same on every
rank.
Prints "OK rank r".
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/: helpers

from helpers import tiny_bn_net  # noqa: E402

import minigraph as mg  # noqa: E402
from minigraph import data  # noqa: E402
from minigraph.data import transforms as T  # noqa: E402

ROWS, BATCH, EPOCHS, SEED = 50, 16, 2, 11
RTOL = 1e-5
ROUNDING = {"momentum_0.c1.b.velocity": 1e-6}


def loader(shard, prefetch):
    rng = np.random.default_rng(5)
    image = rng.uniform(0, 1, (ROWS, 2, 4, 4)).astype(np.float32)
    quadrants = image.reshape(ROWS, 2, 2, 2, 2, 2).sum(axis=(1, 3, 5)).reshape(ROWS, 4)
    ds = data.ArrayDataset(image=image, label=quadrants.argmax(axis=1))
    aug = T.Compose([T.RandomCrop(4, padding=1), T.RandomHorizontalFlip(0.5)])
    return data.DataLoader(ds, BATCH, shuffle=True, seed=SEED, transform=aug,
                           prefetch=prefetch, shard=shard)


def main():
    comm = mg.distributed.init()
    assert comm.size > 1, "run me under mpiexec -n K (K >= 2)"
    net, loss, _ = tiny_bn_net(sync=True, seed=3, optimizer=mg.optimizer.Momentum(0.1))
    mg.distributed.data_parallel(net, batch_size_from="label")
    ref, ref_loss, _ = tiny_bn_net(sync=False, seed=3, optimizer=mg.optimizer.Momentum(0.1))
    mine, whole = loader(True, 2), loader(False, 0)
    assert len(mine) == len(whole) == 4
    steps = 0
    for epoch in range(EPOCHS):
        mine.set_epoch(epoch)
        whole.set_epoch(epoch)
        for feed, full in zip(mine, whole, strict=True):
            part = np.array_split(np.arange(len(full["label"])), comm.size)[comm.rank]
            for name in full:
                assert np.array_equal(feed[name], full[name][part]), \
                    f"epoch {epoch}: rank {comm.rank}'s {name} is not its part of the batch"
            (mine_loss,) = net.train(feed=feed, fetch=[loss])
            (want,) = ref.train(feed=full, fetch=[ref_loss])
            got = comm.allreduce(np.array([float(mine_loss) * len(part)]), what="loss")[0]
            got /= len(full["label"])
            assert abs(got - float(want)) <= RTOL * abs(float(want)), \
                f"epoch {epoch}: loss {got} over the ranks vs {float(want)} in one process"
            steps += 1
    assert steps == EPOCHS * 4
    for var in ref.persistables():
        got, want = net.var(var.name).get(), var.get()
        diff = float(np.max(np.abs(got.astype(np.float64) - want)))
        if var.name in ROUNDING:
            assert diff <= ROUNDING[var.name], f"{var.name}: {diff:.2e} from one process"
        else:
            worst = diff / max(float(np.max(np.abs(want))), 1e-30)
            assert worst <= RTOL, f"{var.name}: {worst:.2e} relative to one-process training"
        every = comm.allgather(np.ascontiguousarray(got), what=f"check {var.name}")
        assert all(np.array_equal(every[0], e) for e in every), \
            f"{var.name} is not bitwise the same on every rank"
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
