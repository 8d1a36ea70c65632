"""The least time an im2col engine on numpy needs for the ResNet benchmark's convs:
their matrix products alone, timed through numpy's BLAS.

    python benchmarks/conv_gemm_floor.py [--threads 2] [--repeat 15] [--json]

For every conv of benchmarks/nets_cpu.py's ResNet (batch 32x3x32x32) this times
the one product an im2col engine cannot avoid, filter (O, C kh kw) @ columns
(C kh kw, N Ho Wo), with exactly the conv's multiply-adds (no padded columns),
on ready-made random columns: both orientations (W @ cols and cols^T @ W^T)
and chunks of 1 to 32 images, keeping the fastest; and the columns' copy,
timed as a contiguous copy of as many values (a real im2col copy reads
strided windows, so it takes longer). A forward pass needs each once; a
training step needs three products (forward, dfilter, dx) and two copies (the
columns of x for the forward, and one set that both gradients share, as
minigraph's do for stride-1 convs: dout's columns for dx as a conv, which with
x give dfilter too). Nothing else counts: no padding, no transposes, no bias,
BN, ReLU or pooling. benchmarks/nets_cpu.py compares the
sums with PyTorch's times: a floor near or above PyTorch's time means no numpy
im2col engine, however lean, can match it.
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

BATCH, STAGES = 32, ((16, 1), (32, 2), (64, 2))
CHUNKS = (1, 2, 4, 8, 16, 32)


def resnet_convs():
    """[(C, H, W, O, k, stride)] of the ResNet's convs, in order (padding k // 2)."""
    convs, c, hw = [(3, 32, 32, 16, 3, 1)], 16, 32
    for filters, stride in STAGES:
        for block in range(2):
            s = stride if block == 0 else 1
            convs.append((c, hw, hw, filters, 3, s))
            out_hw = (hw - 1) // s + 1
            convs.append((filters, out_hw, out_hw, filters, 3, 1))
            if s != 1 or c != filters:
                convs.append((c, hw, hw, filters, 1, s))
            c, hw = filters, out_hw
    return convs


def batch_ms(call, args, calls, repeat):
    """Median time (ms) of `calls` calls of call(*args), after two warm-up calls."""
    for _ in range(2):
        call(*args)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            call(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _matmul(a, b, out):
    np.matmul(a, b, out=out)


def product_ms(rows, inner, cols, repeat):
    """Least time (ms) of (rows, inner) @ (inner, cols) over the batch, by chunks of
    images and orientation; cols covers the whole batch."""
    rng = np.random.default_rng(0)
    best = float("inf")
    for m in CHUNKS:
        n = cols * m // BATCH
        w = rng.standard_normal((rows, inner), dtype=np.float32)
        a = rng.standard_normal((inner, n), dtype=np.float32)
        for args in ((w, a, np.empty((rows, n), np.float32)),
                     (np.ascontiguousarray(a.T), w.T, np.empty((n, rows), np.float32))):
            best = min(best, batch_ms(_matmul, args, BATCH // m, repeat))
    return best


def copy_ms(values, repeat):
    """Least time (ms) to write `values` float32s (the batch's columns) as plain
    contiguous copies, by chunks of images: less than any im2col copy of them
    takes (a column copy reads strided windows)."""
    best = float("inf")
    for m in CHUNKS:
        src = np.ones(values * m // BATCH, np.float32)
        best = min(best, batch_ms(np.copyto, (np.empty_like(src), src), BATCH // m, repeat))
    return best


def floor(threads, repeat):
    """{"convs": [(shape, product ms, GFLOP/s, copy ms)], "forward_ms", "train_ms"} on
    `threads` BLAS threads: forward = products + column copies once each; a
    training step three products (forward, dfilter, dx) and two copies (x's
    columns; one set for both gradients)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)
    rows, products, copies = [], 0.0, 0.0
    for c, h, w, o, k, s in resnet_convs():
        ho, wo = (h - 1) // s + 1, (w - 1) // s + 1
        ms = product_ms(o, c * k * k, BATCH * ho * wo, repeat)
        cp = copy_ms(c * k * k * BATCH * ho * wo, repeat) if k > 1 else 0.0
        flops = 2 * o * c * k * k * BATCH * ho * wo
        rows.append(((c, h, w, o, k, s), ms, flops / ms / 1e6, cp))
        products, copies = products + ms, copies + cp
    return {"convs": rows, "forward_ms": products + copies,
            "train_ms": 3 * products + 2 * copies}


def against_pytorch(threads, theirs):
    """This script's floor, run in a process of its own, against PyTorch's ResNet times
    `theirs` ({"train": ms, "infer": ms}): a line for nets_cpu.py's notes."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--threads",
                           str(threads)], capture_output=True, text=True, check=True)
    f = json.loads(done.stdout.strip().splitlines()[-1])
    return (f"floor of any numpy im2col engine, conv products and column copies alone: "
            f"infer {f['forward_ms']:.2f} ms = {f['forward_ms'] / theirs['infer']:.2f}x "
            f"PyTorch, train {f['train_ms']:.2f} ms = {f['train_ms'] / theirs['train']:.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="one line of JSON, for nets_cpu.py")
    args = parser.parse_args(argv)
    result = floor(args.threads, args.repeat)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'conv (C, H, W -> O, k, stride)':<34} {'product ms':>10} {'GFLOP/s':>8} "
          f"{'columns copy ms':>15}")
    for (c, h, w, o, k, s), ms, rate, cp in result["convs"]:
        print(f"{f'{c}x{h}x{w} -> {o}, {k}x{k}, stride {s}':<34} {ms:>10.3f} {rate:>8.0f} "
              f"{cp:>15.3f}")
    print(f"floor of a forward pass (products and column copies once): "
          f"{result['forward_ms']:.2f} ms; of a training step (three products, two "
          f"copies): "
          f"{result['train_ms']:.2f} ms")


if __name__ == "__main__":
    main()
