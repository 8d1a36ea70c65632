"""Batch norm on one GPU: minigraph's kernels against PyTorch (cuDNN), same GPU, same run.

    python benchmarks/bn_gpu.py [--device 0] [--runs 30] [--warmup 10] [--json FILE]

For each fp32 shape (NCHW, and one NHWC) and each pass - forward (train),
forward (infer), backward - it reports the median time of >= 20 runs
measured with CUDA events, the effective bandwidth (train forward moves 3x
the tensor's bytes, infer 2x, backward 5x: each input read once, each output
written once) and that bandwidth as a fraction of a device-to-device copy
measured in the same run (bytes read + written). PyTorch runs
torch.nn.functional.batch_norm (cuDNN where PyTorch picks it) and its
autograd backward on the same data.

Timing: inputs rotate over enough copies to exceed 4x the L2 cache; before
the timed runs the stream is held busy by device-to-device copies so that
every run is queued before the first one starts, so host-side launch
overhead does not leak into the device times. Both libraries get the same
treatment. Needs pycuda and a CUDA build of PyTorch; imports neither until run.
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

SHAPES = [((32, 256, 56, 56), "NCHW"), ((64, 64, 112, 112), "NCHW"), ((256, 512, 7, 7), "NCHW"),
          ((128, 2048, 7, 7), "NCHW"), ((32, 56, 56, 256), "NHWC")]
PASSES = ("train", "infer", "backward")
TRAFFIC = {"train": 3, "infer": 2, "backward": 5}     # tensor-sized transfers per pass


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


class Timer:
    """Per-run device times with CUDA events; every run is queued behind a
    device-side hold so that the host never starves the GPU."""

    def __init__(self, drv, hold_buffer):
        self.drv = drv
        self.hold_src, self.hold_dst = hold_buffer

    def hold(self, milliseconds, copy_ms):
        """Queue device-to-device copies that keep the stream busy ~milliseconds."""
        for _ in range(max(1, math.ceil(milliseconds / max(copy_ms, 1e-3)))):
            self.drv.memcpy_dtod_async(self.hold_dst.gpudata, self.hold_src.gpudata,
                                       self.hold_src.nbytes)

    def median_ms(self, fn, runs, warmup, copy_ms=None):
        """Median device time of fn(i) over `runs` runs (after `warmup` runs);
        with copy_ms (the time of one hold copy) the runs queue behind a hold
        twice as long as the host took to issue them during the warm-up."""
        host = time.perf_counter()
        for i in range(warmup):
            fn(i)
        host = (time.perf_counter() - host) / max(warmup, 1)
        self.drv.Context.synchronize()
        events = [(self.drv.Event(), self.drv.Event()) for _ in range(runs)]
        if copy_ms:
            self.hold(1.0 + 2e3 * host * runs, copy_ms)
        for i, (start, stop) in enumerate(events):
            start.record()
            fn(i)
            stop.record()
        events[-1][1].synchronize()
        return statistics.median(start.time_till(stop) for start, stop in events)


def copy_bandwidth(drv, gpuarray, timer, nbytes, runs, warmup):
    """(GB/s of a device-to-device copy counting read + write, ms per copy)."""
    src = gpuarray.empty((nbytes // 4,), "float32")
    dst = gpuarray.empty_like(src)
    src.fill(1.0)
    ms = timer.median_ms(lambda i: drv.memcpy_dtod_async(dst.gpudata, src.gpudata, src.nbytes),
                         runs, warmup)
    return 2 * src.nbytes / ms / 1e6, ms


def bench_shape(shape, layout, env, args):
    np, torch, gpuarray, timer = env.np, env.torch, env.gpuarray, env.timer
    batch_norm, batch_norm_grad = env.batch_norm, env.batch_norm_grad
    n_ch = shape[1] if layout == "NCHW" else shape[-1]
    nbytes = math.prod(shape) * 4
    sets = max(1, min(8, math.ceil(4 * env.l2_bytes / nbytes)))
    rng = np.random.default_rng(0)
    host_x = [rng.standard_normal(shape, dtype=np.float32) * 2 + 0.5 for _ in range(sets)]
    host_dy = [rng.standard_normal(shape, dtype=np.float32) for _ in range(sets)]
    host_p = [rng.uniform(0.5, 1.5, n_ch).astype(np.float32),
              rng.standard_normal(n_ch).astype(np.float32),
              np.zeros(n_ch, np.float32), np.ones(n_ch, np.float32)]

    # minigraph: GPUArrays in the given layout
    xs = [gpuarray.to_gpu(h) for h in host_x]
    dys = [gpuarray.to_gpu(h) for h in host_dy]
    ys = [gpuarray.empty_like(x) for x in xs]
    scale, bias, em, ev = (gpuarray.to_gpu(p) for p in host_p)
    counter = gpuarray.to_gpu(np.zeros((), np.int64))
    guard = batch_norm.Guard()
    stats = [batch_norm.forward_train(x, scale, bias, em, ev, counter, 0.9, 1e-5, layout,
                                      guard=guard)[1:] for x in xs]

    def mg_train(i):
        batch_norm.forward_train(xs[i % sets], scale, bias, em, ev, counter, 0.9, 1e-5, layout,
                                 out=ys[i % sets], guard=guard)

    def mg_infer(i):
        batch_norm.forward_infer(xs[i % sets], scale, bias, em, ev, 1e-5, layout,
                                 out=ys[i % sets])

    def mg_backward(i):
        j = i % sets
        batch_norm_grad.backward(xs[j], dys[j], scale, stats[j][0], stats[j][1], 1e-5, layout)

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
    fbn = torch.nn.functional.batch_norm

    def pt_train(i):
        fbn(txs[i % sets], tm, tv, tw, tb, training=True, momentum=0.1, eps=1e-5)

    def pt_infer(i):
        fbn(txs[i % sets], tm, tv, tw, tb, training=False, eps=1e-5)
    graphs = [fbn(x, tm, tv, tw, tb, training=True, momentum=0.1, eps=1e-5) for x in txs]

    def pt_backward(i):
        j = i % sets
        torch.autograd.grad(graphs[j], (txs[j], tw, tb), tdys[j], retain_graph=True)

    # agreement (one set): minigraph against PyTorch
    y_mg = ys[0]
    mg_train(0)
    y_pt = fbn(txs[0].detach(), tm.clone(), tv.clone(), tw.detach(), tb.detach(),
               training=True, momentum=0.1, eps=1e-5)
    y_pt = (y_pt.permute(0, 2, 3, 1) if layout == "NHWC" else y_pt).contiguous().cpu().numpy()
    agree = float(np.max(np.abs(y_mg.get() - y_pt)))

    rows = []
    for name, mg_fn, pt_fn in (("train", mg_train, pt_train), ("infer", mg_infer, pt_infer),
                               ("backward", mg_backward, pt_backward)):
        with torch.no_grad() if name != "backward" else contextlib.nullcontext():
            t_mg = timer.median_ms(mg_fn, args.runs, args.warmup, env.hold_copy_ms)
            t_pt = timer.median_ms(pt_fn, args.runs, args.warmup, env.hold_copy_ms)
        moved = TRAFFIC[name] * nbytes
        rows.append(dict(shape=list(shape), layout=layout, pass_=name, minigraph_ms=t_mg,
                         torch_ms=t_pt, minigraph_gbs=moved / t_mg / 1e6,
                         torch_gbs=moved / t_pt / 1e6, max_abs_diff_y=agree))
    try:
        guard.check()
    except FloatingPointError as e:       # random data: never expected
        print(f"warning: {e}", file=sys.stderr)
    return rows


def main(argv=None):
    args = parse_args(argv)
    import numpy as np

    import minigraph as mg
    from minigraph.kernels.cuda import batch_norm, batch_norm_grad

    try:
        mg.GPUPlace(args.device)             # primary context, current from now on
        import pycuda.driver as drv
        import pycuda.gpuarray as gpuarray
        import torch

        torch.cuda.set_device(args.device)
    except (ImportError, mg.GPUError, RuntimeError, AssertionError) as e:
        sys.exit(f"bn_gpu: needs pycuda, a CUDA build of torch and a GPU: {e}")
    device = drv.Context.get_device()
    l2_bytes = device.get_attribute(drv.device_attribute.L2_CACHE_SIZE)
    hold_src = gpuarray.empty((64 * 2**20,), np.float32)      # 256 MiB
    hold_src.fill(0.0)
    timer = Timer(drv, (hold_src, gpuarray.empty_like(hold_src)))
    copy_gbs, _ = copy_bandwidth(drv, gpuarray, timer, 1 << 30, args.runs, args.warmup)
    hold_copy_ms = timer.median_ms(lambda i: timer.hold(0, 1), args.runs, args.warmup)  # 1 copy
    env = SimpleNamespace(np=np, torch=torch, gpuarray=gpuarray, batch_norm=batch_norm,
                          batch_norm_grad=batch_norm_grad,
                          timer=timer, l2_bytes=l2_bytes, hold_copy_ms=hold_copy_ms)
    rows = []
    for shape, layout in SHAPES:
        rows += bench_shape(shape, layout, env, args)

    sms = device.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
    print(f"device: {device.name()}, {sms} SMs, L2 {l2_bytes / 2**20:.0f} MiB; torch "
          f"{torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"device-to-device copy (1 GiB): {copy_gbs:.0f} GB/s (read + write), "
          f"median of {args.runs}")
    print(f"{'shape':>20} {'layout':>6} {'pass':>8} | {'minigraph ms':>12} {'GB/s':>7} "
          f"{'of copy':>7} | {'torch ms':>9} {'GB/s':>7} {'of copy':>7} | {'mg/torch':>8}")
    for r in rows:
        print(f"{str(tuple(r['shape'])):>20} {r['layout']:>6} {r['pass_']:>8} | "
              f"{r['minigraph_ms']:12.4f} {r['minigraph_gbs']:7.0f} "
              f"{r['minigraph_gbs'] / copy_gbs:7.1%} | {r['torch_ms']:9.4f} "
              f"{r['torch_gbs']:7.0f} {r['torch_gbs'] / copy_gbs:7.1%} | "
              f"{r['minigraph_ms'] / r['torch_ms']:8.2f}")
    print("max |y_minigraph - y_torch| per shape: " + ", ".join(
        f"{tuple(r['shape'])} {r['layout']}: {r['max_abs_diff_y']:.2e}"
        for r in rows if r["pass_"] == "train"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.name(), copy_gbs=copy_gbs, runs=args.runs, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
