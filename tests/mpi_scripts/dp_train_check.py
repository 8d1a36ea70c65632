"""Rank script: data-parallel training of the digits net equals one-process training.

K ranks train the digits net (sync batch norm, momentum SGD) on their slices
of each batch; every rank also trains the same net in one process on the
whole batch. The per-step loss over the whole batch and every parameter
after the last step must agree within float32 tolerance, and every rank
must end with bitwise the same persistables.

Five runs: "equal" (the same rows on every rank; plain gradient averaging),
"uneven" (different rows per rank; data_parallel(batch_size_from="label")),
"merge" (GradientMerge(k=2) around the momentum optimizer on both sides: two
micro-batches per update, averaged over the ranks on the update steps only),
"merge_sum" (GradientMerge(k=2, avg=False): the merged sums themselves are
averaged over the ranks, in the update section) and "merge_k1"
(GradientMerge(k_steps=1): the same on every step).
argv[1], optional: an .npz with the training images and labels (x, y), so
that the ranks need not import scikit-learn; by default load_digits_split().
Prints "OK rank r" when every check passed.
"""
from __future__ import annotations

import sys

import numpy as np

import minigraph as mg
from minigraph.examples.train_digits import build_net, load_digits_split

STEPS = 4


def rows_per_rank(size, mode):
    if mode in ("equal", "merge", "merge_sum", "merge_k1"):
        return [6] * size
    return [3 + 2 * r for r in range(size)]


def load(path):
    if path is None:
        train_x, train_y, _, _ = load_digits_split()
    else:
        with np.load(path) as data:
            train_x, train_y = data["x"], data["y"]
    # The digits take 17 grey levels, so many max-pool windows hold values that
    # tie exactly in exact arithmetic; which one wins then depends on rounding
    # (and differs between a batch and its slices), which would route gradients
    # differently. A little fixed noise breaks those ties.
    jitter = np.random.default_rng(42).uniform(0.0, 0.05, train_x.shape)
    return (train_x + jitter).astype(np.float32), train_y


def check(comm, mode, train_x, train_y):
    counts = rows_per_rank(comm.size, mode)
    lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])
    batch = sum(counts)

    def optimizer():
        inner = mg.optimizer.Momentum(learning_rate=0.05, momentum=0.9)
        merges = {"merge": dict(k_steps=2), "merge_sum": dict(k_steps=2, avg=False),
                  "merge_k1": dict(k_steps=1)}
        return mg.optimizer.GradientMerge(inner, **merges[mode]) if mode in merges else inner

    net, h = build_net(seed=3, optimizer=optimizer())
    # 2 batch norms x (train + infer copy) + their 2 grad ops
    assert mg.distributed.convert_sync_batchnorm(net) == 6
    mg.distributed.data_parallel(net, batch_size_from="label" if mode == "uneven" else None)
    ref, rh = build_net(seed=3, optimizer=optimizer())          # one process, whole batch

    rng = np.random.default_rng(0)
    for step in range(STEPS):
        idx = rng.choice(len(train_x), batch, replace=False)
        x, y = train_x[idx], train_y[idx]
        (local_loss,) = net.train(feed={"image": x[lo:hi], "label": y[lo:hi]},
                                  fetch=[h["loss"]])
        (want,) = ref.train(feed={"image": x, "label": y}, fetch=[rh["loss"]])
        weighted = np.array([float(local_loss) * (hi - lo)])
        got = comm.allreduce(weighted, what="test loss")[0] / batch
        assert abs(got - float(want)) <= 1e-5 * max(1.0, abs(float(want))), \
            f"{mode} step {step}: loss over all ranks {got} vs one process {float(want)}"
    for var in ref.persistables():
        mine = net.var(var.name).get()
        want = var.get()
        if not np.allclose(mine, want, rtol=1e-4, atol=2e-6):
            raise AssertionError(f"{mode} {var.name}: max |diff| {np.max(np.abs(mine - want))} "
                                 "against one-process training")
        every = comm.allgather(np.ascontiguousarray(mine), what=f"check {var.name}")
        assert all(np.array_equal(every[0], e) for e in every), \
            f"{mode}: {var.name} is not bitwise identical on every rank"
    # predictions of the infer branch agree too (no communication there)
    (logits,) = net.infer(feed={"image": train_x[:16]}, fetch=[h["logits"]])
    (want,) = ref.infer(feed={"image": train_x[:16]}, fetch=[rh["logits"]])
    assert np.allclose(logits, want, rtol=1e-4, atol=1e-4), f"{mode}: infer logits differ"


def main(path=None):
    comm = mg.distributed.init()
    train_x, train_y = load(path)
    for mode in ("equal", "uneven", "merge", "merge_sum", "merge_k1"):
        check(comm, mode, train_x, train_y)
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
