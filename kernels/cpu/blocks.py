"""The blocked, multi-threaded CPU engine for per-channel work on (rows, channels, inner) arrays.

A kernel views its input as a C-contiguous array x3 of shape (rows, channels,
inner) - per-channel statistics then reduce over axes 0 and 2 - and asks
`plan_for(x3)` for a plan: a list of `Block`s that cover x3's memory once, in
cache-sized pieces. Each pass reads x (and any sibling array of the same
shape) from memory once and does all of its arithmetic on one block at a
time. Per-channel constants are laid out to match a block (`plan.expand`), so
every ufunc runs over long contiguous rows. Sums go through BLAS
matrix-vector products with a vector of ones (or einsum for dot products): in
x's dtype inside one block, in float64 across blocks (`plan.fold`). Every
block stores its sums in its own slot, so results do not depend on the
number of threads.

`run_blocks(body, plan)` runs body(blocks) on `plan.workers` threads that take
blocks from one shared iterator; numpy releases the GIL while it works.

Threads: `set_num_threads(n)` (exported as `minigraph.set_num_threads`) sets
the engine's threads and numpy's BLAS threads; the default is the number of
CPUs this process may run on, and BLAS is left alone until it is called.
"""
from __future__ import annotations

import contextlib
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import NamedTuple

import numpy as np
import threadpoolctl

CHUNK_BYTES = 1 << 20          # work on x in cache-sized blocks
# Smaller arrays stay on the calling thread (a threshold measured in whole training
# steps while OpenBLAS's workers still spun after each product).
PARALLEL_MIN_BYTES = 1 << 22
MIN_UNIT = 2048                # short rows are grouped into units of at least this many values
MIN_INNER = 16                 # shorter inner axes (NHWC: 1) sum over rows, not along them
MAX_DOT = 8192                 # longest row whose dot products go through einsum
ZEROS_SIZE = 1 << 16           # relu compares with this many zeros at a time
SMALL_RELU = 8192               # smaller arrays: numpy's scalar loop costs less than the calls

if hasattr(os, "sched_getaffinity"):
    _threads = len(os.sched_getaffinity(0))
else:
    _threads = os.cpu_count() or 1
_cap = threading.local()       # .n: the op's own thread count (cap_threads), per thread
_pool = None
_pool_lock = threading.Lock()
_ones_cache = {}
_zeros_cache = {}
_plans = {}


def _forget_pool():
    """After a fork the pool's threads are gone: start a fresh pool when needed."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def set_num_threads(n):
    """Use `n` threads (an integer >= 1) in minigraph's CPU kernels and in numpy's
    BLAS (through threadpoolctl, kept in effect until the next call). A bad `n`
    is a ValueError and changes nothing."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"set_num_threads: expected an integer >= 1 (threads for the CPU "
                         f"kernels and numpy's BLAS), got {n!r}")
    _set_engine_threads(int(n))
    threadpoolctl.threadpool_limits(limits=int(n), user_api="blas")    # not a with: it stays


def _set_engine_threads(n):
    global _threads, _pool
    with _pool_lock:
        if n != _threads:
            old, _pool, _threads = _pool, None, n
            if old is not None:
                old.shutdown(wait=False)


@contextlib.contextmanager
def num_threads(n):
    """set_num_threads(n) inside a with-block; afterwards the engine's and BLAS's
    threads are what they were."""
    old = _threads
    with threadpoolctl.threadpool_limits(limits=None, user_api="blas"):
        set_num_threads(n)
        try:
            yield
        finally:
            _set_engine_threads(old)


def get_num_threads():
    """The number of threads minigraph's CPU kernels use (on this thread, at most what
    cap_threads set for the op running now)."""
    cap = getattr(_cap, "n", None)
    return _threads if cap is None else min(_threads, cap)


def cap_threads(n):
    """Run this thread's next kernels on at most `n` threads (None: no cap); a training
    step sets each op's own count (minigraph.op_threads)."""
    _cap.n = n


def threads_for(values, per_thread):
    """The threads a pass over `values` values runs on: at most get_num_threads(), at
    least 1, one per `per_thread` values."""
    return max(1, min(get_num_threads(), values // per_thread))


def run_blocks(body, plan):
    """Run body(blocks) on plan.workers threads (this one and pool threads) that share
    one iterator over plan.blocks, so a thread that starts late or is slowed down
    takes fewer blocks. Returns once every thread has finished, also after a raise,
    which is then raised here (this thread's first, else the first worker's)."""
    blocks = iter(plan.blocks)
    if plan.workers <= 1:
        body(blocks)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, _threads - 1),
                                       thread_name_prefix="minigraph-cpu")
        pool = _pool
    futures = [pool.submit(body, blocks) for _ in range(plan.workers - 1)]
    try:
        body(blocks)
    finally:
        wait(futures)
    for f in futures:
        f.result()


def ones(n, dtype):
    """A cached, read-only-by-convention vector of `n` ones (the right side of BLAS sums)."""
    v = _ones_cache.get((n, dtype))
    if v is None:
        if len(_ones_cache) >= 256:
            _ones_cache.clear()
        v = _ones_cache[(n, dtype)] = np.ones(n, dtype)
    return v


def zeros(dtype):
    """A cached read-only vector of ZEROS_SIZE zeros of `dtype` (relu's right side)."""
    dtype = np.dtype(dtype)
    v = _zeros_cache.get(dtype)
    if v is None:
        v = np.zeros(ZEROS_SIZE, dtype)
        v.flags.writeable = False
        _zeros_cache[dtype] = v
    return v


def relu(x, out=None):
    """max(x, 0) elementwise (NaN stays NaN), into `out` (x's shape and dtype) when
    given, else into a new array. numpy's maximum against a 0-d zero skips its
    SIMD loop (about 5x slower on float32 than against an array), so contiguous
    x is compared, ZEROS_SIZE values at a time, with a cached vector of zeros."""
    if out is None:
        out = np.empty(x.shape, x.dtype)
    if x.size < SMALL_RELU or not (x.flags.c_contiguous and out.flags.c_contiguous):
        return np.maximum(x, np.zeros((), x.dtype), out=out)
    flat_x, flat_out, z = x.reshape(-1), out.reshape(-1), zeros(x.dtype)
    for i in range(0, x.size, ZEROS_SIZE):
        part = flat_x[i:i + ZEROS_SIZE]
        np.maximum(part, z[:part.size], out=flat_out[i:i + ZEROS_SIZE])
    return out


class Block(NamedTuple):
    """One block of a plan. FlatPlan uses every field but `part`; RowPlan uses
    `part`, `start`, `end` and `sum_lo`."""

    start: int                  # first element of x (FlatPlan), first unit or row (RowPlan)
    end: int                    # one past the last
    shape: tuple = ()           # FlatPlan: the block as a (rows, row_len) matrix
    const: slice | None = None  # FlatPlan: its slice of the expanded constants (None: all)
    row_len: int = 0            # FlatPlan: values that go into one sum
    sum_lo: int = 0             # first row of the sums the block writes (RowPlan: its row)
    sum_hi: int = 0             # FlatPlan: one past the last
    piece: int = 0              # FlatPlan: which piece of a channel (the column of the sums)
    part: int = 0               # RowPlan: 0 for the (units, unit) matrix, 1 for rows left over


class RowPlan:
    """Blocks of whole rows of x3 (rows, channels, inner) for short inner axes
    (inner < MIN_INNER).

    Rows are grouped `group` at a time into units of `unit` = group*channels*inner
    values; a block is a (units, unit) matrix; the rows % group rows left over form
    (rows, channels*inner) blocks. Each block's sums over its units go to its own
    row of an array in x's dtype, folded to channels in float64 at the end.
    """

    def __init__(self, rows, channels, inner, block):
        self.shape = (rows, channels, inner)
        row_size = channels * inner
        group = max(1, min(-(-MIN_UNIT // row_size), block // (2 * row_size), rows))
        self.group, self.row_size, self.unit = group, row_size, group * row_size
        units = rows // group
        left = rows % group
        self.cut = units * self.unit
        per = max(1, block // self.unit)
        main = [Block(u, min(u + per, units), sum_lo=i, part=0)
                for i, u in enumerate(range(0, units, per))]
        per = max(1, block // row_size)
        tail = [Block(r, min(r + per, left), sum_lo=i, part=1)
                for i, r in enumerate(range(0, left, per))]
        self.counts = (len(main), len(tail))
        self.blocks = main + tail
        self.block_elems = min(block, rows * row_size)

    def bases(self, x):
        """The matrices the blocks index: (units, unit) and (rows left over, channels*inner)."""
        flat = x.reshape(-1)
        return flat[:self.cut].reshape(-1, self.unit), flat[self.cut:].reshape(-1, self.row_size)

    def expand(self, values, dtype):
        """Per-channel `values` laid out as one unit (a `unit`-vector)."""
        _, channels, inner = self.shape
        v = np.asarray(values).astype(dtype)
        return np.broadcast_to(v[None, :, None], (self.group, channels, inner)).reshape(-1)

    @staticmethod
    def view(bases, blk):
        return bases[blk.part][blk.start:blk.end]

    def const(self, expanded, blk):
        return expanded if blk.part == 0 else expanded[:self.row_size]

    def new_sums(self, dtype):
        return (np.empty((self.counts[0], self.unit), dtype),
                np.empty((self.counts[1], self.row_size), dtype))

    @staticmethod
    def add_sums(sums, blk, a):
        """Store the sums over the units of block `a`."""
        out = sums[blk.part][blk.sum_lo]
        if a.shape[0] == 1:
            np.copyto(out, a[0])
        else:
            np.matmul(ones(a.shape[0], a.dtype), a, out=out)

    def add_dots(self, sums, blk, a, b, tmp):
        """Store the sums of a*b over the units of the block; tmp may be a itself."""
        np.multiply(a, b, out=tmp)
        self.add_sums(sums, blk, tmp)

    def fold(self, sums):
        """Per-channel float64 totals."""
        _, channels, inner = self.shape
        main = sums[0].sum(axis=0, dtype=np.float64).reshape(self.group, channels, inner)
        tail = sums[1].sum(axis=0, dtype=np.float64).reshape(channels, inner)
        return main.sum(axis=(0, 2)) + tail.sum(axis=1)


class FlatPlan:
    """Blocks of x3 (rows, channels, inner) that are contiguous runs of memory:
    several whole rows, a run of whole channels inside one row, or a piece of one
    channel. Each block stores one sum (in x's dtype) per (row, channel, piece)."""

    def __init__(self, rows, channels, inner, block):
        self.shape = (rows, channels, inner)
        row_size = channels * inner
        self.pieces = -(-inner // block)                    # pieces per channel
        self.expand_full = row_size <= block or rows >= 8   # else expanding costs more
        blocks = []
        if 2 * row_size <= block:
            per = block // row_size
            for r in range(0, rows, per):
                r1 = min(r + per, rows)
                blocks.append(Block(r * row_size, r1 * row_size, (r1 - r, row_size), None,
                                    inner, r * channels, r1 * channels, 0))
        elif self.pieces == 1:
            per = max(1, block // inner)
            for r in range(rows):
                for c in range(0, channels, per):
                    c1 = min(c + per, channels)
                    ci = slice(c * inner, c1 * inner) if self.expand_full else slice(c, c1)
                    start = r * row_size + c * inner
                    blocks.append(Block(start, start + (c1 - c) * inner, (c1 - c, inner), ci,
                                        inner, r * channels + c, r * channels + c1, 0))
        else:
            for r in range(rows):
                for c in range(channels):
                    for j, i in enumerate(range(0, inner, block)):
                        i1 = min(i + block, inner)
                        if self.expand_full:
                            ci = slice(c * inner + i, c * inner + i1)
                        else:
                            ci = slice(c, c + 1)
                        start = r * row_size + c * inner
                        blocks.append(Block(start + i, start + i1, (1, i1 - i), ci, i1 - i,
                                            r * channels + c, r * channels + c + 1, j))
        self.blocks = blocks
        self.block_elems = min(block, rows * row_size)

    @staticmethod
    def bases(x):
        return x.reshape(-1)

    def expand(self, values, dtype):
        """Per-channel `values` as one flat row of x (channels*inner values), or
        (channels, 1) to broadcast."""
        v = np.asarray(values).astype(dtype)[:, None]
        return np.repeat(v, self.shape[2], axis=1).reshape(-1) if self.expand_full else v

    @staticmethod
    def view(flat, blk):
        return flat[blk.start:blk.end].reshape(blk.shape)

    def const(self, expanded, blk):
        if blk.const is None:
            return expanded
        return expanded[blk.const].reshape(blk.shape) if self.expand_full else expanded[blk.const]

    def new_sums(self, dtype):
        return np.zeros((self.shape[0] * self.shape[1], self.pieces), dtype)

    @staticmethod
    def add_sums(sums, blk, a):
        a = a.reshape(-1, blk.row_len)
        np.matmul(a, ones(blk.row_len, a.dtype), out=sums[blk.sum_lo:blk.sum_hi, blk.piece])

    def add_dots(self, sums, blk, a, b, tmp):
        """Store the sums of a*b per row of the block; tmp may be a itself. Rows of
        up to MAX_DOT values go through einsum (one pass, no temporary)."""
        if blk.row_len > MAX_DOT:                # einsum accumulates less carefully
            np.multiply(a, b, out=tmp)
            self.add_sums(sums, blk, tmp)
        else:
            np.einsum("ij,ij->i", a.reshape(-1, blk.row_len), b.reshape(-1, blk.row_len),
                      out=sums[blk.sum_lo:blk.sum_hi, blk.piece])

    def fold(self, sums):
        rows, channels, _ = self.shape
        return sums.reshape(rows, channels, self.pieces).sum(axis=(0, 2), dtype=np.float64)


def plan_for(x3):
    """The block plan (a RowPlan or FlatPlan) of a C-contiguous (rows, channels,
    inner) array; `plan.workers` threads share its blocks (one for small arrays)."""
    rows, channels, inner = x3.shape
    key = (rows, channels, inner, x3.dtype, CHUNK_BYTES, PARALLEL_MIN_BYTES, _threads)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    block = max(1, CHUNK_BYTES // x3.dtype.itemsize)
    if inner < MIN_INNER and 2 * channels * inner <= block:
        plan = RowPlan(rows, channels, inner, block)
    else:
        plan = FlatPlan(rows, channels, inner, block)
    plan.workers = 1 if x3.nbytes < PARALLEL_MIN_BYTES else min(_threads, len(plan.blocks))
    if len(_plans) >= 64:
        _plans.clear()
    _plans[key] = plan
    return plan
