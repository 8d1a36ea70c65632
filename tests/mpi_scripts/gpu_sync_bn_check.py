"""Rank script: sync_batch_norm's GPU kernels on K ranks equal the CPU batch_norm
on the concatenated batch.

    mpiexec -n 2 python gpu_sync_bn_check.py --place emulated   # CPU emulator, MPI
    mpiexec -n 2 python gpu_sync_bn_check.py --place gpu        # ranks share GPU 0, MPI
    mpiexec -n 1 python gpu_sync_bn_check.py --place gpu --backend nccl

Every rank builds the same full batches from fixed seeds, runs
sync_batch_norm on its own rows on its GPU place (the kernel emulator's
EmuPlace, or GPUPlace(local_rank % devices)) and a one-process CPU
batch_norm on all rows, and compares: y, dx slices; batch statistics,
estimates, counter, dscale, dbias over several steps (first batch, momentum,
cumulative average); uneven rows, a rank with no rows; NCHW, NHWC and rank
2; float32 and float64; offset data (mean 1e4); exactly one collective of
8·(2C+1) bytes per forward (allreduce_stats: a Chan merge) and per backward
(allreduce), none in the infer copy;
estimates bitwise identical on every rank; n == 1 over all ranks is the
CPU's error. With --backend mpi the device vectors are staged through the
host; with nccl they are reduced on the device. In a world of one, the
synchronized path (batch_norm's GPU binding with the communicator's
allreduce) is checked against batch_norm too.
Prints "OK rank r" when every check passed; any failure raises (and aborts the job).
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

import numpy as np

import minigraph as mg
from minigraph.schema import OpError

TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from helpers import tiny_bn_net  # noqa: E402


class BN:
    """One batch-norm op (sync or not) on `place`, its infer copy and its grad op,
    on persistables of its own; values go in and come out as numpy arrays."""

    def __init__(self, place, op_type, channels, dtype, layout="NCHW", momentum=0.9,
                 counter=True, seed=1, first_batch=True):
        self.place = place
        self.scope = s = mg.Scope()
        rng = np.random.default_rng(seed)

        def var(name, value=None, persistable=False):
            v = s.new_var(name, persistable=persistable)
            if value is not None:
                v.set(place.to_device(value))
            return v

        self.mean = var("mean", rng.normal(0, 1, channels).astype(dtype), True)
        self.var = var("var", rng.uniform(0.5, 2, channels).astype(dtype), True)
        self.scale = var("scale", rng.uniform(0.5, 1.5, channels).astype(dtype), True)
        self.bias = var("bias", rng.normal(0, 1, channels).astype(dtype), True)
        self.counter = var("num_batches", np.array(0, np.int64), True) if counter else None
        self.x, self.dy = var("x"), var("dy")
        self.y, self.bm, self.bv = var("y"), var("batch_mean"), var("batch_var")
        self.dx, self.dscale, self.dbias = var("dx"), var("dscale"), var("dbias")
        common = dict(x=self.x, estimated_mean=self.mean, estimated_var=self.var,
                      scale=self.scale, bias=self.bias, y=self.y, saved_mean=self.mean,
                      saved_var=self.var, momentum=momentum, data_layout=layout,
                      first_batch_sets_estimates=first_batch)
        if counter:
            common.update(num_batches=self.counter, saved_num_batches=self.counter)
        self.train_op = mg.Operator(op_type, batch_mean=self.bm, batch_var=self.bv, **common)
        self.infer_op = mg.Operator(op_type, batch_mean=var("infer_mean"),
                                    batch_var=var("infer_var"), is_infer=True, **common)
        self.grad_op = mg.Operator(op_type + "_grad", x=self.x, scale=self.scale, mean=self.bm,
                                   var=self.bv, dy=self.dy, dx=self.dx, dscale=self.dscale,
                                   dbias=self.dbias, data_layout=layout)
        self.ex = mg.Executor(place)

    def estimates(self):
        """The estimates and the counter, read without checking device errors."""
        out = {"mean": self.mean.get().copy(), "var": self.var.get().copy()}
        if self.counter is not None:
            out["counter"] = self.counter.get().copy()
        return out

    def step(self, x, dy=None, fetch=True):
        """One training forward (and backward with dy); the results as numpy
        arrays, fetched (so device errors raise) unless fetch=False."""
        self.x.set(self.place.to_device(x))
        ops = [self.train_op]
        if dy is not None:
            self.dy.set(self.place.to_device(dy))
            ops.append(self.grad_op)
        if not fetch:
            self.ex.run(ops, self.scope)
            return None
        names = ("y", "bm", "bv") + (("dx", "dscale", "dbias") if dy is not None else ())
        values = self.ex.run(ops, self.scope, fetch=[getattr(self, k) for k in names])
        out = {k: v.copy() for k, v in zip(names, values, strict=True)}
        out.update(self.estimates())
        return out

    def infer(self, x):
        self.x.set(self.place.to_device(x))
        (y,) = self.ex.run([self.infer_op], self.scope, fetch=[self.y])
        return y


def close(name, got, want, rtol, atol):
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
        err = np.max(np.abs(got - want)) if got.shape == want.shape and got.size else "shape"
        raise AssertionError(f"{name}: differs from the CPU batch_norm (max error {err}, "
                             f"shapes {got.shape} vs {want.shape})")


def row_counts(size, with_empty):
    """Uneven rows per rank; rank 1 has none when with_empty."""
    counts = [r % 3 + 2 + r for r in range(size)]
    if with_empty and size > 1:
        counts[1] = 0
    return counts


def run_case(comm, place, tag, shape_of, layout, dtype, with_empty, momentum, steps, rtol, atol,
             offset=0.0):
    channels = shape_of(1)[1] if layout == "NCHW" else shape_of(1)[-1]
    counts = row_counts(comm.size, with_empty)
    lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])
    sync = BN(place, "sync_batch_norm", channels, dtype, layout, momentum)
    single = BN(mg.CPUPlace(), "batch_norm", channels, dtype, layout, momentum)
    rng = np.random.default_rng(1234)
    for step in range(steps):
        full = (rng.standard_normal(shape_of(sum(counts))) * 2.0 + offset).astype(dtype)
        dy = rng.standard_normal(full.shape).astype(dtype)
        kinds = ("allreduce_stats", "allreduce")       # forward (Chan merge), backward (sum)
        before = [list(comm.stats.get(k, [0, 0])) for k in kinds]
        got = sync.step(full[lo:hi], dy[lo:hi])
        want_calls = 1 if comm.size > 1 else 0
        for k, (calls0, sent0) in zip(kinds, before, strict=True):
            calls, sent = (a - b for a, b in zip(comm.stats.get(k, [0, 0]), (calls0, sent0)))
            assert calls == want_calls, f"{tag}: {calls} {k} calls for a forward + backward"
            assert sent == want_calls * 8 * (2 * channels + 1), f"{tag}: {k} sent {sent} bytes"
        want = single.step(full, dy)
        for k in ("y", "dx"):
            close(f"{tag} step {step} {k}", got[k], want[k][lo:hi], rtol, atol)
        for k in ("bm", "bv", "mean", "var", "dscale", "dbias"):
            close(f"{tag} step {step} {k}", got[k], want[k], rtol, atol)
        assert got["counter"] == want["counter"], f"{tag}: counter"
        same_on_every_rank(comm, f"{tag} estimates", *sync.estimates().values())
    before = comm.calls
    y = sync.infer(full[lo:hi])
    assert comm.calls == before, f"{tag}: the infer copy communicated"
    close(f"{tag} infer y", y, single.infer(full)[lo:hi], rtol, atol)


def same_on_every_rank(comm, tag, *arrays):
    for a in arrays:
        every = comm.allgather(np.ascontiguousarray(a), what=f"check {tag}")
        if not all(np.array_equal(every[0], e) for e in every):
            raise AssertionError(f"{tag}: not bitwise identical across ranks: {every}")


def check_global_n_is_one(comm, place):
    """One value per channel in the whole world: the CPU's error on every rank,
    and nothing updated."""
    sync = BN(place, "sync_batch_norm", 4, np.float64)
    before = sync.estimates()
    rows = 1 if comm.rank == comm.size - 1 else 0
    try:
        sync.step(np.ones((rows, 4)))
    except OpError as e:
        assert "sync_batch_norm: training needs more than one value per channel, got n=1 " \
               f"for input 'x' of shape ({rows}, 4) (NCHW)" in str(e), str(e)
    else:
        raise AssertionError("n == 1 over all ranks did not raise")
    for k, v in sync.estimates().items():
        assert np.array_equal(v, before[k]), f"n == 1 changed {k}"


def check_synced_path_in_a_world_of_one(comm, place):
    """batch_norm's GPU forward and grad with the communicator's collectives (the
    path sync_batch_norm takes on several ranks: one allreduce_stats forward, one
    allreduce backward) equal plain batch_norm, in one process."""
    from minigraph.kernels.cuda import batch_norm_op as bn

    def run(op, fn, collective):
        ins = {slot: None if v is None else v.value for slot, v in op.inputs.items()}
        for slot, value in fn(op, ins, allreduce=collective).items():
            if op.outputs.get(slot) is not None:
                op.outputs[slot].value = value

    rng = np.random.default_rng(5)
    plain = BN(place, "batch_norm", 3, np.float32)
    synced = BN(place, "batch_norm", 3, np.float32)
    names = ("y", "bm", "bv", "dx", "dscale", "dbias")
    for step in range(2):
        x = rng.normal(3, 2, (5, 3, 4, 6)).astype(np.float32)
        dy = rng.standard_normal(x.shape).astype(np.float32)
        want = plain.step(x, dy)
        before = {k: comm.stats.get(k, [0, 0])[0] for k in ("allreduce_stats", "allreduce")}
        synced.x.set(place.to_device(x))
        synced.dy.set(place.to_device(dy))
        run(synced.train_op, bn.forward_gpu, bn.device_stats_merge(comm, "world of one"))
        run(synced.grad_op, bn.backward_gpu, bn.device_allreduce(comm, "world of one"))
        calls = {k: comm.stats.get(k, [0, 0])[0] - n for k, n in before.items()}
        assert calls == {"allreduce_stats": 1, "allreduce": 1}, f"world of one: {calls}"
        values = synced.ex.run([], synced.scope, fetch=[getattr(synced, k) for k in names])
        got = dict(zip(names, values, strict=True), **synced.estimates())
        for k in want:
            close(f"world of one step {step}: {k}", got[k], want[k], 1e-5, 1e-6)


def check_data_parallel(comm, place, steps=3):
    """A small conv net with sync batch norm, trained data-parallel on this
    rank's uneven share of each batch (gradients averaged on the place by the
    collective ops), equals one CPU process training with batch_norm on the
    whole batch: losses every step, every parameter and estimate at the end."""

    counts = [3 + 2 * r for r in range(comm.size)]
    lo, hi = sum(counts[:comm.rank]), sum(counts[:comm.rank + 1])

    def build(where, sync):
        net, loss, _ = tiny_bn_net(sync, place=where, seed=3,
                                   optimizer=mg.optimizer.Momentum(0.1))
        return net, loss

    net, loss = build(place, True)
    mg.distributed.data_parallel(net, batch_size_from="label")
    ref, ref_loss = build(mg.CPUPlace(), False)
    rng = np.random.default_rng(11)
    for step in range(steps):
        x = rng.standard_normal((sum(counts), 2, 4, 4)).astype(np.float32)
        y = rng.integers(0, 4, sum(counts)).astype(np.int64)
        (mine,) = net.train(feed={"image": x[lo:hi], "label": y[lo:hi]}, fetch=[loss])
        (want,) = ref.train(feed={"image": x, "label": y}, fetch=[ref_loss])
        total = comm.allreduce(np.array([float(mine) * (hi - lo)]), what="check loss")[0]
        close(f"data parallel step {step} loss", np.array(total / sum(counts)),
              np.array(float(want)), 1e-5, 1e-6)
    for var in ref.persistables():
        close(f"data parallel {var.name}", net.var(var.name).get(), var.get(), 1e-4, 1e-5)
        same_on_every_rank(comm, var.name, net.var(var.name).get())


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--place", choices=("emulated", "gpu"), default="emulated")
    parser.add_argument("--backend", choices=("mpi", "nccl"), default="mpi")
    args = parser.parse_args(argv)
    if args.place == "emulated":
        import kernel_emulator

        context = kernel_emulator.emulated_gpu()          # yields an EmuPlace
    else:
        context = contextlib.nullcontext("gpu")
    with context as where:
        comm = mg.distributed.init(backend=args.backend, place=where)
        place = comm.place
        f64 = dict(rtol=1e-9, atol=1e-10)
        f32 = dict(rtol=1e-4, atol=2e-5)
        nchw = lambda n: (n, 3, 4, 5)          # noqa: E731
        for with_empty in (False, True):
            run_case(comm, place, f"{'empty rank' if with_empty else 'uneven'} float64 NCHW",
                     nchw, "NCHW", np.float64, with_empty, 0.9, 3, **f64)
        run_case(comm, place, "float32 NCHW cumulative", nchw, "NCHW", np.float32, True, None, 3,
                 **f32)
        run_case(comm, place, "float32 NHWC", lambda n: (n, 2, 3, 4), "NHWC", np.float32, False,
                 0.8, 2, **f32)
        run_case(comm, place, "float64 rank 2", lambda n: (n, 6), "NCHW", np.float64, True, 0.9,
                 2, **f64)
        run_case(comm, place, "float32 offset 1e4", lambda n: (n, 2, 5, 7), "NCHW", np.float32,
                 True, 0.9, 2, rtol=1e-3, atol=2e-3, offset=1e4)
        check_data_parallel(comm, place)
        if comm.size > 1:
            check_global_n_is_one(comm, place)
        else:
            check_synced_path_in_a_world_of_one(comm, place)
        print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
