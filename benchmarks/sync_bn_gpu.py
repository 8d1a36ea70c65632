"""sync_batch_norm on K GPU ranks: minigraph against PyTorch's SyncBatchNorm.

    python benchmarks/sync_bn_gpu.py [--ranks 1 2] [--shape 32 64 56 56] [--repeat 30] [--no-chain]

First (unless --no-chain), in this process on GPU 0, the kernel chain of one
sync_batch_norm layer in a world of one that does NOT take batch norm's kernels
(the op does, with one rank): forward - this rank's (n, mean, M2), the collective,
the channels finished from the sums, the normalisation - and backward - the sums
of dy and dy (x - mean), the collective, dscale, dbias (1/K folded in) and the dx
coefficients from the sums, dx - each kernel timed with CUDA events between them
(the collective is a device-to-device copy here: NCCL's own latency is not in
it), against batch_norm's forward and backward on the same data.

For each K it launches `mpiexec -n K` (the mpiexec next to the interpreter)
twice, once per framework, so that the two never share a process. Rank r runs
on GPU r % (GPUs on the machine). minigraph: mg.distributed.init(place="gpu")
(NCCL when nccl4py is installed and every rank has a GPU of its own, else MPI
staged through the host), one sync_batch_norm forward and its grad op through
Executor.run. PyTorch: torch.distributed with NCCL (gloo when ranks share a
GPU), nn.SyncBatchNorm's forward and backward. Both fp32 NCHW, the same
per-rank shape (weak scaling), the step timed from the host with the device
synchronised after it; rank 0 prints the median of --repeat steps after
--warmup, and the table shows them side by side with their ratio.
Needs pycuda, mpi4py and a CUDA build of PyTorch.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shape", type=int, nargs=4, default=[32, 64, 56, 56],
                   metavar=("N", "C", "H", "W"), help="per-rank NCHW input")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--no-chain", action="store_true", help="skip the one-layer kernel chain")
    p.add_argument("--worker", choices=("minigraph", "torch"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def timed(step, sync, repeat, warmup):
    """Median milliseconds of step() followed by sync()."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def minigraph_worker(args):
    """One rank: sync_batch_norm forward + grad on this rank's GPU; (ms, backend)."""
    import numpy as np

    import minigraph as mg

    comm = mg.distributed.init(place="gpu")
    place = comm.place
    n, c, h, w = args.shape
    rng = np.random.default_rng(comm.rank)
    scope = mg.Scope()

    def var(name, value):
        v = scope.new_var(name, persistable=True)
        v.set(place.to_device(value.astype(np.float32)))
        return v

    x = var("x", rng.standard_normal((n, c, h, w)) + 3)
    dy = var("dy", rng.standard_normal((n, c, h, w)))
    mean, variance = var("mean", np.zeros(c)), var("var", np.ones(c))
    scale, bias = var("scale", np.ones(c)), var("bias", np.zeros(c))
    y, bm, bv = (scope.new_var(s) for s in ("y", "bm", "bv"))
    dx, dscale, dbias = (scope.new_var(s) for s in ("dx", "dscale", "dbias"))
    forward = mg.Operator("sync_batch_norm", x=x, estimated_mean=mean, estimated_var=variance,
                          scale=scale, bias=bias, y=y, batch_mean=bm, batch_var=bv,
                          saved_mean=mean, saved_var=variance)
    grad = mg.Operator("sync_batch_norm_grad", x=x, scale=scale, mean=bm, var=bv, dy=dy, dx=dx,
                       dscale=dscale, dbias=dbias)
    runner = mg.Executor(place)
    ms = timed(lambda: runner.run([forward, grad], scope), place.check_errors, args.repeat,
               args.warmup)
    return ms, comm.backend


def torch_worker(args):
    """One rank: nn.SyncBatchNorm forward + backward on this rank's GPU; (ms, backend)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world.bcast(port)))
    backend = "nccl" if size <= gpus else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=size)
    n, c, h, w = args.shape
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = (torch.randn(n, c, h, w, generator=gen) + 3).to(device).requires_grad_()
    dy = torch.randn(n, c, h, w, generator=gen).to(device)
    bn = torch.nn.SyncBatchNorm(c).to(device)

    def step():
        x.grad = None
        bn.zero_grad(set_to_none=True)
        bn(x).backward(dy)

    ms = timed(step, torch.cuda.synchronize, args.repeat, args.warmup)
    dist.destroy_process_group()
    return ms, backend


def chain(args):
    """Print the kernel chain of one sync_batch_norm layer (see the module doc)."""
    import numpy as np
    import pycuda.driver as drv
    import pycuda.gpuarray as gpuarray
    from bn_gpu import KernelMarks, Timer

    import minigraph as mg
    from minigraph.kernels.cuda import batch_norm_op, elementwise, loader

    mg.GPUPlace(0)                                  # primary context, current from now on
    marks = KernelMarks(drv, loader)
    hold = gpuarray.empty((16 * 2**20,), np.float32)
    hold.fill(0.0)
    timer = Timer(drv, (hold, gpuarray.empty_like(hold)), marks)
    hold_ms = timer.median_ms(lambda i: timer.hold(0, 1), args.repeat, args.warmup)
    n, c, h, w = args.shape
    rng = np.random.default_rng(0)
    host = {"x": rng.standard_normal((n, c, h, w)) + 3, "dy": rng.standard_normal((n, c, h, w)),
            "scale": np.ones(c), "bias": np.zeros(c), "estimated_mean": np.zeros(c),
            "estimated_var": np.ones(c)}
    ins = {k: gpuarray.to_gpu(v.astype(np.float32)) for k, v in host.items()}
    ins["num_batches"] = gpuarray.to_gpu(np.zeros((), np.int64))
    scope = mg.Scope()
    v = {k: scope.new_var(k, persistable=True) for k in ("x", "estimated_mean", "estimated_var",
                                                         "scale", "bias", "num_batches")}
    outs = {k: scope.new_var(k) for k in ("y", "bm", "bv", "dx", "ds", "db", "dy")}
    ops = {}
    for kind in ("sync_batch_norm", "batch_norm"):
        fwd = mg.Operator(kind, **v, y=outs["y"], batch_mean=outs["bm"], batch_var=outs["bv"],
                          saved_mean=v["estimated_mean"], saved_var=v["estimated_var"],
                          saved_num_batches=v["num_batches"])
        extra = {"average_ranks": True} if kind == "sync_batch_norm" else {}
        grad = mg.Operator(kind + "_grad", x=v["x"], scale=v["scale"], mean=outs["bm"],
                           var=outs["bv"], dy=outs["dy"], dx=outs["dx"], dscale=outs["ds"],
                           dbias=outs["db"], **extra)
        ops[kind] = (fwd, grad)
    collective = elementwise.copy                 # a world of one: the collective moves nothing
    fwd_ins = {k: ins[k] for k in ("x", "estimated_mean", "estimated_var", "scale", "bias",
                                   "num_batches")}
    stats = batch_norm_op.forward_gpu(ops["batch_norm"][0], fwd_ins)
    grad_ins = {"x": ins["x"], "scale": ins["scale"], "mean": stats["batch_mean"],
                "var": stats["batch_var"], "dy": ins["dy"]}
    cases = {
        "forward": (lambda i: batch_norm_op.forward_gpu(ops["sync_batch_norm"][0], fwd_ins,
                                                        allreduce=collective),
                    lambda i: batch_norm_op.forward_gpu(ops["batch_norm"][0], fwd_ins)),
        "backward": (lambda i: batch_norm_op.backward_gpu(ops["sync_batch_norm"][1], grad_ins,
                                                          allreduce=collective, out_scale=1.0),
                     lambda i: batch_norm_op.backward_gpu(ops["batch_norm"][1], grad_ins))}
    print(f"one sync_batch_norm layer's kernel chain in a world of one (no fallback to "
          f"batch_norm; the collective a device copy), fp32 NCHW ({n}, {c}, {h}, {w}), median "
          f"of {args.repeat} runs")
    print("| pass | sync chain ms | its kernels (ms each) | batch_norm ms | chain / batch_norm |")
    print("|---|---|---|---|---|")
    for name, (sync_fn, plain_fn) in cases.items():
        kernels = []
        t_sync = timer.median_ms(sync_fn, max(args.repeat, 20), args.warmup, hold_ms, kernels)
        t_plain = timer.median_ms(plain_fn, max(args.repeat, 20), args.warmup, hold_ms)
        parts = " + ".join(f"{k} {ms:.4f}" for k, ms in kernels) or "(not measured)"
        print(f"| {name} | {t_sync:.4f} | {parts} | {t_plain:.4f} | {t_sync / t_plain:.2f} |",
              flush=True)
    print()


def worker(args):
    ms, backend = (minigraph_worker if args.worker == "minigraph" else torch_worker)(args)
    from mpi4py import MPI

    times = MPI.COMM_WORLD.gather(ms)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"ms": max(times), "backend": backend}), flush=True)


def launch(args, ranks, framework):
    """{"ms", "backend"} of one mpiexec run of `framework` on `ranks` ranks."""
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, os.path.abspath(__file__),
           "--worker", framework, "--shape", *map(str, args.shape),
           "--repeat", str(args.repeat), "--warmup", str(args.warmup)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{framework} on {ranks} ranks failed ({done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if not args.no_chain:
        chain(args)
    n, c, h, w = args.shape
    if not os.path.exists(MPIEXEC):
        raise SystemExit(f"no mpiexec next to {sys.executable}: pip install mpi4py mpich")
    print(f"sync batch norm, forward + backward, fp32 NCHW ({n}, {c}, {h}, {w}) per rank; "
          f"the slowest rank's median of {args.repeat} steps")
    print("| ranks | minigraph ms (backend) | PyTorch SyncBatchNorm ms (backend) | ratio |")
    print("|---|---|---|---|")
    for k in args.ranks:
        ours, theirs = launch(args, k, "minigraph"), launch(args, k, "torch")
        print(f"| {k} | {ours['ms']:.3f} ({ours['backend']}) | {theirs['ms']:.3f} "
              f"({theirs['backend']}) | {ours['ms'] / theirs['ms']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
