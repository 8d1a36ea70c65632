"""Launchers of kernels/cuda/bn_resident.cu: batch norm on NCHW tensors with small
planes, each channel group resident in shared memory - one launch per pass, x (and dy)
read once.

    train     statistics (exact, two passes over shared memory), y (ReLU optional),
              the estimates and the counter committed by the last CTA unless the
              batch was flagged: 2x the tensor's bytes moved instead of 3x.
    backward  x and dy (and y for the ReLU mask) resident: dscale, dbias and dx,
              3x (4x with the mask) instead of 5x.

`plan` decides where this applies: NCHW with more than one value per plane
(post > 1), a channel's values (x, or x and dy, and y) fit in the block's shared
memory, and there are channels for at least half of the multiprocessors. One CTA of
THREADS threads per multiprocessor; G channels per group, chosen so that the busiest
CTA moves the fewest bytes; with more groups than CTAs the next group is loaded
into a second buffer while the current one is worked on (when two buffers fit).
Past 48 KiB a kernel's shared memory needs its function attribute raised
(loader.Kernel.allow_shared), which the launches here do.

Everything else (the checks, the Guard, the scratch for the coefficients and the
candidate estimates) is kernels/cuda/batch_norm.py's; batch_norm.forward_train and
batch_norm_grad.backward call these when `plan` says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minigraph.kernels.cuda import batch_norm as bn
from minigraph.kernels.cuda import launch, loader

MODULE = "bn_resident"
THREADS = 1024                # threads of a CTA (the kernels' __launch_bounds__ agrees)
STATIC_RESERVE = 1024         # bytes of a block's shared memory kept for its static variables
MIN_CHANNEL_SHARE = 0.5       # channels per multiprocessor below which the split kernels win
SINGLE_BUFFER_PENALTY = 1.5   # cost of a group whose copies are not overlapped with work
ENABLED = True                # False: every shape takes the split kernels (tests compare them)

SIGNATURES = {}
for _t, _ws in (("f32", (1, 4)), ("f64", (1, 2))):
    for _w in _ws:
        SIGNATURES[f"bn_resident_train_{_t}_w{_w}"] = "PPqqiiqiiiP" + bn.STATS_TAIL
        SIGNATURES[f"bn_resident_grad_{_t}_w{_w}"] = "PPPPqqiiqiiPPPdiPP"


@dataclass(frozen=True)
class ResidentPlan:
    """A launch of bn_resident.cu: `groups` groups of `channels` channels (the last may
    have fewer), row stride `row` values, `buffers` buffers of `planes` planes,
    `ctas` CTAs of `threads` threads with `shared` bytes of dynamic shared memory
    each, packs of `width` values."""

    channels: int
    groups: int
    row: int
    buffers: int
    planes: int
    ctas: int
    threads: int
    shared: int
    width: int


def row_stride(channels, post, width):
    """Values a group's run of a sample takes in shared memory: its channels' values
    plus up to width - 1 before them (the run's place in its first pack), in packs."""
    return math.ceil((channels * post + width - 1) / width) * width


def shared_bytes(pre, channels, post, width, itemsize, threads, planes, buffers):
    """Bytes of dynamic shared memory a CTA needs (bn_resident.cu's layout: partial sums,
    coefficients, the channel of each column, the buffers)."""
    columns = channels * post
    table = columns * 2 if columns <= threads else 0
    return (2 * threads * 8 + 4 * channels * itemsize + math.ceil(table / 16) * 16
            + buffers * planes * pre * row_stride(channels, post, width) * itemsize)


def plan(pre, channels, post, itemsize, aligned, dev, planes):
    """The ResidentPlan of a pass over an NCHW tensor viewed as (pre, channels, post),
    `planes` tensors resident (1: training forward; 2: backward; 3: backward with the
    ReLU mask's y); None where the resident kernels do not apply (see the module doc)."""
    if not ENABLED or post <= 1 or pre * post == 0 or channels < 1:
        return None
    if channels < MIN_CHANNEL_SHARE * dev.sm_count:
        return None
    width = launch.vector_width(itemsize) if aligned else 1
    threads = launch.block_threads(dev, THREADS)
    budget = dev.shared_per_block_optin - STATIC_RESERVE
    most = 1 if post > threads else min(channels, threads // post)
    best = None
    for buffers in (1, 2):
        for g in range(1, most + 1):
            need = shared_bytes(pre, g, post, width, itemsize, threads, planes, buffers)
            if need > budget:
                break
            groups = math.ceil(channels / g)
            ctas = min(groups, dev.sm_count)
            rounds = math.ceil(groups / ctas)
            if buffers == 2 and rounds == 1:
                break
            cost = g * rounds * (SINGLE_BUFFER_PENALTY if buffers == 1 and rounds > 1 else 1)
            key = (cost, rounds, -g)
            if best is None or key < best[0]:
                best = (key, ResidentPlan(g, groups, row_stride(g, post, width), buffers,
                                          planes, ctas, threads, need, width))
    return None if best is None else best[1]


def cached_plan(x, pre, channels, post, aligned, planes):
    """plan() for x on the current device, memoised per device."""
    plans = loader.cached("bn_resident.plans", dict)
    key = (pre, channels, post, x.dtype, aligned, planes, ENABLED, THREADS)
    if key not in plans:
        plans[key] = plan(pre, channels, post, x.dtype.itemsize, aligned, loader.device(), planes)
    return plans[key]


def _go(stem, dtype, p):
    """The prepared launch of `stem` for `p` (its shared-memory limit raised first)."""
    gos = loader.cached("bn_resident.go", dict)
    key = (stem, dtype, p)
    go = gos.get(key)
    if go is None:
        k = bn_kernel(f"{stem}_{loader.suffix(dtype)}_w{p.width}")
        k.allow_shared(p.shared)
        go = gos[key] = k.prepared((p.ctas, 1, 1), (p.threads, 1, 1), p.shared)
    return go


def bn_kernel(name):
    return loader.kernel(MODULE, name, SIGNATURES[name])


def train(p, run, pre, channels, post, relu):
    """The training forward of bn_resident.cu for plan `p` on `run` (a
    batch_norm._Training): y, the statistics, the coefficients and candidate
    estimates in run's scratch, and the commit. Returns what run.normalize returns."""
    tickets = loader.address(loader.tickets(1))
    _go("bn_resident_train", run.x.dtype, p)(
        run.xp, run.yp, pre, channels, post, p.channels, p.groups, p.row, p.buffers,
        int(bool(relu)), tickets, *run.stats_args)
    return run.y, run.batch_mean, run.batch_var


def grad(p, x, pointers, pre, channels, post, params, eps, use_global):
    """The backward of bn_resident.cu for plan `p`: pointers (x, dy, y or 0, dx or 0),
    params (scale, mean, var, dscale or 0, dbias or 0) as device addresses."""
    xp, dyp, yp, dxp = pointers
    sp, mp, vp, dsp, dbp = params
    _go("bn_resident_grad", x.dtype, p)(
        xp, dyp, yp, dxp, pre, channels, post, p.channels, p.groups, p.row, p.buffers, sp, mp,
        vp, float(eps), int(bool(use_global)), dsp, dbp)
