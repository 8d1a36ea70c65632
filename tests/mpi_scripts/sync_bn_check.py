"""Rank script: sync_batch_norm on K ranks equals batch_norm on the concatenated batch.

Every rank builds the same full batches from fixed seeds, runs sync_batch_norm
on its own rows and a one-process batch_norm on all rows, and compares:
forward y slice, batch statistics, estimates and counter over several steps;
backward dx slice, dscale and dbias; offset data (mean 1e4 in float32; mean
1e6 in float64: the variance to 1e-6 relative); NHWC and rank-2 inputs; a
rank with zero rows; n == 1 judged on the global count; one collective of O(C)
float64 per forward (allreduce_stats) and per backward (allreduce), and one order
check per step (the step announces its collective); no communication in the infer
copy; estimates bitwise identical on every rank. The same for sync_batch_norm_relu
against batch_norm_relu, and for a grad op with average_ranks (dscale and dbias
divided by the world size in the kernel).
Prints "OK rank r" when every check passed; any failure raises (and aborts the job).
"""
from __future__ import annotations

import numpy as np

import minigraph as mg
from minigraph.schema import OpError


def row_counts(size, with_empty):
    """Uneven rows per rank; rank 1 has none when with_empty."""
    counts = [r % 3 + 2 + r for r in range(size)]
    if with_empty:
        counts[1] = 0
    return counts


class BN:
    """One batch-norm op (sync or not) and its grad op on persistables of its own."""

    def __init__(self, op_type, channels, dtype, layout="NCHW", momentum=0.9, first_batch=True,
                 average_ranks=False):
        self.scope = s = mg.Scope()
        self.op_type = op_type

        def var(name, value=None, persistable=False):
            v = s.new_var(name, persistable=persistable)
            if value is not None:
                v.set(value)
            return v

        self.mean = var("mean", np.zeros(channels, dtype), True)
        self.var = var("var", np.ones(channels, dtype), True)
        self.scale = var("scale", np.linspace(0.5, 1.5, channels).astype(dtype), True)
        self.bias = var("bias", np.linspace(-1, 1, channels).astype(dtype), True)
        self.counter = var("num_batches", np.array(0, np.int64), True)
        self.x, self.dy = var("x"), var("dy")
        self.y, self.bm, self.bv = var("y"), var("batch_mean"), var("batch_var")
        self.dx, self.dscale, self.dbias = var("dx"), var("dscale"), var("dbias")
        common = dict(x=self.x, estimated_mean=self.mean, estimated_var=self.var,
                      scale=self.scale, bias=self.bias, num_batches=self.counter,
                      y=self.y, saved_mean=self.mean, saved_var=self.var,
                      saved_num_batches=self.counter, momentum=momentum, data_layout=layout,
                      first_batch_sets_estimates=first_batch)
        self.train_op = mg.Operator(op_type, batch_mean=self.bm, batch_var=self.bv, **common)
        self.infer_op = mg.Operator(op_type, batch_mean=var("infer_mean"),
                                    batch_var=var("infer_var"), is_infer=True, **common)
        extra = {"y": self.y} if op_type.endswith("_relu") else {}
        if average_ranks:
            extra["average_ranks"] = True
        self.grad_op = mg.Operator(op_type + "_grad", x=self.x, scale=self.scale, mean=self.bm,
                                   var=self.bv, dy=self.dy, dx=self.dx, dscale=self.dscale,
                                   dbias=self.dbias, data_layout=layout, **extra)
        self.ex = mg.Executor()

    def step(self, x, dy=None):
        self.x.set(x)
        self.ex.run([self.train_op], self.scope)
        out = {k: getattr(self, k).get().copy() for k in
               ("y", "bm", "bv", "mean", "var", "counter")}
        if dy is not None:
            self.dy.set(dy)
            self.ex.run([self.grad_op], self.scope)
            out.update({k: getattr(self, k).get().copy() for k in ("dx", "dscale", "dbias")})
        return out

    def infer(self, x):
        self.x.set(x)
        self.ex.run([self.infer_op], self.scope)
        return self.y.get().copy()


def close(name, got, want, rtol, atol):
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
        err = np.max(np.abs(got - want)) if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: differs from one-process batch_norm (max error {err}, "
                             f"shapes {got.shape} vs {want.shape})")


def compare(tag, got, want, lo, hi, rtol, atol, stats_rtol=None):
    sr = stats_rtol or rtol
    close(f"{tag} y", got["y"], want["y"][lo:hi], rtol, atol)
    for k in ("bm", "bv", "mean", "var"):
        close(f"{tag} {k}", got[k], want[k], sr, atol)
    assert got["counter"] == want["counter"], f"{tag}: counter {got['counter']} vs {want['counter']}"
    if "dx" in want:
        close(f"{tag} dx", got["dx"], want["dx"][lo:hi], rtol, atol)
        close(f"{tag} dscale", got["dscale"], want["dscale"], rtol, atol)
        close(f"{tag} dbias", got["dbias"], want["dbias"], rtol, atol)


def same_on_every_rank(comm, tag, *arrays):
    for a in arrays:
        every = comm.allgather(np.ascontiguousarray(a), what=f"check {tag}")
        if not all(np.array_equal(every[0], e) for e in every):
            raise AssertionError(f"{tag}: not bitwise identical across ranks: {every}")


def run_case(comm, tag, shape_of, layout, dtype, with_empty, steps, rtol, atol,
             offset=0.0, stats_rtol=None, first_batch=True, relu=False, average_ranks=False):
    channels = shape_of(1)[1] if layout == "NCHW" else shape_of(1)[-1]
    counts = row_counts(comm.size, with_empty)
    lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])
    kind = "batch_norm_relu" if relu else "batch_norm"
    sync = BN("sync_" + kind, channels, dtype, layout, first_batch=first_batch,
              average_ranks=average_ranks)
    single = BN(kind, channels, dtype, layout, first_batch=first_batch)
    rng = np.random.default_rng(1234)
    for step in range(steps):
        full = (rng.standard_normal(shape_of(sum(counts))) * 2.0 + offset).astype(dtype)
        dy = rng.standard_normal(full.shape).astype(dtype)
        before = {k: list(v) for k, v in comm.stats.items()}
        checks = comm.order_checks
        got = sync.step(full[lo:hi], dy[lo:hi])
        assert comm.order_checks - checks == 2, f"{tag}: {comm.order_checks - checks} order " \
                                                "checks for a forward and a backward step"
        for kind in ("allreduce_stats", "allreduce"):     # forward (Chan merge), backward
            calls = comm.stats[kind][0] - before.get(kind, [0, 0])[0]
            sent = comm.stats[kind][1] - before.get(kind, [0, 0])[1]
            assert calls == 1, f"{tag}: {calls} {kind} calls for one forward + backward"
            assert sent == 8 * (2 * channels + 1), f"{tag}: {kind} sent {sent} bytes, not O(C)"
        want = single.step(full, dy)
        if average_ranks:
            want["dscale"], want["dbias"] = want["dscale"] / comm.size, want["dbias"] / comm.size
        compare(f"{tag} step {step}", got, want, lo, hi, rtol, atol, stats_rtol)
        same_on_every_rank(comm, f"{tag} estimates", sync.mean.get(), sync.var.get(),
                           sync.counter.get())
    before = comm.stats["allreduce"][0]
    y_inf = sync.infer(full[lo:hi])
    assert comm.stats["allreduce"][0] == before, f"{tag}: the infer copy communicated"
    close(f"{tag} infer y", y_inf, single.infer(full)[lo:hi], rtol, atol)


def check_offset(comm):
    """Float32 data with mean 1e4 and std 1: the global variance to 1e-3 relative."""
    counts = row_counts(comm.size, with_empty=True)
    lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])
    rng = np.random.default_rng(7)
    full = (1e4 + rng.standard_normal((sum(counts), 3, 5, 5))).astype(np.float32)
    truth = full.astype(np.float64)
    want_var = truth.var(axis=(0, 2, 3))
    sync = BN("sync_batch_norm", 3, np.float32)
    got = sync.step(full[lo:hi])
    rel = np.max(np.abs(got["bv"] - want_var) / want_var)
    assert rel < 1e-3, f"offset data: variance relative error {rel}"
    assert np.allclose(got["bm"], truth.mean(axis=(0, 2, 3)), rtol=1e-6), "offset data: mean"
    single = BN("batch_norm", 3, np.float32).step(full)
    close("offset y", got["y"], single["y"][lo:hi], 1e-3, 2e-3)


def check_offset_1e6(comm):
    """float64 data with |mean|/std = 1e6: the global variance to 1e-6 relative and
    the same bits on every rank. Merging (n, mean, M2) with Chan's formula keeps
    it; the old S2 - mean * S1 of summed moments loses ~1e-16 * 1e12 = 1e-4."""
    counts = row_counts(comm.size, with_empty=True)
    lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])
    rng = np.random.default_rng(11)
    full = 1e6 + rng.standard_normal((sum(counts), 3, 4, 4)) * np.array([1.0, 0.5, 2.0])[
        None, :, None, None]
    centred = full - full.mean(axis=(0, 2, 3), keepdims=True)
    want_var = (centred * centred).mean(axis=(0, 2, 3))
    sync = BN("sync_batch_norm", 3, np.float64)
    got = sync.step(full[lo:hi])
    rel = np.max(np.abs(got["bv"] - want_var) / want_var)
    assert rel < 1e-6, f"offset 1e6: variance relative error {rel}"
    same_on_every_rank(comm, "offset 1e6 statistics", got["bm"], got["bv"], sync.var.get())


def check_global_n_is_one(comm):
    """One value per channel in the whole world is an error on every rank alike."""
    sync = BN("sync_batch_norm", 4, np.float64)
    rows = 1 if comm.rank == comm.size - 1 else 0
    x = np.ones((rows, 4))
    try:
        sync.step(x)
    except OpError as e:
        assert "n=1" in str(e), str(e)
    else:
        raise AssertionError("n == 1 over all ranks did not raise")
    # ...but one row on each of two ranks is fine (n == 2 globally)
    x = np.full((1 if comm.rank < 2 else 0, 4), float(comm.rank))
    got = sync.step(x)
    assert np.allclose(got["bm"], 0.5) and np.allclose(got["bv"], 0.25), got


def check_every_rank_empty(comm):
    """An empty batch on every rank: empty outputs, and nothing written anywhere."""
    sync = BN("sync_batch_norm", 3, np.float64)
    kept = sync.mean.get().copy(), sync.var.get().copy()
    got = sync.step(np.zeros((0, 3, 2, 2)), np.zeros((0, 3, 2, 2)))
    assert got["y"].shape == (0, 3, 2, 2) and got["dx"].shape == (0, 3, 2, 2), got["y"].shape
    assert np.array_equal(sync.mean.get(), kept[0]) and np.array_equal(sync.var.get(), kept[1])
    assert int(sync.counter.get()) == 0 and not got["dscale"].any() and not got["dbias"].any()


def main():
    comm = mg.distributed.init()
    assert comm.size > 1, "run me under mpiexec -n K (K >= 2)"
    nchw = lambda n: (n, 3, 4, 5)          # noqa: E731
    for with_empty in (False, True):
        tag = "empty rank" if with_empty else "uneven"
        run_case(comm, f"{tag} float64 NCHW", nchw, "NCHW", np.float64, with_empty, steps=3,
                 rtol=1e-9, atol=1e-10)
    run_case(comm, "float32 NCHW", nchw, "NCHW", np.float32, True, steps=3,
             rtol=1e-4, atol=1e-5)
    run_case(comm, "float64 NHWC", lambda n: (n, 2, 3, 4), "NHWC", np.float64, True, steps=2,
             rtol=1e-9, atol=1e-10)
    run_case(comm, "float64 rank 2", lambda n: (n, 6), "NCHW", np.float64, True, steps=2,
             rtol=1e-9, atol=1e-10)
    run_case(comm, "PyTorch's rule float64 NCHW", nchw, "NCHW", np.float64, True, steps=3,
             rtol=1e-9, atol=1e-10, first_batch=False)
    run_case(comm, "relu float64 NCHW", nchw, "NCHW", np.float64, True, steps=2, rtol=1e-9,
             atol=1e-10, relu=True)
    run_case(comm, "relu float32 NHWC averaged", lambda n: (n, 2, 3, 4), "NHWC", np.float32,
             False, steps=2, rtol=1e-4, atol=1e-5, relu=True, average_ranks=True)
    check_offset(comm)
    check_offset_1e6(comm)
    check_global_n_is_one(comm)
    check_every_rank_empty(comm)
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
