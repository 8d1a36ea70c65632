"""Batch norm on (rows, C) tensors - NHWC, and NCHW with one value per plane - on the
GPU: the reduction plan of batch_norm.cu's rows kernels and the launchers of
kernels/cuda/bn_rows.cu's elementwise passes.

Reductions (statistics; gradient sums): grid (channel groups, splits), blocks
(TX, TY). Each group's last block finishes its channels from the splits' partials,
stored channel-contiguous, in parallel (batch_norm.cu's finish_rows_stats): its
threads take (channel, every J-th split), J = TY / W. TX - the 16-byte packs of
channels a group spans - is as wide as a warp when each of those threads then
reads at most FINISH_LOADS partials, and halved (down to ROW_BYTES a warp row)
until it does: narrower groups make more groups and fewer splits for the blocks
that fill the device. With 32 channel packs per group and a few hundred splits
that finish was serial and the tail of the pass.

Elementwise passes (normalize, infer, dx): grid (ceil(Cv / TX), row blocks); each
thread keeps one column of W channels for all its rows, its coefficients in
registers (inference computes them once per thread, not per value).
"""
from __future__ import annotations

import math

from minigraph.kernels.cuda import launch, loader

MODULE = "bn_rows"
FINISH_LOADS = 8            # partials a finishing thread reads, at most, where TX allows
ROW_BYTES = 64              # bytes of a row a warp reads together, at least (HBM's access)
SIGNATURES = {}
for _t, _ws in (("f32", (1, 4)), ("f64", (1, 2))):
    for _w in _ws:
        SIGNATURES.update({
            f"bn_rows_normalize_{_t}_w{_w}": "PPqqPiPPPPPIi",
            f"bn_rows_infer_{_t}_w{_w}": "PPqqPPPPdi",
            f"bn_rows_dx_{_t}_w{_w}": "PPPqqPiPPi",
        })


def pack_width(channels, itemsize, aligned):
    """Values per 16-byte pack of a rows pass: across channels, when every pointer is
    aligned and the channels fill whole packs; else 1."""
    vec = launch.vector_width(itemsize)
    return vec if aligned and channels % vec == 0 else 1


def reduce_plan(rows, channels, itemsize, aligned, dev, res=None):
    """The launch.ReducePlan ("rows") of a per-channel reduction of a (rows, channels)
    tensor (see the module doc for how TX is chosen)."""
    res = launch.KernelResources() if res is None else res
    width = pack_width(channels, itemsize, aligned)
    cv = channels // width
    threads = launch.block_threads(dev, launch.ROW_THREADS)
    tx = min(32, 1 << max(0, math.ceil(math.log2(max(cv, 1)))))
    narrowest = min(tx, max(1, ROW_BYTES // (width * itemsize)))
    while True:
        ty = threads // tx
        groups = math.ceil(cv / tx)
        chunk, splits = launch._splits(rows, groups, dev, threads, ty, res, 1)
        if math.ceil(splits / (ty // width)) <= FINISH_LOADS or tx <= narrowest:
            break
        tx //= 2
    return launch.ReducePlan("rows", width, (groups, splits, 1), (tx, ty, 1), chunk, splits,
                             groups)


def _apply_go(name, rows, channels, width, fmt_key):
    """The prepared launch of bn_rows.cu's `name` over a (rows, channels) tensor,
    memoised per device."""
    gos = loader.cached("bn_rows.go", dict)
    key = (name, rows, channels, fmt_key)
    go = gos.get(key)
    if go is None:
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        dev = loader.device()
        cv = channels // width
        threads = launch.block_threads(dev, launch.ROW_THREADS)
        tx = min(32, 1 << max(0, math.ceil(math.log2(max(cv, 1)))))
        ty = threads // tx
        across = math.ceil(cv / tx)
        resident = dev.sm_count * launch.blocks_per_sm(dev, threads, k.resources)
        down = max(1, min(math.ceil(rows / ty), max(1, resident // across), dev.max_grid[1]))
        go = gos[key] = k.prepared((across, down, 1), (tx, ty, 1))
    return go


def _name(stem, dtype, width):
    return f"{stem}_{loader.suffix(dtype)}_w{width}"


def normalize(x, xp, yp, channels, coef, commit, est_mean, est_var, newest, counter, status,
              epoch, relu):
    """y = (x - m) k + b (ReLU when `relu`) with (m, k, b) per channel at `coef` (3C),
    committing the estimates and the counter as bn_normalize does (all addresses)."""
    rows = x.size // channels if channels else 0
    width = pack_width(channels, x.dtype.itemsize, not (xp % 16 or yp % 16))
    _apply_go(_name("bn_rows_normalize", x.dtype, width), rows, channels, width, x.dtype)(
        xp, yp, rows, channels, coef, int(commit), est_mean, est_var, newest, counter, status,
        epoch, int(bool(relu)))


def infer(x, xp, yp, channels, mp, vp, sp, bp, eps, relu):
    """y = (x - mean) / sqrt(var + eps) * scale + bias (ReLU when `relu`) from the
    estimates, each thread's coefficients computed once (all addresses)."""
    rows = x.size // channels if channels else 0
    aligned = not (xp % 16 or yp % 16)
    width = pack_width(channels, x.dtype.itemsize, aligned)
    _apply_go(_name("bn_rows_infer", x.dtype, width), rows, channels, width, x.dtype)(
        xp, yp, rows, channels, mp, vp, sp, bp, float(eps), int(bool(relu)))


def dx(x, xp, dyp, dxp, channels, coef, use_x, yp=0, bits=0, shift=0):
    """dx = (x - m) kx + kc + dy kd (use_x False: dy kd) with the coefficients at `coef`
    (4C); dy masked by `bits` (bytes of 2^shift values) or y > 0 (yp) when given."""
    rows = x.size // channels if channels else 0
    pointers = (dyp, dxp) + ((xp,) if use_x else ()) + ((yp,) if yp and not bits else ())
    width = pack_width(channels, x.dtype.itemsize, not any(p % 16 for p in pointers))
    _apply_go(_name("bn_rows_dx", x.dtype, width), rows, channels, width, x.dtype)(
        xp if use_x else 0, dyp, dxp, rows, channels, coef, int(bool(use_x)), yp, bits,
        int(shift))


def mask_bytes(x, width):
    """Bytes of the ReLU mask a reduction of packs of `width` values writes for x."""
    return -(-x.size // width)
