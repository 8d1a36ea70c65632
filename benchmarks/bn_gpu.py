"""Batch norm on one GPU: minigraph's kernels against PyTorch (cuDNN), same GPU, same run.

    python benchmarks/bn_gpu.py [--device 0] [--runs 30] [--warmup 10] [--json FILE]

Cases (float32 unless said): NCHW (32, 256, 56, 56), (64, 64, 112, 112),
(256, 512, 7, 7), (128, 2048, 7, 7), (8, 32, 16, 64, 64) (NCDHW), (1024, 4096)
(rank 2: a batch norm after an fc layer) and (64, 256, 14, 14) in float64; NHWC
(32, 56, 56, 256) and (64, 28, 28, 128). PyTorch runs torch.nn.functional.batch_norm
(cuDNN where PyTorch picks it) and its autograd backward on the same data, NHWC as
channels_last memory (the same bytes).

Three tables:
1. Per case and pass - training forward, inference forward, backward - the median
   device time of >= 20 runs (CUDA events), the effective bandwidth and its share of
   a device-to-device copy of the case's own tensor size measured in the same run
   (read + write; the copy rotates over as many buffers as the inputs do, so
   neither sits in L2), for minigraph and PyTorch; the last column is mg/torch.
   Bandwidth counts the bytes the two-kernel passes move - training 3x the tensor,
   inference 2x, backward 5x - as the first runs did, so the rows stay comparable;
   the one-launch passes (NCHW with small planes) move 2x and 3x, so their share
   can pass 100% (they beat a copy of the two-kernel traffic).
2. Each minigraph kernel of each pass: its median time, from CUDA events recorded
   between the kernels of the timed runs (a hook on every launch; nothing else
   changes).
3. Batch norm + relu: the fused batch_norm_relu kernels (forward: y = max(y, 0) in the
   same pass; backward: dy masked by y's sign in the same passes) against the unfused
   pair (batch norm then the relu kernel; relu's gradient kernel then batch norm's
   backward), and PyTorch's relu(batch_norm(x)); fused/pair is the target ratio
   (<= 0.8), mg/torch the last column.

Timing: inputs rotate over enough copies to exceed 4x the L2 cache; before the
timed runs the stream is held busy by device-to-device copies so that every run is
queued before the first one starts, so host-side launch overhead does not leak into
the device times. Both libraries get the same treatment. Needs pycuda and a CUDA
build of PyTorch; imports neither until run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from types import SimpleNamespace

F32, F64 = "float32", "float64"
CASES = [((32, 256, 56, 56), "NCHW", F32), ((64, 64, 112, 112), "NCHW", F32),
         ((256, 512, 7, 7), "NCHW", F32), ((128, 2048, 7, 7), "NCHW", F32),
         ((8, 32, 16, 64, 64), "NCHW", F32), ((1024, 4096), "NCHW", F32),
         ((64, 256, 14, 14), "NCHW", F64),
         ((32, 56, 56, 256), "NHWC", F32), ((64, 28, 28, 128), "NHWC", F32)]
PASSES = ("train", "infer", "backward")
TRAFFIC = {"train": 3, "infer": 2, "backward": 5}     # tensor-sized transfers per pass
HOLD_VALUES = 64 * 2**20                              # float32 values of the hold copy (256 MiB)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--runs", type=int, default=30, help="timed runs per case (>= 20)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.runs < 20:
        p.error("--runs must be at least 20")
    return args


class KernelMarks:
    """A CUDA event recorded after every minigraph kernel launch while `marks` is a
    list ((kernel name, event) appended). Installed on loader.Kernel before the
    first launch is prepared: prepared launches are memoised."""

    def __init__(self, drv, loader):
        self.drv, self.marks = drv, None
        cls = loader.Kernel
        prepared, launch, marks = cls.prepared, cls.launch, self

        def timed_prepared(kernel, *args, **kwargs):
            go = prepared(kernel, *args, **kwargs)
            if go is loader._no_launch:
                return go

            def timed(*call):
                go(*call)
                marks.mark(kernel.name)
            return timed

        def timed_launch(kernel, *args):
            launch(kernel, *args)
            marks.mark(kernel.name)

        cls.prepared, cls.launch = timed_prepared, timed_launch

    def mark(self, name):
        if self.marks is not None:
            event = self.drv.Event()
            event.record()
            self.marks.append((name, event))


class Timer:
    """Per-run device times with CUDA events; every run is queued behind a
    device-side hold so that the host never starves the GPU."""

    def __init__(self, drv, hold_buffer, kernel_marks):
        self.drv = drv
        self.hold_src, self.hold_dst = hold_buffer
        self.kernel_marks = kernel_marks

    def hold(self, milliseconds, copy_ms):
        """Queue device-to-device copies that keep the stream busy ~milliseconds."""
        for _ in range(max(1, math.ceil(milliseconds / max(copy_ms, 1e-3)))):
            self.drv.memcpy_dtod_async(self.hold_dst.gpudata, self.hold_src.gpudata,
                                       self.hold_src.nbytes)

    def median_ms(self, fn, runs, warmup, copy_ms=None, kernels=None):
        """Median device time of fn(i) over `runs` runs (after `warmup` runs);
        with copy_ms (the time of one hold copy) the runs queue behind a hold
        twice as long as the host took to issue them during the warm-up. With
        `kernels` (a list), it also gets [(kernel name, median ms)] of the
        minigraph kernels each run launched, from events between them."""
        host = time.perf_counter()
        for i in range(warmup):
            fn(i)
        host = (time.perf_counter() - host) / max(warmup, 1)
        self.drv.Context.synchronize()
        events = [(self.drv.Event(), self.drv.Event()) for _ in range(runs)]
        marked = []
        if copy_ms:
            self.hold(1.0 + 2e3 * host * runs, copy_ms)
        for i, (start, stop) in enumerate(events):
            start.record()
            self.kernel_marks.marks = [] if kernels is not None else None
            fn(i)
            if kernels is not None:
                marked.append(self.kernel_marks.marks)
            self.kernel_marks.marks = None
            stop.record()
        events[-1][1].synchronize()
        if kernels is not None:
            kernels.extend(kernel_medians(marked, [start for start, _ in events]))
        return statistics.median(start.time_till(stop) for start, stop in events)


def kernel_medians(marked, starts):
    """[(kernel name, median ms)] per kernel position, when every run launched the same
    kernels ([] otherwise)."""
    names = [name for name, _ in marked[0]] if marked else []
    if not names or any([name for name, _ in run] != names for run in marked):
        return []
    times = [[] for _ in names]
    for start, run in zip(starts, marked):
        before = start
        for k, (_, event) in enumerate(run):
            times[k].append(before.time_till(event))
            before = event
    return [(name, statistics.median(ts)) for name, ts in zip(names, times)]


def copy_reference(env, nbytes, sets, args):
    """(GB/s of a device-to-device copy of `nbytes`, read + write, rotating over `sets`
    buffer pairs), the reference of a case of that size."""
    np, gpuarray, drv = env.np, env.gpuarray, env.drv
    pairs = [(gpuarray.empty((nbytes // 4,), np.float32), gpuarray.empty((nbytes // 4,),
                                                                        np.float32))
             for _ in range(sets)]
    for src, _ in pairs:
        src.fill(1.0)
    ms = env.timer.median_ms(lambda i: drv.memcpy_dtod_async(
        pairs[i % sets][1].gpudata, pairs[i % sets][0].gpudata, nbytes), args.runs, args.warmup,
        env.hold_copy_ms)
    return 2 * nbytes / ms / 1e6


def bench_case(shape, layout, dtype, env, args):
    """(rows of table 1, kernel rows of table 2, rows of table 3) of one case."""
    np, torch, gpuarray, timer = env.np, env.torch, env.gpuarray, env.timer
    batch_norm, batch_norm_grad, activation = env.batch_norm, env.batch_norm_grad, env.activation
    n_ch = shape[1] if layout == "NCHW" else shape[-1]
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    sets = max(1, min(8, math.ceil(4 * env.l2_bytes / nbytes)))
    rng = np.random.default_rng(0)
    host_x = [(rng.standard_normal(shape) * 2 + 0.5).astype(dtype) for _ in range(sets)]
    host_dy = [rng.standard_normal(shape).astype(dtype) for _ in range(sets)]
    host_p = [rng.uniform(0.5, 1.5, n_ch).astype(dtype), rng.standard_normal(n_ch).astype(dtype),
              np.zeros(n_ch, dtype), np.ones(n_ch, dtype)]
    copy_gbs = copy_reference(env, nbytes, sets, args)

    # minigraph: device arrays in the given layout
    xs = [gpuarray.to_gpu(h) for h in host_x]
    dys = [gpuarray.to_gpu(h) for h in host_dy]
    ys = [gpuarray.empty_like(x) for x in xs]
    scale, bias, em, ev = (gpuarray.to_gpu(p) for p in host_p)
    counter = gpuarray.to_gpu(np.zeros((), np.int64))
    guard = batch_norm.Guard()
    eps = 1e-5
    common = (scale, bias, em, ev, counter, 0.9, eps, layout)
    stats = [batch_norm.forward_train(x, *common, guard=guard)[1:] for x in xs]
    relu_ys = [batch_norm.forward_train(x, *common, guard=guard, relu=True)[0] for x in xs]

    def mg_train(i):
        batch_norm.forward_train(xs[i % sets], *common, out=ys[i % sets], guard=guard)

    def mg_infer(i):
        batch_norm.forward_infer(xs[i % sets], scale, bias, em, ev, eps, layout, out=ys[i % sets])

    def mg_backward(i):
        j = i % sets
        batch_norm_grad.backward(xs[j], dys[j], scale, stats[j][0], stats[j][1], eps, layout)

    def mg_fused_train(i):
        batch_norm.forward_train(xs[i % sets], *common, out=ys[i % sets], guard=guard, relu=True)

    def mg_pair_train(i):
        j = i % sets
        y = batch_norm.forward_train(xs[j], *common, out=ys[j], guard=guard)[0]
        activation.relu(y, out=y)

    def mg_fused_infer(i):
        batch_norm.forward_infer(xs[i % sets], scale, bias, em, ev, eps, layout, out=ys[i % sets],
                                 relu=True)

    def mg_pair_infer(i):
        j = i % sets
        activation.relu(batch_norm.forward_infer(xs[j], scale, bias, em, ev, eps, layout,
                                                 out=ys[j]), out=ys[j])

    def mg_fused_backward(i):
        j = i % sets
        batch_norm_grad.backward(xs[j], dys[j], scale, stats[j][0], stats[j][1], eps, layout,
                                 relu_out=relu_ys[j])

    def mg_pair_backward(i):
        j = i % sets
        masked = activation.relu_grad(relu_ys[j], dys[j])
        batch_norm_grad.backward(xs[j], masked, scale, stats[j][0], stats[j][1], eps, layout)

    # PyTorch: logical NCHW, channels_last memory for NHWC (the same bytes)
    dev = torch.device("cuda", args.device)

    def to_torch(h):
        t = torch.from_numpy(h).to(dev)
        return t.permute(0, 3, 1, 2) if layout == "NHWC" else t

    txs = [to_torch(h).requires_grad_(True) for h in host_x]
    tdys = [to_torch(h) for h in host_dy]
    tw, tb, tm, tv = (torch.from_numpy(p).to(dev) for p in host_p)
    tw.requires_grad_(True)
    tb.requires_grad_(True)
    fbn, frelu = torch.nn.functional.batch_norm, torch.nn.functional.relu

    def pt_train(i):
        fbn(txs[i % sets], tm, tv, tw, tb, training=True, momentum=0.1, eps=eps)

    def pt_infer(i):
        fbn(txs[i % sets], tm, tv, tw, tb, training=False, eps=eps)

    def pt_relu_train(i):
        frelu(fbn(txs[i % sets], tm, tv, tw, tb, training=True, momentum=0.1, eps=eps))

    def pt_relu_infer(i):
        frelu(fbn(txs[i % sets], tm, tv, tw, tb, training=False, eps=eps))

    graphs = [fbn(x, tm, tv, tw, tb, training=True, momentum=0.1, eps=eps) for x in txs]
    relu_graphs = [frelu(fbn(x, tm, tv, tw, tb, training=True, momentum=0.1, eps=eps))
                   for x in txs]

    def pt_backward(i):
        j = i % sets
        torch.autograd.grad(graphs[j], (txs[j], tw, tb), tdys[j], retain_graph=True)

    def pt_relu_backward(i):
        j = i % sets
        torch.autograd.grad(relu_graphs[j], (txs[j], tw, tb), tdys[j], retain_graph=True)

    # agreement (one set): minigraph against PyTorch, fused against the pair
    mg_train(0)
    y_pt = fbn(txs[0].detach(), tm.clone(), tv.clone(), tw.detach(), tb.detach(),
               training=True, momentum=0.1, eps=eps)
    y_pt = (y_pt.permute(0, 2, 3, 1) if layout == "NHWC" else y_pt).contiguous().cpu().numpy()
    agree = float(np.max(np.abs(ys[0].get() - y_pt)))
    mg_fused_train(0)
    fused_y = ys[0].get()
    mg_pair_train(0)
    agree_fused = float(np.max(np.abs(fused_y - ys[0].get())))

    def time_pair(mg_fn, pt_fn, kernels=None):
        with torch.no_grad() if pt_fn is not pt_backward and pt_fn is not pt_relu_backward \
                else contextlib.nullcontext():
            t_mg = timer.median_ms(mg_fn, args.runs, args.warmup, env.hold_copy_ms, kernels)
            t_pt = timer.median_ms(pt_fn, args.runs, args.warmup, env.hold_copy_ms)
        return t_mg, t_pt

    label = dict(shape=list(shape), layout=layout, dtype=dtype)
    rows, kernel_rows, fused_rows = [], [], []
    for name, mg_fn, pt_fn in (("train", mg_train, pt_train), ("infer", mg_infer, pt_infer),
                               ("backward", mg_backward, pt_backward)):
        kernels = []
        t_mg, t_pt = time_pair(mg_fn, pt_fn, kernels)
        moved = TRAFFIC[name] * nbytes
        rows.append(dict(label, pass_=name, minigraph_ms=t_mg, torch_ms=t_pt,
                         minigraph_gbs=moved / t_mg / 1e6, torch_gbs=moved / t_pt / 1e6,
                         copy_gbs=copy_gbs, max_abs_diff_y=agree))
        kernel_rows.append(dict(label, pass_=name, kernels=kernels))
    for name, fused_fn, pair_fn, pt_fn in (
            ("train", mg_fused_train, mg_pair_train, pt_relu_train),
            ("infer", mg_fused_infer, mg_pair_infer, pt_relu_infer),
            ("backward", mg_fused_backward, mg_pair_backward, pt_relu_backward)):
        t_fused, t_pt = time_pair(fused_fn, pt_fn)
        t_pair = timer.median_ms(pair_fn, args.runs, args.warmup, env.hold_copy_ms)
        fused_rows.append(dict(label, pass_=name, fused_ms=t_fused, pair_ms=t_pair,
                               torch_ms=t_pt, max_abs_diff_fused=agree_fused))
    try:
        guard.check()
    except FloatingPointError as e:       # random data: never expected
        print(f"warning: {e}", file=sys.stderr)
    return rows, kernel_rows, fused_rows


def case_text(r):
    dt = "" if r["dtype"] == F32 else " f64"
    return f"{str(tuple(r['shape'])):>20} {r['layout']:>6}{dt:>4}"


def print_tables(rows, kernel_rows, fused_rows):
    print(f"{'shape':>20} {'layout':>6} {'':>3} {'pass':>8} | {'minigraph ms':>12} {'GB/s':>7} "
          f"{'of copy':>7} | {'torch ms':>9} {'GB/s':>7} {'of copy':>7} | {'copy GB/s':>9} | "
          f"{'mg/torch':>8}")
    for r in rows:
        print(f"{case_text(r)} {r['pass_']:>8} | {r['minigraph_ms']:12.4f} "
              f"{r['minigraph_gbs']:7.0f} {r['minigraph_gbs'] / r['copy_gbs']:7.1%} | "
              f"{r['torch_ms']:9.4f} {r['torch_gbs']:7.0f} {r['torch_gbs'] / r['copy_gbs']:7.1%} | "
              f"{r['copy_gbs']:9.0f} | {r['minigraph_ms'] / r['torch_ms']:8.2f}")
    print("max |y_minigraph - y_torch| per case: " + ", ".join(
        f"{tuple(r['shape'])} {r['layout']} {r['dtype']}: {r['max_abs_diff_y']:.2e}"
        for r in rows if r["pass_"] == "train"))
    print("\nminigraph's kernels per pass (median ms each, events between the kernels)")
    for r in kernel_rows:
        parts = " + ".join(f"{name} {ms:.4f}" for name, ms in r["kernels"]) or "(not measured)"
        print(f"{case_text(r)} {r['pass_']:>8} | {parts}")
    print("\nbatch norm + relu: the fused kernels against the unfused pair, and PyTorch's "
          "relu(batch_norm(x))")
    print(f"{'shape':>20} {'layout':>6} {'':>3} {'pass':>8} | {'fused ms':>9} {'pair ms':>9} "
          f"{'fused/pair':>10} | {'torch ms':>9} | {'mg/torch':>8}")
    for r in fused_rows:
        print(f"{case_text(r)} {r['pass_']:>8} | {r['fused_ms']:9.4f} {r['pair_ms']:9.4f} "
              f"{r['fused_ms'] / r['pair_ms']:10.2f} | {r['torch_ms']:9.4f} | "
              f"{r['fused_ms'] / r['torch_ms']:8.2f}")
    print("max |y_fused - relu(y_pair)| per case: " + ", ".join(
        f"{tuple(r['shape'])} {r['layout']} {r['dtype']}: {r['max_abs_diff_fused']:.2e}"
        for r in fused_rows if r["pass_"] == "train"))


def main(argv=None):
    args = parse_args(argv)
    import numpy as np

    import minigraph as mg
    from minigraph.kernels.cuda import activation, batch_norm, batch_norm_grad, loader

    try:
        mg.GPUPlace(args.device)             # primary context, current from now on
        import pycuda.driver as drv
        import pycuda.gpuarray as gpuarray
        import torch

        torch.cuda.set_device(args.device)
    except (ImportError, mg.GPUError, RuntimeError, AssertionError) as e:
        sys.exit(f"bn_gpu: needs pycuda, a CUDA build of torch and a GPU: {e}")
    marks = KernelMarks(drv, loader)
    device = drv.Context.get_device()
    l2_bytes = device.get_attribute(drv.device_attribute.L2_CACHE_SIZE)
    hold_src = gpuarray.empty((HOLD_VALUES,), np.float32)
    hold_src.fill(0.0)
    timer = Timer(drv, (hold_src, gpuarray.empty_like(hold_src)), marks)
    hold_copy_ms = timer.median_ms(lambda i: timer.hold(0, 1), args.runs, args.warmup)  # 1 copy
    env = SimpleNamespace(np=np, torch=torch, gpuarray=gpuarray, drv=drv, batch_norm=batch_norm,
                          batch_norm_grad=batch_norm_grad, activation=activation, timer=timer,
                          l2_bytes=l2_bytes, hold_copy_ms=hold_copy_ms)
    rows, kernel_rows, fused_rows = [], [], []
    for shape, layout, dtype in CASES:
        found = bench_case(shape, layout, dtype, env, args)
        rows += found[0]
        kernel_rows += found[1]
        fused_rows += found[2]

    sms = device.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
    print(f"device: {device.name()}, {sms} SMs, L2 {l2_bytes / 2**20:.0f} MiB; torch "
          f"{torch.__version__}, cuDNN {torch.backends.cudnn.version()}; median of {args.runs} "
          "runs; the copy reference is a device-to-device copy of each case's own size")
    print_tables(rows, kernel_rows, fused_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.name(), runs=args.runs, rows=rows, kernels=kernel_rows,
                           fused=fused_rows), f, indent=1)


if __name__ == "__main__":
    main()
