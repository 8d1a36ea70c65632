"""Rank script: a data-parallel step where rank 1 holds no rows, through the layer API.

Every rank trains helpers.tiny_bn_net (conv, sync batch norm, relu, fc, mean
cross entropy; Momentum) made data-parallel with batch_size_from="label", and
also, alone, the same net with a plain batch norm on the whole batch. Step 0
gives every rank rows; in steps 1 and 2 rank 1 has none (a (0, 2, 4, 4)
image and a (0,) label). Checked on every rank after every step: the loss
fetched on the empty rank is exactly 0 and the others' losses, weighted by
their rows, give the one-process loss; every parameter and running estimate
equals the one-process training (with 2 ranks: on rank 0's rows alone) and is
bitwise the same on every rank. Prints "OK rank r" when every check passed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/: helpers

from helpers import tiny_bn_net  # noqa: E402

import minigraph as mg  # noqa: E402

STEPS = 3


def rows(size, step, rank):
    """Rows of `rank` at `step`: rank 1 has none after step 0."""
    return 0 if (rank == 1 and step > 0) else 3 + rank


def main():
    comm = mg.distributed.init()
    assert comm.size > 1, "run me under mpiexec -n K (K >= 2)"
    net, loss, _ = tiny_bn_net(sync=True, seed=5, optimizer=mg.optimizer.Momentum(0.1))
    mg.distributed.data_parallel(net, batch_size_from="label")
    ref, ref_loss, _ = tiny_bn_net(sync=False, seed=5, optimizer=mg.optimizer.Momentum(0.1))
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        counts = [rows(comm.size, step, r) for r in range(comm.size)]
        x = rng.standard_normal((sum(counts), 2, 4, 4)).astype(np.float32)
        y = rng.integers(0, 4, sum(counts))
        lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])
        (mine,) = net.train(feed={"image": x[lo:hi], "label": y[lo:hi]}, fetch=[loss])
        (want,) = ref.train(feed={"image": x, "label": y}, fetch=[ref_loss])
        if hi == lo:
            assert np.shape(mine) == () and float(mine) == 0.0, \
                f"step {step}: the loss on a rank with no rows is {mine!r}, not 0"
        total = comm.allreduce(np.array([float(mine) * (hi - lo)]), what="test loss")[0]
        assert abs(total / sum(counts) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), \
            f"step {step}: loss over the ranks {total / sum(counts)} vs one process {want}"
        for var in ref.persistables():
            got, expected = net.var(var.name).get(), var.get()
            if not np.allclose(got, expected, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"step {step} {var.name}: max |diff| "
                                     f"{np.max(np.abs(got - expected))} against one process")
            every = comm.allgather(np.ascontiguousarray(got), what=f"check {var.name}")
            assert all(np.array_equal(every[0], e) for e in every), \
                f"step {step}: {var.name} differs across ranks"
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
