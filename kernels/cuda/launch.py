"""Launch configurations, derived from shapes and device properties.

Pure Python (no pycuda): every grid and block the launchers use comes from
here, computed from a `DeviceInfo` (multiprocessor count, thread and register
limits, grid limits) and the kernel's own resource use, never from numbers
tuned for one GPU. The tests check these on the CPU with made-up devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

THREADS = 256                 # threads of a 1-D block (elementwise, planar reductions)
ROW_THREADS = 256             # threads of a 2-D row block; kernels/cuda/common.cuh agrees
MIN_UNITS_PER_THREAD = 8      # a reduction block gives each thread at least this many packs
MAX_BLOCK_VALUES = 1 << 22    # values per channel per block: float counts stay exact
MAX_SPLITS = 1024             # splits per channel, unless MAX_BLOCK_VALUES needs more
VECTOR_BYTES = 16             # a pack: float x4, double x2


@dataclass(frozen=True)
class DeviceInfo:
    """What a launch configuration depends on, read off the device."""

    name: str
    compute_capability: tuple
    sm_count: int
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536
    shared_per_sm: int = 228 * 1024
    shared_per_block_optin: int = 227 * 1024    # dynamic shared memory a block may opt in to
    max_grid: tuple = (2**31 - 1, 65535, 65535)
    total_memory: int = 80 * 2**30

    @property
    def arch(self):
        """The nvcc target of this device, e.g. 'sm_90'."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel resource use (from the compiled function's attributes)."""

    regs_per_thread: int = 32
    shared_bytes: int = 0


def blocks_per_sm(dev, threads, res=KernelResources()):
    """How many blocks of `threads` threads fit on one multiprocessor at once."""
    warps = math.ceil(threads / 32)
    by_threads = dev.max_threads_per_sm // (warps * 32)
    regs_per_warp = math.ceil(max(res.regs_per_thread, 1) * 32 / 256) * 256
    by_regs = dev.regs_per_sm // (regs_per_warp * warps)
    by_shared = dev.shared_per_sm // res.shared_bytes if res.shared_bytes else dev.max_blocks_per_sm
    return max(1, min(by_threads, by_regs, by_shared, dev.max_blocks_per_sm))


def check_array(what, array, shape, dtype):
    """ValueError unless `array` has exactly `shape` and `dtype` (kernels index
    by the expected shape: a mismatch would read or write out of bounds) and is
    C-contiguous."""
    if tuple(array.shape) != tuple(shape) or np.dtype(array.dtype) != np.dtype(dtype):
        raise ValueError(f"{what} must be {np.dtype(dtype)} of shape {tuple(shape)}, got "
                         f"{np.dtype(array.dtype)}{tuple(array.shape)}")
    check_contiguous(what, array)


def check_contiguous(what, *arrays):
    """ValueError naming `what` (and the array's place among `arrays` when there
    are several) unless every array (None skipped) is C-contiguous: the kernels
    read arrays as contiguous."""
    for i, a in enumerate(arrays):
        flags = getattr(a, "flags", None)
        if flags is not None and not flags.c_contiguous:
            which = f"{what} (array {i})" if len(arrays) > 1 else what
            raise ValueError(f"{which}: a {np.dtype(a.dtype)}{tuple(a.shape)} device array with "
                             f"strides {tuple(getattr(a, 'strides', ()))} is not C-contiguous; "
                             "the GPU kernels read arrays as contiguous (copy it)")


def vector_width(itemsize):
    """Elements of one 16-byte pack."""
    return VECTOR_BYTES // itemsize


def is_aligned(*pointers):
    """True when every device pointer is 16-byte aligned (pack loads allowed)."""
    return all(int(p) % VECTOR_BYTES == 0 for p in pointers)


def block_threads(dev, wanted=THREADS):
    """A 1-D block size: `wanted`, capped by the device, a multiple of 32."""
    return max(32, min(wanted, dev.max_threads_per_block) // 32 * 32)


def flat_grid(units, dev, threads=THREADS, res=KernelResources(), at_least=1):
    """Blocks of a grid-stride loop over `units` work items: enough to cover
    them, at most what is resident on the whole device at once (one wave), and
    at least enough for `at_least` threads."""
    need = max(math.ceil(units / threads), math.ceil(at_least / threads), 1)
    resident = dev.sm_count * blocks_per_sm(dev, threads, res)
    return min(max(min(need, resident), math.ceil(at_least / threads)), dev.max_grid[0])


def channel_view(shape, layout):
    """(pre, C, post) of a tensor whose channel axis is 1 (NCHW) or last (NHWC);
    statistics reduce over pre and post."""
    shape = tuple(int(d) for d in shape)
    if layout == "NCHW":
        return shape[0], shape[1], math.prod(shape[2:])
    if layout == "NHWC":
        return math.prod(shape[:-1]), shape[-1], 1
    raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")


@dataclass(frozen=True)
class ReducePlan:
    """A per-channel reduction of a (pre, C, post) tensor.

    kind "planar" (post > 1): grid (C, splits), 1-D blocks, `post_v` packs of
    `width` per row. kind "rows" (post == 1): grid (groups, splits), 2-D blocks
    (tx, ty) with tx threads across channels (each `width` channels wide).
    Each split covers `chunk` units (packs for planar, rows for rows).
    """

    kind: str
    width: int
    grid: tuple
    block: tuple
    chunk: int
    splits: int
    groups: int
    post_v: int = 1

    @property
    def tickets(self):
        """Last-block tickets the kernel uses (one per channel or channel group)."""
        return self.groups

    @property
    def split_args(self):
        """The kernel arguments that describe the split, after (x..., pre, channels):
        (post_v, chunk, splits) for planar kernels, (chunk, splits) for rows kernels."""
        if self.kind == "planar":
            return (self.post_v, self.chunk, self.splits)
        return (self.chunk, self.splits)


def _splits(units, parallel, dev, threads, lanes, res, values_per_unit):
    """(chunk, splits) of one channel's `units`: `parallel` x splits blocks of
    `threads` threads fill the device, each of the `lanes` threads that share a
    split gets >= MIN_UNITS_PER_THREAD units, and no block sees more than
    MAX_BLOCK_VALUES values of a channel."""
    if units == 0:
        return 1, 1
    resident = dev.sm_count * blocks_per_sm(dev, threads, res)
    lo = max(1, math.ceil(units * values_per_unit / MAX_BLOCK_VALUES))
    hi = max(lo, min(max(1, units // (lanes * MIN_UNITS_PER_THREAD)), MAX_SPLITS))
    splits = best_splits(parallel, resident, lo, hi)
    chunk = math.ceil(units / splits)
    splits = math.ceil(units / chunk)
    if splits > dev.max_grid[1]:
        raise ValueError(f"reduction of {units} units per channel needs {splits} splits, "
                         f"more than the device's grid limit {dev.max_grid[1]}")
    return chunk, splits


def wave_use(blocks, resident):
    """The share of the launched waves' block slots that `blocks` blocks use."""
    return blocks / (math.ceil(blocks / resident) * resident)


def best_splits(parallel, resident, lo, hi):
    """Splits in [lo, hi] for `parallel` independent reductions: the fewest whose
    wave use is within 5% of the best (full waves, no mostly-empty last wave)."""
    top = min(hi, max(lo, 4 * math.ceil(resident / parallel)))
    uses = {s: wave_use(parallel * s, resident) for s in range(lo, top + 1)}
    best = max(uses.values())
    return min(s for s, u in uses.items() if u >= 0.95 * best)


_plans = {}
PLAN_CACHE_SIZE = 4096


def tunables():
    """The module constants every plan depends on (part of plan cache keys)."""
    return MIN_UNITS_PER_THREAD, MAX_BLOCK_VALUES, MAX_SPLITS


def reduce_plan(pre, channels, post, itemsize, aligned, dev, res=KernelResources()):
    """The ReducePlan for a (pre, channels, post) tensor of `itemsize`-byte
    values; `aligned`: the data pointers allow 16-byte packs. Memoised on all
    of that (launches ask for the same few plans every step)."""
    key = (pre, channels, post, itemsize, aligned, id(dev), res.regs_per_thread,
           res.shared_bytes, tunables())
    found = _plans.get(key)
    if found is not None and found[0] is dev:
        return found[1]
    plan = _reduce_plan(pre, channels, post, itemsize, aligned, dev, res)
    if len(_plans) >= PLAN_CACHE_SIZE:
        _plans.clear()
    _plans[key] = (dev, plan)          # holding dev keeps its id from being reused
    return plan


def _reduce_plan(pre, channels, post, itemsize, aligned, dev, res):
    vec = vector_width(itemsize)
    if post > 1:
        width = vec if aligned and post % vec == 0 else 1
        post_v = post // width
        threads = block_threads(dev)
        if channels > dev.max_grid[0]:
            raise ValueError(f"{channels} channels exceed the device's grid limit")
        chunk, splits = _splits(pre * post_v, channels, dev, threads, threads, res, width)
        return ReducePlan("planar", width, (channels, splits, 1), (threads, 1, 1), chunk, splits,
                          channels, post_v)
    width = vec if aligned and channels % vec == 0 else 1
    cv = channels // width
    tx = min(32, 1 << max(0, math.ceil(math.log2(max(cv, 1)))))
    ty = block_threads(dev, ROW_THREADS) // tx
    groups = math.ceil(cv / tx)
    chunk, splits = _splits(pre, groups, dev, tx * ty, ty, res, 1)
    return ReducePlan("rows", width, (groups, splits, 1), (tx, ty, 1), chunk, splits, groups)


def row_block_threads(row_length, dev):
    """Threads of a one-block-per-row kernel: a power of two in [32, 256]
    covering the row when it is short."""
    want = 1 << max(5, math.ceil(math.log2(max(row_length, 1))))
    return block_threads(dev, min(want, 256))


def rows_grid(rows, threads, dev, res=KernelResources()):
    """Blocks of a one-block-per-row kernel that strides over `rows` rows."""
    return max(1, min(rows, dev.sm_count * blocks_per_sm(dev, threads, res), dev.max_grid[0]))


GEMM_TILE = 64          # output tile of kernels/cuda/matmul.cu (rows and columns)
GEMM_THREADS = 256


def gemm_launches(m, n, batches, dev):
    """[(row offset, rows, batch offset, batches, grid)]: the launches that cover
    an m x n output (times `batches`) within the device's grid limits."""
    if m <= 0 or n <= 0 or batches <= 0:
        return []
    gx = math.ceil(n / GEMM_TILE)
    if gx > dev.max_grid[0]:
        raise ValueError(f"matrix product with {n} columns exceeds the device's grid limit")
    rows_per = dev.max_grid[1] * GEMM_TILE
    out = []
    for r0 in range(0, m, rows_per):
        rows = min(rows_per, m - r0)
        for b0 in range(0, batches, dev.max_grid[2]):
            nb = min(dev.max_grid[2], batches - b0)
            out.append((r0, rows, b0, nb, (gx, math.ceil(rows / GEMM_TILE), nb)))
    return out


COLS_BUDGET = 256 * 2**20   # bytes of im2col columns per conv2d chunk (at most)


def conv_chunk(images, col_bytes_per_image, groups, dev):
    """Images per conv2d chunk: the columns fit COLS_BUDGET (and 1/8 of device
    memory), and chunk x groups batched products fit the grid's z limit."""
    budget = min(COLS_BUDGET, dev.total_memory // 8)
    nb = max(1, budget // max(col_bytes_per_image, 1))
    nb = min(nb, max(1, dev.max_grid[2] // groups), max(images, 1))
    return nb
