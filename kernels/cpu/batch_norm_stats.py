"""The numerics of batch norm on the CPU: statistics, normalisation and gradient sums.

Plain functions on (rows, channels, inner) views of x (`as_3d`). Each runs the
native kernels of bn_native where they apply (float32/float64, C-contiguous,
built), else the numpy engine here, the reference they are tested against: the
blocked, threaded engine of minigraph.kernels.cpu.blocks, where every statistic
reduces over axes 0 and 2 in one read of x. `stats_and_normalize` and
`grad_sums_and_input_grad` fuse two passes (native kernels only).

Statistics are stable on offset data: sums are taken of x minus a per-channel
shift near the mean, and x is centred before it is scaled when |mean| > std
(the native kernels always centre on the mean rounded to x's dtype). On the
numpy engine, arrays of at most SMALL_VALUES values take plain float64 numpy
(less overhead). float16 works in float32 (`as_work`).

batch_norm_relu: `relu=True` makes the normalisation's output max(y, 0) (relu's
values: blocks.relu), and `mask3` - its forward output y - makes the gradient
functions count dy only where y > 0 (relu's gradient).

Not an op module: it registers nothing (ops/batch_norm.py and
ops/sync_batch_norm.py hold the drivers and the registration).
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import blocks, bn_native
from minigraph.kernels.cpu.blocks import plan_for, run_blocks

SHIFT_VALUES = 256             # values per channel that pick the shift of the statistics
SMALL_VALUES = 1 << 14         # arrays this small take plain float64 numpy (less overhead)


def as_3d(x, layout):
    """View x as (rows, C, inner) so every statistic reduces over axes 0 and 2."""
    if layout == "NCHW":
        return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))  # 0 rows too
    return x.reshape(-1, x.shape[-1], 1)


def as_work(a):
    """`a` C-contiguous in the dtype the kernels compute in (float16 -> float32)."""
    if a.dtype == np.float16:
        return a.astype(np.float32)
    return np.ascontiguousarray(a)


def local_stats(x3):
    """(n, mean, M2) per channel of x3 (R, C, I) in float64, over axes 0 and 2.

    One read of x, the shifted-data algorithm: the sums are of d = x - shift with
    a per-channel shift near the mean, so M2 = Σd² - (Σd)²/n keeps its digits
    on offset data. The shift is the mean of the first values of each channel, or 0
    when every channel's first values have |mean| <= std (x is then centred
    enough as it is, and the subtraction is skipped). A shape with no values
    gives n = 0 and zeros (a rank holding no rows of a synced batch)."""
    x3 = as_work(x3)
    done = bn_native.local_stats(x3)
    if done is not None:
        return done
    R, C, I = x3.shape
    n = R * I
    if n == 0:
        return 0, np.zeros(C), np.zeros(C)
    if x3.size <= SMALL_VALUES:                        # two passes in float64
        with np.errstate(invalid="ignore", over="ignore"):
            xd = x3.astype(np.float64)
            mean = xd.sum(axis=(0, 2)) / n
            d = xd - mean[:, None]
            return n, mean, np.einsum("rci,rci->c", d, d)
    head = x3[:-(-SHIFT_VALUES // I), :, :SHIFT_VALUES].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        shift = head.mean(axis=(0, 2))
        spread = ((head - shift[:, None]) ** 2).mean(axis=(0, 2))
        centre = not bool(np.all(shift * shift <= spread))
    shift = shift.astype(x3.dtype).astype(np.float64) if centre else np.zeros(C)
    plan = plan_for(x3)
    shift_row = plan.expand(shift, x3.dtype) if centre else None   # laid out like a block
    xs = plan.bases(x3)

    s1, s2 = plan.new_sums(x3.dtype), plan.new_sums(x3.dtype)

    def part(blocks):
        buf = np.empty(plan.block_elems, x3.dtype)   # one block's work, per thread
        with np.errstate(invalid="ignore", over="ignore"):     # the caller checks the result
            for blk in blocks:
                xb = plan.view(xs, blk)
                d = buf[:xb.size].reshape(xb.shape)
                if shift_row is not None:
                    xb = np.subtract(xb, plan.const(shift_row, blk), out=d)
                plan.add_sums(s1, blk, xb)
                plan.add_dots(s2, blk, xb, xb, d)

    run_blocks(part, plan)
    with np.errstate(invalid="ignore", over="ignore"):
        s1, s2 = plan.fold(s1), plan.fold(s2)
        mean = shift + s1 / n
        m2 = np.maximum(s2 - s1 * (s1 / n), 0.0)
    return n, mean, m2


def stats_and_normalize(x3, eps, scale, bias, out3, relu=False):
    """The training forward in one pass per channel: (n, mean, M2) as `local_stats`
    and out3 = (x - mean) / sqrt(M2 / n + eps) * scale + bias (float64 scale and bias;
    max(out3, 0) with relu), each channel normalised while it is in cache; None
    (nothing written) where the native kernels do not apply: then call local_stats and
    normalize."""
    return bn_native.local_stats(as_work(x3), eps, scale, bias, out3, relu)


def relu_masked(dy3, mask3):
    """dy3 where mask3 > 0, else 0 (relu's gradient), as a new array; dy3 itself when
    mask3 is None."""
    if mask3 is None:
        return dy3
    return np.where(mask3 > 0, dy3, np.zeros((), dy3.dtype))


def grad_sums_and_input_grad(x3, dy3, mean, invstd, scale, out3, mask3=None):
    """The training backward in one pass per channel: (n, Σdy, Σdy·(x−mean)) as
    `grad_sums` and out3 = dx = scale invstd (dy - Σdy / n - (x - mean) invstd² Σdy·(x−mean)
    / n) (float64 per-channel arguments; out3 may be dy3; dy masked by mask3 > 0 when
    given), each channel's dx written while it is in cache; None (nothing written) where
    the native kernels do not apply: then call grad_sums and input_grad."""
    return bn_native.grad_sums(as_work(x3), as_work(dy3), mean, invstd, scale, out3,
                               None if mask3 is None else as_work(mask3))


def centring_needed(mean, invstd):
    """Whether x must be centred before scaling: when |mean| > std in a channel,
    x * k + c would lose digits that (x - mean) * k + c keeps."""
    return not bool(np.all(np.abs(mean) * invstd <= 1.0))


def normalize(x3, mean, invstd, scale, bias, out3, relu=False):
    """out3 = (x - mean) * invstd * scale + bias per channel (float64 arguments), then
    max(out3, 0) with relu; out3 is C-contiguous in x's work dtype. Offset data is
    centred first; otherwise x * k + c, one step fewer."""
    x3 = as_work(x3)
    k = invstd * scale
    if bn_native.normalize(x3, mean, k, bias, out3, relu):
        return
    _normalize_numpy(x3, mean, invstd, k, bias, out3)
    if relu:
        blocks.relu(out3, out=out3)


def _normalize_numpy(x3, mean, invstd, k, bias, out3):
    if x3.size <= SMALL_VALUES:
        out3[...] = (x3 - mean[:, None]) * k[:, None] + bias[:, None]
        return
    plan = plan_for(x3)
    dt = x3.dtype
    if centring_needed(mean, invstd):           # the *_row constants are laid out like a block
        m = mean.astype(dt)
        mean_row = plan.expand(m, dt)
        bias_row = plan.expand(bias - (mean - m) * k, dt)
    else:
        mean_row = None
        bias_row = plan.expand(bias - mean * k, dt)
    k_row = plan.expand(k, dt)
    xs, outs = plan.bases(x3), plan.bases(out3)

    def part(blocks):
        for blk in blocks:
            xb, o = plan.view(xs, blk), plan.view(outs, blk)
            if mean_row is None:
                np.multiply(xb, plan.const(k_row, blk), out=o)
            else:
                np.subtract(xb, plan.const(mean_row, blk), out=o)
                o *= plan.const(k_row, blk)
            o += plan.const(bias_row, blk)

    run_blocks(part, plan)


def grad_sums(x3, dy3, mean, invstd=None, mask3=None):
    """(n, Σdy, Σdy·(x−mean)) per channel of (R, C, I) arrays, in float64 (dy counting
    only where mask3 > 0 when given).

    x is centred on mean (rounded to x's dtype, then corrected exactly), unless
    `invstd` is given and shows |mean| <= std in every channel: then
    Σdy·x − mean·Σdy is as accurate and one step cheaper."""
    x3, dy3 = as_work(x3), as_work(dy3)
    mask3 = None if mask3 is None else as_work(mask3)
    done = bn_native.grad_sums(x3, dy3, mean, mask3=mask3)
    if done is not None:
        return done
    dy3 = relu_masked(dy3, mask3)
    R, C, I = x3.shape
    n = R * I
    if n == 0:
        return 0, np.zeros(C), np.zeros(C)
    if x3.size <= SMALL_VALUES:
        gd = dy3.astype(np.float64)
        return n, gd.sum(axis=(0, 2)), np.einsum("rci,rci->c", gd, x3 - mean[:, None])
    plan = plan_for(x3)
    centred = invstd is None or centring_needed(mean, invstd)
    shift = mean.astype(x3.dtype).astype(np.float64) if centred else np.zeros(C)
    shift_row = plan.expand(shift, x3.dtype) if centred else None   # laid out like a block
    xs, dys = plan.bases(x3), plan.bases(dy3)

    s_dy, s_dyx = plan.new_sums(x3.dtype), plan.new_sums(x3.dtype)

    def part(blocks):
        buf = np.empty(plan.block_elems, x3.dtype)   # one block's work, per thread
        for blk in blocks:
            xb, gb = plan.view(xs, blk), plan.view(dys, blk)
            d = buf[:xb.size].reshape(xb.shape)
            if shift_row is not None:
                xb = np.subtract(xb, plan.const(shift_row, blk), out=d)
            plan.add_dots(s_dyx, blk, xb, gb, d)
            plan.add_sums(s_dy, blk, gb)

    run_blocks(part, plan)
    s_dy, s_dyx = plan.fold(s_dy), plan.fold(s_dyx)
    return n, s_dy, s_dyx - s_dy * (mean - shift)


def input_grad(x3, dy3, mean, k_dy, k_x, k_c, out3, centre=True, mask3=None):
    """out3 = k_dy*dy + k_x*(x - mean) + k_c per channel (float64 arguments), or
    k_dy*dy when k_x is None, dy counting only where mask3 > 0 when given; out3 is
    C-contiguous in x's work dtype, and may be dy3. With centre=False (|mean| <= std) it
    is computed as k_dy*dy + k_x*x + c."""
    x3, dy3 = as_work(x3), as_work(dy3)
    mask3 = None if mask3 is None else as_work(mask3)
    if bn_native.input_grad(x3, dy3, mean, k_dy, k_x, k_c, out3, mask3):
        return
    dy3 = relu_masked(dy3, mask3)
    if x3.size <= SMALL_VALUES:
        dx = dy3 * k_dy[:, None]
        if k_x is not None:
            dx += (x3 - mean[:, None]) * k_x[:, None] + k_c[:, None]
        out3[...] = dx
        return
    plan = plan_for(x3)
    dt = x3.dtype
    k_dy_row = plan.expand(k_dy, dt)            # the *_row constants are laid out like a block
    if k_x is None:
        mean_row = k_x_row = k_c_row = None
    elif centre:
        m = mean.astype(dt)
        mean_row, k_x_row, k_c_row = (plan.expand(v, dt)
                                      for v in (m, k_x, k_c - k_x * (mean - m)))
    else:
        mean_row = None
        k_x_row, k_c_row = plan.expand(k_x, dt), plan.expand(k_c - k_x * mean, dt)
    xs, dys, outs = plan.bases(x3), plan.bases(dy3), plan.bases(out3)

    def part(blocks):
        buf = np.empty(plan.block_elems, dt)   # one block's work, per thread
        for blk in blocks:
            gb, o = plan.view(dys, blk), plan.view(outs, blk)
            if k_x_row is None:
                np.multiply(gb, plan.const(k_dy_row, blk), out=o)
                continue
            xb = plan.view(xs, blk)
            t = buf[:xb.size].reshape(xb.shape)
            np.multiply(gb, plan.const(k_dy_row, blk), out=t)    # first: o may be dy's
            if mean_row is None:
                np.multiply(xb, plan.const(k_x_row, blk), out=o)
            else:
                np.subtract(xb, plan.const(mean_row, blk), out=o)
                o *= plan.const(k_x_row, blk)
            o += plan.const(k_c_row, blk)
            o += t

    run_blocks(part, plan)
