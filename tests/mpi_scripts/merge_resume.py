"""Rank script: a data-parallel GradientMerge run checkpointed mid-accumulation resumes
exactly.

Every rank trains helpers.tiny_bn_net (sync batch norm, Momentum) under
GradientMerge(k=3, avg=argv[2] == "avg") with data_parallel, its own rows of
each global batch (uneven: batch_size_from="label"), for STOP steps (the
middle of an accumulation), then:
  * mg.io.save on one rank is refused (each rank holds its own merged sums),
    naming mg.distributed.save; no file is written;
  * mg.distributed.save(net, argv[1]/ckpt.npz) averages the merged gradients
    over the ranks (every rank then holds the same sums) and rank 0 writes;
    the run goes on to STEPS ("saved").
A new net (another seed) loads the file on rank 0 only, broadcast_persistables
(after which every rank holds the file's sums, and mg.io.save may write them),
and trains the same steps ("resumed"): every persistable equals the saved
run's bit for bit. A run that never saved ("straight") equals them to
float32 rounding. One process on the whole batches (no data_parallel, plain
batch norm) resumed from the same file ends there too (1e-4).
Prints "OK rank r".
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/: helpers

from helpers import tiny_bn_net  # noqa: E402

import minigraph as mg  # noqa: E402

K, STOP, STEPS = 3, 2, 9


def batches(size):
    """STEPS global batches and each rank's (lo, hi) rows of them (3, 4, 5, ... rows)."""
    counts = [3 + r for r in range(size)]
    edges = np.cumsum([0] + counts)
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        image = rng.standard_normal((edges[-1], 2, 4, 4)).astype(np.float32)
        out.append({"image": image, "label": rng.integers(0, 4, edges[-1])})
    return out, list(zip(edges[:-1], edges[1:]))


def build(avg, seed, parallel=True):
    merge = mg.optimizer.GradientMerge(mg.optimizer.Momentum(0.1), K, avg=avg)
    net, _, _ = tiny_bn_net(sync=parallel, seed=seed, optimizer=merge)
    if parallel:
        mg.distributed.data_parallel(net, batch_size_from="label")
    return net


def train(net, feeds, rows, steps):
    lo, hi = rows
    for step in steps:
        net.train(feed={k: v[lo:hi] for k, v in feeds[step].items()})


def state(net):
    return {v.name: v.get() for v in net.persistables()}


def main(folder, avg):
    comm = mg.distributed.init()
    feeds, parts = batches(comm.size)
    rows = parts[comm.rank]
    ckpt = Path(folder) / "ckpt.npz"

    saved = build(avg, seed=3)
    train(saved, feeds, rows, range(STOP))
    mine = Path(folder) / f"rank{comm.rank}.npz"
    try:
        mg.io.save(saved, mine)
    except ValueError as e:
        assert "GradientMerge accumulation" in str(e) and "mg.distributed.save" in str(e), e
        assert str(mine) in str(e), e
    else:
        raise AssertionError("io.save of per-rank merged gradients was not refused")
    assert not mine.exists()
    sums = {v.name: v.get() for v in saved.optimizer.merged}
    assert any(np.any(s != 0) for s in sums.values())
    mg.distributed.save(saved, ckpt)
    for v in saved.optimizer.merged:                   # averaged: the same on every rank
        every = comm.allgather(np.ascontiguousarray(v.get()), what=f"check {v.name}")
        assert all(np.array_equal(every[0], e) for e in every), v.name
        total = comm.allreduce(sums[v.name].astype(np.float64), what=f"sum {v.name}")
        np.testing.assert_allclose(v.get(), total / comm.size, rtol=1e-5, atol=1e-7)
    train(saved, feeds, rows, range(STOP, STEPS))

    resumed = build(avg, seed=4)
    if comm.rank == 0:
        mg.io.load(resumed, ckpt)
    mg.distributed.broadcast_persistables(resumed)
    mg.io.save(resumed, mine)               # every rank holds the file's sums: allowed
    again, first = mg.io.read_checkpoint(mine), mg.io.read_checkpoint(ckpt)
    assert all(np.array_equal(again[name], value) for name, value in first.items())
    train(resumed, feeds, rows, range(STOP, STEPS))

    straight = build(avg, seed=3)
    train(straight, feeds, rows, range(STEPS))

    alone = build(avg, seed=5, parallel=False)
    mg.io.load(alone, ckpt)
    train(alone, feeds, (0, None), range(STOP, STEPS))

    want, got = state(saved), state(resumed)
    for name, value in want.items():
        assert np.array_equal(got[name], value), \
            f"{name}: resumed differs from the saved run by {np.max(np.abs(got[name] - value))}"
    for other, tol in ((straight, 2e-6), (alone, 1e-4)):
        for name, value in state(other).items():
            scale = max(1.0, float(np.max(np.abs(want[name]))))
            np.testing.assert_allclose(value, want[name], rtol=0, atol=tol * scale,
                                       err_msg=name)
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "avg")
