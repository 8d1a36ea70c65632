"""sync_batch_norm on K CPU ranks (MPI): step time, collectives, message sizes.

    python benchmarks/sync_bn.py [--ranks 1 2 4] [--shape 16 64 16 16] [--repeat 30]

Launches itself with `mpiexec -n K` (the mpiexec next to the interpreter)
for each K. Every rank holds a batch of the given per-rank shape (weak
scaling: the global batch grows with K). It reports, from rank 0:

  * the median time of one training step of the op, forward + grad op,
    through Executor.run: plain batch_norm (local statistics, no
    communication) against sync_batch_norm (statistics of all ranks);
  * the collectives one sync step makes and the bytes in each (counted by
    the communicator);
  * the two collectives timed alone at C channels and at 16x C: ours, one
    allreduce of (n, n·mean, M2 + n·mean²) in float64 - 8·(2C+1) bytes
    whatever K is - against the forward of PyTorch's SyncBatchNorm, which
    all-gathers (mean, invstd, count) from every rank: each rank sends
    4·(2C+1) bytes and receives K times that (O(K·C)), timed here with an
    mpi4py Allgather of the same sizes in the same run.

Ranks beyond the number of cores share cores (mpich runs oversubscribed),
so on a small machine the K=4 times include that contention.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--shape", type=int, nargs=4, default=[16, 64, 16, 16],
                   metavar=("N", "C", "H", "W"), help="per-rank NCHW input (default 16 64 16 16)")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank -------------------------------------------------------------------------

def bn_step(op_type, x, dy):
    """(run(), comm-free setup): one forward + grad step of `op_type` on x."""
    import minigraph as mg

    scope = mg.Scope()
    c = x.shape[1]

    def var(name, value=None, persistable=False):
        v = scope.new_var(name, persistable=persistable)
        if value is not None:
            v.set(value)
        return v

    mean, variance = var("mean", np.zeros(c, x.dtype), True), var("var", np.ones(c, x.dtype), True)
    count = var("num_batches", np.array(0, np.int64), True)
    scale, bias = var("scale", np.ones(c, x.dtype), True), var("bias", np.zeros(c, x.dtype), True)
    xv, dyv, bm, bv = var("x", x), var("dy", dy), var("batch_mean"), var("batch_var")
    fwd = mg.Operator(op_type, x=xv, estimated_mean=mean, estimated_var=variance, scale=scale,
                      bias=bias, num_batches=count, y=var("y"), batch_mean=bm, batch_var=bv,
                      saved_mean=mean, saved_var=variance, saved_num_batches=count)
    grad = mg.Operator(op_type + "_grad", x=xv, scale=scale, mean=bm, var=bv, dy=dyv,
                       dx=var("dx"), dscale=var("dscale"), dbias=var("dbias"))
    ex = mg.Executor()
    return lambda: ex.run([fwd, grad], scope)


def timed(comm, fn, repeat, warmup=3):
    """(median, best) seconds of fn() over `repeat` calls, the ranks starting
    together; the slowest rank's values (its step is the job's step)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        comm.mpi_comm.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    every = comm.allgather(np.array([statistics.median(times), min(times)]), what="timings")
    return float(every[:, 0].max()), float(every[:, 1].max())


def worker(args):
    import minigraph as mg

    comm = mg.distributed.init(backend="mpi")
    n, c, h, w = args.shape
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    plain = timed(comm, bn_step("batch_norm", x, dy), args.repeat)
    sync_step = bn_step("sync_batch_norm", x, dy)
    sync = timed(comm, sync_step, args.repeat)
    comm.reset_stats()
    comm.trace = []
    sync_step()
    trace, comm.trace = comm.trace, None

    collectives = {}
    for channels in (c, 16 * c):
        ours = np.zeros(2 * channels + 1)                      # float64, one allreduce
        theirs = np.zeros(2 * channels + 1, np.float32)        # (mean, invstd, count)
        gathered = np.empty((comm.size, theirs.size), np.float32)
        out = np.empty_like(ours)
        t_ours = timed(comm, lambda a=ours, b=out: comm.mpi_comm.Allreduce(a, b),
                       args.repeat * 10)
        t_theirs = timed(comm, lambda a=theirs, b=gathered: comm.mpi_comm.Allgather(a, b),
                         args.repeat * 10)
        collectives[channels] = {
            "ours_us": t_ours[0] * 1e6, "ours_bytes": ours.nbytes,
            "torch_us": t_theirs[0] * 1e6, "torch_sent": theirs.nbytes,
            "torch_received": gathered.nbytes}
    if comm.rank == 0:
        print(json.dumps({"ranks": comm.size, "plain_ms": [t * 1e3 for t in plain],
                          "sync_ms": [t * 1e3 for t in sync],
                          "trace": trace, "collectives": collectives}), flush=True)


# ---- the driver -------------------------------------------------------------------------

def launch(k, args):
    cmd = [MPIEXEC, "-n", str(k), sys.executable, os.path.abspath(__file__), "--worker",
           "--shape", *map(str, args.shape), "--repeat", str(args.repeat)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if not os.path.exists(MPIEXEC):
        raise SystemExit(f"no mpiexec next to {sys.executable}: pip install mpi4py mpich")
    n, c, h, w = args.shape
    print(f"per-rank input ({n}, {c}, {h}, {w}) float32 NCHW, {os.cpu_count()} cores, "
          f"OMP_NUM_THREADS=1; step times: median (best) of {args.repeat} steps of the "
          "slowest rank\n")
    results = [launch(k, args) for k in args.ranks]
    print("| K | batch_norm fwd+bwd | sync_batch_norm fwd+bwd | collectives / step "
          "(bytes each) |")
    print("|---|---|---|---|")
    for r in results:
        calls = ", ".join(f"{kind} {nbytes} B" for kind, _, nbytes in r["trace"]) or "none"
        (pm, pb), (sm, sb) = r["plain_ms"], r["sync_ms"]
        print(f"| {r['ranks']} | {pm:.2f} ({pb:.2f}) ms | {sm:.2f} ({sb:.2f}) ms | "
              f"{len(r['trace'])}: {calls} |")
    print("\nforward statistics exchange, timed alone (per rank; medians):\n")
    print("| K | C | ours: allreduce float64 (2C+1) | PyTorch: allgather (mean, invstd, "
          "count) float32 |")
    print("|---|---|---|---|")
    for r in results:
        for channels, s in r["collectives"].items():
            print(f"| {r['ranks']} | {channels} | {s['ours_us']:.1f} us, {s['ours_bytes']} B "
                  f"sent and received | {s['torch_us']:.1f} us, {s['torch_sent']} B sent, "
                  f"{s['torch_received']} B received |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
