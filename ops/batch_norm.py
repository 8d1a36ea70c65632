"""batch_norm: schema, shape checks, CPU kernel, grad maker and grad kernel, GPU bindings.

Semantics (n = values per channel in the batch):
  training:        y = (x - batch_mean) / sqrt(batch_var + eps) * scale + bias,
                   batch_var biased; the estimates take the unbiased variance.
                   First batch (counter 0): est = batch. Then
                   est = momentum * est + (1 - momentum) * batch, or, with
                   momentum=None, est += (batch - est) / k for the k-th batch.
  use_global_est:  normalise with the estimates; nothing is updated.
  is_infer:        likewise; nothing persistable is written.
`saved_*` outputs are the `estimated_*` / `num_batches` Variables themselves,
updated in place, and never with NaN or Inf.
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from minigraph.kernels import batch_norm as gpu
from minigraph.kernels import elementwise as gpu_elementwise
from minigraph.kernels import launch as gpu_launch
from minigraph.kernels import loader
from minigraph.ops.device import check_gpu_float, present, wants
from minigraph.schema import (
    Meta,
    OpDesc,
    OpError,
    OpSchema,
    Slot,
    bool_attr,
    check_float,
    check_rank,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
    kernel,
    one_of,
    positive,
    register,
    str_attr,
)

PARAM_SLOTS = ("scale", "bias", "estimated_mean", "estimated_var")
CHUNK_BYTES = 1 << 20          # work on x in cache-sized blocks
MIN_UNIT = 2048                # short rows are grouped into units of at least this many values
MIN_INNER = 16                 # shorter inner axes (NHWC: 1) sum over rows, not along them
MAX_DOT = 8192                 # longest row whose dot products go through einsum
SHIFT_VALUES = 256             # values per channel that pick the shift of the statistics
PARALLEL_MIN_BYTES = 1 << 21   # smaller tensors stay on the calling thread
SMALL_VALUES = 1 << 14         # tensors this small take plain float64 numpy (less overhead)


def momentum_range(v):
    """The momentum attribute's check: a weight of the old estimate, in [0, 1]."""
    if 0.0 <= v <= 1.0:
        return None
    return ("must be in [0, 1] (the weight of the old estimate), or None for the "
            "cumulative average")


def bn_schema(op_type):
    """The batch-norm schema under `op_type` (sync_batch_norm shares it)."""
    return OpSchema(
        type=op_type,
        inputs=(Slot("x"), Slot("estimated_mean"), Slot("estimated_var"), Slot("scale"),
                Slot("bias"), Slot("num_batches", optional=True)),
        outputs=(Slot("y"), Slot("batch_mean"), Slot("batch_var"), Slot("saved_mean"),
                 Slot("saved_var"), Slot("saved_num_batches", optional=True)),
        attrs=(bool_attr("is_infer", False), bool_attr("use_global_est", False),
               float_attr("epsilon", 1e-5, positive),
               float_attr("momentum", 0.9, momentum_range, nullable=True),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))),
        inplace={"saved_mean": "estimated_mean", "saved_var": "estimated_var",
                 "saved_num_batches": "num_batches"},
        infer=lambda ins, attrs: infer_bn(op_type, ins, attrs),
        validate=validate_bn,
        grad=grad_bn,
        doc=__doc__,
    )


def validate_bn(op):
    """Cross-slot rules: momentum=None needs the counter; the counter pair goes together."""
    if op.inputs["num_batches"] is None and op.attrs["momentum"] is None:
        raise OpError(f"{op.type}: momentum=None (cumulative average) needs the "
                      "'num_batches' counter input")
    if (op.inputs["num_batches"] is None) != (op.outputs["saved_num_batches"] is None):
        raise OpError(f"{op.type}: 'num_batches' and 'saved_num_batches' go together "
                      "(an in-place pair); bind both or neither")


def infer_bn(op_type, ins, attrs):
    """Check x (rank 2-5, float), the per-channel parameters and the counter; y is x's shape."""
    x = ins["x"]
    check_rank(op_type, "x", x, (2, 3, 4, 5))
    check_float(op_type, "x", x)
    layout = attrs["data_layout"]
    channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
    for slot in PARAM_SLOTS:
        check_shape(op_type, slot, ins[slot], (channels,),
                    f" to match the {channels} channels of input 'x' ({layout}, shape {x.shape})")
        check_same_dtype(op_type, slot, ins[slot], "x", x)
    if ins.get("num_batches") is not None:
        nb = ins["num_batches"]
        if nb.shape != () or nb.dtype != np.int64:
            fail(op_type, "num_batches", f"must be an int64 scalar (shape ()), got "
                                         f"{nb.dtype} of shape {nb.shape}")
    stat = Meta((channels,), x.dtype)
    return {"y": Meta(x.shape, x.dtype), "batch_mean": stat, "batch_var": stat}


def as_3d(x, layout):
    """View x as (rows, C, inner) so every statistic reduces over axes 0 and 2."""
    if layout == "NCHW":
        return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))  # 0 rows too
    return x.reshape(-1, x.shape[-1], 1)


# ---- blocked CPU kernels ----------------------------------------------------------
#
# Each pass reads x (and dy) from memory once and does all of its arithmetic on
# one cache-sized block at a time. Per-channel constants are laid out to match
# a block ("expanded"), so every ufunc runs over long contiguous rows. Sums go
# through BLAS matrix-vector products with a vector of ones (or einsum for dot
# products): x's dtype inside one block, float64 across blocks, and every block
# stores its sums in its own slot, so results do not depend on the threads.
# Threads take blocks from a shared iterator; numpy releases the GIL while it works.

_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_pool = None
_pool_lock = threading.Lock()
_local = threading.local()
_ones_cache = {}
_plans = {}


def _forget_pool():
    """After a fork the pool's threads are gone: start a fresh pool when needed."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def set_num_threads(n):
    """Use `n` (>= 1) threads in the CPU kernels of batch_norm (default: every core)."""
    global _threads, _pool
    n = int(n)
    if n < 1:
        raise ValueError(f"batch_norm: the number of threads must be >= 1, got {n}")
    with _pool_lock:
        if n != _threads:
            old, _pool, _threads = _pool, None, n
            if old is not None:
                old.shutdown(wait=False)


def get_num_threads():
    """The number of threads the CPU kernels of batch_norm use."""
    return _threads


def run_blocks(body, plan):
    """Run body(blocks) on plan.workers threads (this one and pool threads) that share
    one iterator over plan.blocks, so a thread that starts late or is slowed down
    takes fewer blocks. Returns once every thread has finished, also after a raise."""
    blocks = iter(plan.blocks)
    if plan.workers <= 1:
        body(blocks)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, _threads - 1),
                                       thread_name_prefix="minigraph-bn")
        pool = _pool
    futures = [pool.submit(body, blocks) for _ in range(plan.workers - 1)]
    try:
        body(blocks)
    finally:
        wait(futures)
    for f in futures:
        f.result()


def _ones(n, dtype):
    v = _ones_cache.get((n, dtype))
    if v is None:
        if len(_ones_cache) >= 256:
            _ones_cache.clear()
        v = _ones_cache[(n, dtype)] = np.ones(n, dtype)
    return v


def _scratch(slot, dtype, size):
    """This thread's scratch array number `slot` (>= size elements), kept between calls."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get((slot, dtype))
    if buf is None or buf.size < size:
        buf = bufs[(slot, dtype)] = np.empty(size, dtype)
    return buf


def as_work(a):
    """`a` C-contiguous in the dtype the kernels compute in (float16 -> float32)."""
    if a.dtype == np.float16:
        return a.astype(np.float32)
    return np.ascontiguousarray(a)


class RowPlan:
    """Blocks of whole rows of x3 (R, C, I) for short inner axes (I < MIN_INNER).

    Rows are grouped g at a time into units of U = g*C*I values; a block is a
    (units, U) matrix; the R % g rows left over form (rows, C*I) blocks. Each
    block's sums over its units go to its own row of an array in x's dtype,
    folded to channels in float64 at the end.
    """

    def __init__(self, R, C, I, block):
        self.shape = (R, C, I)
        P = C * I
        g = max(1, min(-(-MIN_UNIT // P), block // (2 * P), R))
        self.g, self.P, self.U = g, P, g * P
        units = R // g
        self.cut = units * self.U
        per = max(1, block // self.U)
        main = [(0, slice(u, min(u + per, units))) for u in range(0, units, per)]
        per = max(1, block // P)
        tail = [(1, slice(r, min(r + per, R % g))) for r in range(0, R % g, per)]
        self.counts = (len(main), len(tail))
        self.blocks = [(k, rows, i) for i, (k, rows) in enumerate(main)]
        self.blocks += [(k, rows, i) for i, (k, rows) in enumerate(tail)]
        self.block_elems = min(block, R * P)

    def bases(self, x):
        """The matrices the blocks index: (units, U) and (rows left over, C*I)."""
        flat = x.reshape(-1)
        return flat[:self.cut].reshape(-1, self.U), flat[self.cut:].reshape(-1, self.P)

    def expand(self, values, dtype):
        """Per-channel `values` laid out as one unit (a U-vector)."""
        _, C, I = self.shape
        v = np.asarray(values).astype(dtype)
        return np.broadcast_to(v[None, :, None], (self.g, C, I)).reshape(-1)

    @staticmethod
    def view(bases, blk):
        return bases[blk[0]][blk[1]]

    def const(self, expanded, blk):
        return expanded if blk[0] == 0 else expanded[:self.P]

    def new_sums(self, dtype):
        return np.empty((self.counts[0], self.U), dtype), np.empty((self.counts[1], self.P), dtype)

    @staticmethod
    def add_sums(sums, blk, a):
        """Store the sums over the units of block `a`."""
        out = sums[blk[0]][blk[2]]
        if a.shape[0] == 1:
            np.copyto(out, a[0])
        else:
            np.matmul(_ones(a.shape[0], a.dtype), a, out=out)

    def add_dots(self, sums, blk, a, b, tmp):
        """Store the sums of a*b over the units of the block; tmp may be a itself."""
        np.multiply(a, b, out=tmp)
        self.add_sums(sums, blk, tmp)

    def fold(self, sums):
        """Per-channel float64 totals."""
        _, C, I = self.shape
        main = sums[0].sum(axis=0, dtype=np.float64).reshape(self.g, C, I).sum(axis=(0, 2))
        return main + sums[1].sum(axis=0, dtype=np.float64).reshape(C, I).sum(axis=1)


class FlatPlan:
    """Blocks of x3 (R, C, I) that are contiguous runs of memory: several whole
    rows, a run of whole channels inside one row, or a piece of one channel.
    Each block stores one sum (in x's dtype) per (row, channel, piece)."""

    def __init__(self, R, C, I, block):
        self.shape = (R, C, I)
        P = self.P = C * I
        self.J = -(-I // block)                  # pieces per channel
        self.expand_full = P <= block or R >= 8  # else expanding costs more than it saves
        blocks = []
        if 2 * P <= block:
            per = block // P
            for r in range(0, R, per):
                r1 = min(r + per, R)
                blocks.append((r * P, r1 * P, (r1 - r, P), None, I, r * C, r1 * C, 0))
        elif self.J == 1:
            per = max(1, block // I)
            for r in range(R):
                for c in range(0, C, per):
                    c1 = min(c + per, C)
                    ci = slice(c * I, c1 * I) if self.expand_full else slice(c, c1)
                    blocks.append((r * P + c * I, r * P + c1 * I, (c1 - c, I), ci, I,
                                   r * C + c, r * C + c1, 0))
        else:
            for r in range(R):
                for c in range(C):
                    for j, i in enumerate(range(0, I, block)):
                        i1 = min(i + block, I)
                        ci = slice(c * I + i, c * I + i1) if self.expand_full else slice(c, c + 1)
                        blocks.append((r * P + c * I + i, r * P + c * I + i1, (1, i1 - i), ci,
                                       i1 - i, r * C + c, r * C + c + 1, j))
        self.blocks = blocks
        self.block_elems = min(block, R * P)

    @staticmethod
    def bases(x):
        return x.reshape(-1)

    def expand(self, values, dtype):
        """Per-channel `values` as one flat row of x (C*I values), or (C, 1) to broadcast."""
        v = np.asarray(values).astype(dtype)[:, None]
        return np.repeat(v, self.shape[2], axis=1).reshape(-1) if self.expand_full else v

    @staticmethod
    def view(flat, blk):
        return flat[blk[0]:blk[1]].reshape(blk[2])

    def const(self, expanded, blk):
        if blk[3] is None:
            return expanded
        return expanded[blk[3]].reshape(blk[2]) if self.expand_full else expanded[blk[3]]

    def new_sums(self, dtype):
        return np.zeros((self.shape[0] * self.shape[1], self.J), dtype)

    @staticmethod
    def add_sums(sums, blk, a):
        a = a.reshape(-1, blk[4])
        np.matmul(a, _ones(blk[4], a.dtype), out=sums[blk[5]:blk[6], blk[7]])

    def add_dots(self, sums, blk, a, b, tmp):
        """Store the sums of a*b per row of the block; tmp may be a itself. Rows of
        up to MAX_DOT values go through einsum (one pass, no temporary)."""
        if blk[4] > MAX_DOT:                     # einsum accumulates less carefully
            np.multiply(a, b, out=tmp)
            self.add_sums(sums, blk, tmp)
        else:
            np.einsum("ij,ij->i", a.reshape(-1, blk[4]), b.reshape(-1, blk[4]),
                      out=sums[blk[5]:blk[6], blk[7]])

    def fold(self, sums):
        R, C, _ = self.shape
        return sums.reshape(R, C, self.J).sum(axis=(0, 2), dtype=np.float64)


def plan_for(x3):
    """The block plan of a C-contiguous (R, C, I) array; `plan.workers` threads
    share its blocks (one for small arrays)."""
    R, C, I = x3.shape
    key = (R, C, I, x3.dtype, CHUNK_BYTES, PARALLEL_MIN_BYTES, _threads)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    block = max(1, CHUNK_BYTES // x3.dtype.itemsize)
    if I < MIN_INNER and 2 * C * I <= block:
        plan = RowPlan(R, C, I, block)
    else:
        plan = FlatPlan(R, C, I, block)
    plan.workers = 1 if x3.nbytes < PARALLEL_MIN_BYTES else min(_threads, len(plan.blocks))
    if len(_plans) >= 64:
        _plans.clear()
    _plans[key] = plan
    return plan


def local_stats(x3):
    """(n, mean, M2) per channel of x3 (R, C, I) in float64, over axes 0 and 2.

    One read of x, the shifted-data algorithm: the sums are of d = x - K with K
    a per-channel shift near the mean, so M2 = Σd² - (Σd)²/n keeps its digits
    on offset data. K is the mean of the first values of each channel, or 0
    when every channel's first values have |mean| <= std (x is then centred
    enough as it is, and the subtraction is skipped). A shape with no values
    gives n = 0 and zeros (a rank holding no rows of a synced batch)."""
    x3 = as_work(x3)
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
    K = plan.expand(shift, x3.dtype) if centre else None
    xs = plan.bases(x3)

    s1, s2 = plan.new_sums(x3.dtype), plan.new_sums(x3.dtype)

    def part(blocks):
        buf = _scratch(0, x3.dtype, plan.block_elems)
        with np.errstate(invalid="ignore", over="ignore"):     # the caller checks the result
            for blk in blocks:
                xb = plan.view(xs, blk)
                d = buf[:xb.size].reshape(xb.shape)
                if K is None:
                    np.square(xb, out=d)
                    plan.add_sums(s1, blk, xb)
                else:
                    np.subtract(xb, plan.const(K, blk), out=d)
                    plan.add_sums(s1, blk, d)
                    np.square(d, out=d)
                plan.add_sums(s2, blk, d)

    run_blocks(part, plan)
    with np.errstate(invalid="ignore", over="ignore"):
        s1, s2 = plan.fold(s1), plan.fold(s2)
        mean = shift + s1 / n
        m2 = np.maximum(s2 - s1 * (s1 / n), 0.0)
    return n, mean, m2


def centring_needed(mean, invstd):
    """Whether x must be centred before scaling: when |mean| > std in a channel,
    x * k + c would lose digits that (x - mean) * k + c keeps."""
    return not bool(np.all(np.abs(mean) * invstd <= 1.0))


def normalize(x3, mean, invstd, scale, bias, out3):
    """out3 = (x - mean) * invstd * scale + bias per channel (float64 arguments);
    out3 is C-contiguous in x's work dtype. Offset data is centred first;
    otherwise x * k + c, one step fewer."""
    x3 = as_work(x3)
    k = invstd * scale
    if x3.size <= SMALL_VALUES:
        out3[...] = (x3 - mean[:, None]) * k[:, None] + bias[:, None]
        return
    plan = plan_for(x3)
    dt = x3.dtype
    if centring_needed(mean, invstd):
        m = mean.astype(dt)
        M = plan.expand(m, dt)
        B = plan.expand(bias - (mean - m) * k, dt)
    else:
        M = None
        B = plan.expand(bias - mean * k, dt)
    Kc = plan.expand(k, dt)
    xs, outs = plan.bases(x3), plan.bases(out3)

    def part(blocks):
        for blk in blocks:
            xb, o = plan.view(xs, blk), plan.view(outs, blk)
            if M is None:
                np.multiply(xb, plan.const(Kc, blk), out=o)
            else:
                np.subtract(xb, plan.const(M, blk), out=o)
                o *= plan.const(Kc, blk)
            o += plan.const(B, blk)

    run_blocks(part, plan)


def updated_estimates(op, mean, var, n, est_mean, est_var, counter):
    """New (mean, var) estimates after a batch, in est's dtype; never NaN or Inf."""
    dtype = est_mean.dtype
    unbiased = var * (n / (n - 1))
    est_mean, est_var = est_mean.astype(np.float64), est_var.astype(np.float64)
    momentum = op.attrs["momentum"]
    seen = int(counter) if counter is not None else None
    if seen == 0:
        new = mean, unbiased
    elif momentum is None:
        w = 1.0 / (seen + 1)
        new = est_mean + (mean - est_mean) * w, est_var + (unbiased - est_var) * w
    else:
        new = (momentum * est_mean + (1 - momentum) * mean,
               momentum * est_var + (1 - momentum) * unbiased)
    with np.errstate(over="ignore", invalid="ignore"):
        new = tuple(v.astype(dtype) for v in new)
    if not np.isfinite(np.concatenate((mean, var) + new)).all():
        raise OpError(f"{op.type}: the batch statistics are not finite (input 'x' holds NaN "
                      "or Inf, or its variance overflows); the running estimates and the "
                      "counter were left unchanged")
    return new


def forward_cpu(op, ins, combine=None):
    """The CPU forward of batch_norm. `combine(n, mean, m2) -> (n, mean, m2)`
    turns local statistics into global ones (sync_batch_norm). Everything is
    computed before the estimates and the counter are written, in place."""
    x = ins["x"]
    a = op.attrs
    layout = a["data_layout"]
    xw = as_work(x)
    x3 = as_3d(xw, layout)
    est_mean, est_var = ins["estimated_mean"], ins["estimated_var"]
    counter = ins.get("num_batches")
    training = not (a["is_infer"] or a["use_global_est"])
    if training:
        n, mean, m2 = local_stats(x3)
        if combine is not None:
            n, mean, m2 = combine(n, mean, m2)
        if n <= 1:
            raise OpError(f"{op.type}: training needs more than one value per channel, got "
                          f"n={n} for input 'x' of shape {x.shape} ({layout}); use a bigger "
                          "batch or is_infer/use_global_est")
        var = m2 / n
        new_mean, new_var = updated_estimates(op, mean, var, n, est_mean, est_var, counter)
    else:
        mean = est_mean.astype(np.float64)
        var = est_var.astype(np.float64)
    invstd = 1.0 / np.sqrt(var + a["epsilon"])
    yw = np.empty(xw.shape, xw.dtype)
    normalize(x3, mean, invstd, ins["scale"].astype(np.float64),
              ins["bias"].astype(np.float64), as_3d(yw, layout))
    out = {"y": yw.astype(x.dtype, copy=False), "batch_mean": mean.astype(x.dtype),
           "batch_var": var.astype(x.dtype), "saved_mean": est_mean, "saved_var": est_var,
           "saved_num_batches": counter}
    if training:             # everything is computed: now commit, all at once
        est_mean[...] = new_mean
        est_var[...] = new_var
        if counter is not None:
            counter[...] = counter + 1
    return out


def grad_bn(op, dout, make_grad):
    """batch_norm_grad from batch statistics, or with the estimates as constants."""
    dy = dout.get("y")
    if dy is None:
        return []
    use_est = op.attrs["is_infer"] or op.attrs["use_global_est"]
    src = op.inputs if use_est else op.outputs
    mean_slot, var_slot = (("estimated_mean", "estimated_var") if use_est
                           else ("batch_mean", "batch_var"))
    return [OpDesc(op.type + "_grad", dict(
        x=op.inputs["x"], scale=op.inputs["scale"], mean=src[mean_slot], var=src[var_slot],
        dy=dy, dx=make_grad(op.inputs["x"]), dscale=make_grad(op.inputs["scale"]),
        dbias=make_grad(op.inputs["bias"]), use_global_est=use_est,
        epsilon=op.attrs["epsilon"], data_layout=op.attrs["data_layout"]))]


def bn_grad_schema(op_type):
    """`<op_type>_grad`: dx, dscale, dbias from x, dy and the statistics used."""
    def infer(ins, attrs):
        x = ins["x"]
        check_shape(op_type + "_grad", "dy", ins["dy"], x.shape, " (the shape of x)")
        c = Meta(ins["scale"].shape, x.dtype)
        return {"dx": Meta(x.shape, x.dtype), "dscale": c, "dbias": c}

    return OpSchema(
        type=op_type + "_grad",
        inputs=(Slot("x"), Slot("scale"), Slot("mean"), Slot("var"), Slot("dy")),
        outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                 Slot("dbias", optional=True)),
        attrs=(bool_attr("use_global_est", False), float_attr("epsilon", 1e-5, positive),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))),
        infer=infer,
    )


def grad_sums(x3, dy3, mean, invstd=None):
    """(n, Σdy, Σdy·(x−mean)) per channel of (R, C, I) arrays, in float64.

    x is centred on mean (rounded to x's dtype, then corrected exactly), unless
    `invstd` is given and shows |mean| <= std in every channel: then
    Σdy·x − mean·Σdy is as accurate and one step cheaper."""
    x3, dy3 = as_work(x3), as_work(dy3)
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
    M = plan.expand(shift, x3.dtype) if centred else None
    xs, dys = plan.bases(x3), plan.bases(dy3)

    s_dy, s_dyx = plan.new_sums(x3.dtype), plan.new_sums(x3.dtype)

    def part(blocks):
        buf = _scratch(0, x3.dtype, plan.block_elems)
        for blk in blocks:
            xb, gb = plan.view(xs, blk), plan.view(dys, blk)
            d = buf[:xb.size].reshape(xb.shape)
            if M is not None:
                xb = np.subtract(xb, plan.const(M, blk), out=d)
            plan.add_dots(s_dyx, blk, xb, gb, d)
            plan.add_sums(s_dy, blk, gb)

    run_blocks(part, plan)
    s_dy, s_dyx = plan.fold(s_dy), plan.fold(s_dyx)
    return n, s_dy, s_dyx - s_dy * (mean - shift)


def input_grad(x3, dy3, mean, k_dy, k_x, k_c, out3, centre=True):
    """out3 = k_dy*dy + k_x*(x - mean) + k_c per channel (float64 arguments), or
    k_dy*dy when k_x is None; out3 is C-contiguous in x's work dtype. With
    centre=False (|mean| <= std) it is computed as k_dy*dy + k_x*x + c."""
    x3, dy3 = as_work(x3), as_work(dy3)
    if x3.size <= SMALL_VALUES:
        dx = dy3 * k_dy[:, None]
        if k_x is not None:
            dx += (x3 - mean[:, None]) * k_x[:, None] + k_c[:, None]
        out3[...] = dx
        return
    plan = plan_for(x3)
    dt = x3.dtype
    KD = plan.expand(k_dy, dt)
    if k_x is None:
        M = KX = KC = None
    elif centre:
        m = mean.astype(dt)
        M, KX, KC = (plan.expand(v, dt) for v in (m, k_x, k_c - k_x * (mean - m)))
    else:
        M = None
        KX, KC = plan.expand(k_x, dt), plan.expand(k_c - k_x * mean, dt)
    xs, dys, outs = plan.bases(x3), plan.bases(dy3), plan.bases(out3)

    def part(blocks):
        buf = _scratch(1, dt, plan.block_elems)
        for blk in blocks:
            gb, o = plan.view(dys, blk), plan.view(outs, blk)
            if KX is None:
                np.multiply(gb, plan.const(KD, blk), out=o)
                continue
            xb = plan.view(xs, blk)
            t = buf[:xb.size].reshape(xb.shape)
            if M is None:
                np.multiply(xb, plan.const(KX, blk), out=o)
            else:
                np.subtract(xb, plan.const(M, blk), out=o)
                o *= plan.const(KX, blk)
            o += plan.const(KC, blk)
            np.multiply(gb, plan.const(KD, blk), out=t)
            o += t

    run_blocks(part, plan)


def backward_cpu(op, ins, combine=None):
    """The CPU grad kernel. `combine(n, s_dy, s_dyxmu) -> (n, s_dy, s_dyxmu)` sums
    over ranks (sync_batch_norm); n is then the global count."""
    a = op.attrs
    x, dy = ins["x"], ins["dy"]
    layout = a["data_layout"]
    x3, dy3 = as_3d(as_work(x), layout), as_3d(as_work(dy), layout)
    mean = ins["mean"].astype(np.float64)
    invstd = 1.0 / np.sqrt(ins["var"].astype(np.float64) + a["epsilon"])
    scale = ins["scale"].astype(np.float64)
    want_dx = op.outputs.get("dx") is not None
    out = {}
    if not a["use_global_est"] or op.outputs.get("dscale") is not None \
            or op.outputs.get("dbias") is not None:
        n, s_dy, s_dyxmu = grad_sums(x3, dy3, mean, invstd)
        if combine is not None and not a["use_global_est"]:
            n, s_dy, s_dyxmu = combine(n, s_dy, s_dyxmu)
        out["dbias"] = s_dy.astype(x.dtype)
        out["dscale"] = (s_dyxmu * invstd).astype(x.dtype)
    if want_dx:
        k_dy = scale * invstd
        dx = np.empty(x3.shape, x3.dtype)
        if a["use_global_est"]:
            input_grad(x3, dy3, mean, k_dy, None, None, dx)
        else:
            k_x = -scale * invstd ** 3 * s_dyxmu / n
            k_c = -scale * invstd * s_dy / n
            input_grad(x3, dy3, mean, k_dy, k_x, k_c, dx, centring_needed(mean, invstd))
        out["dx"] = dx.reshape(x.shape).astype(x.dtype, copy=False)
    return out


# ---- GPU kernel bindings -------------------------------------------------------------
#
# The launchers of minigraph.kernels.batch_norm on device arrays; nothing is
# copied to the host. The estimates and the counter are updated in place on
# the device. A batch with non-finite statistics cannot raise inside the step:
# the kernels flag it and leave the estimates and the counter unchanged, and
# the error (an OpError, as on the CPU) is raised at the next fetch.


class NonFiniteGuard(gpu.Guard):
    """The device record of rejected training batches (kernels.batch_norm.Guard)
    that reports them as the CPU kernel does: an OpError naming the op."""

    def check(self, what):
        n = self.rejected()
        if n:
            raise OpError(f"{what}: the batch statistics of {n} training batch(es) were not "
                          "finite (input 'x' held NaN or Inf, or its variance overflowed); the "
                          "running estimates and the counter were left unchanged for them "
                          "(found on the GPU, reported at the first fetch after the step)")


def gpu_guard(op_type):
    """The NonFiniteGuard of `op_type`, checked by GPUPlace.check_errors at fetch."""
    return loader.error_flag(op_type, NonFiniteGuard)


def too_few_values(op, n, x, layout):
    """The error of a training batch with n <= 1 values per channel (the CPU's words)."""
    return OpError(f"{op.type}: training needs more than one value per channel, got "
                   f"n={n} for input 'x' of shape {tuple(x.shape)} ({layout}); use a bigger "
                   "batch or is_infer/use_global_est")


def forward_gpu(op, ins, allreduce=None):
    """The GPU forward of batch_norm: the CPU kernel's outputs and in-place
    updates, on the device. With is_infer or use_global_est, y is normalised
    with the estimates and batch_mean/batch_var are copies of them.

    `allreduce(v) -> v` sums a float64 device vector over ranks (sync_batch_norm):
    training then takes the statistics of every rank's batch - one call on the
    2C+1 numbers (n, n*mean, M2 + n*mean^2) of kernels.batch_norm.local_stats."""
    a = op.attrs
    x, scale, bias = ins["x"], ins["scale"], ins["bias"]
    est_mean, est_var, counter = ins["estimated_mean"], ins["estimated_var"], \
        ins.get("num_batches")
    check_gpu_float(op, x=x)
    layout, eps = a["data_layout"], a["epsilon"]
    if a["is_infer"] or a["use_global_est"]:
        y = gpu.forward_infer(x, scale, bias, est_mean, est_var, eps, layout)
        mean, var = gpu_elementwise.copy(est_mean), gpu_elementwise.copy(est_var)
    else:
        pre, _, post = gpu_launch.channel_view(x.shape, layout)
        n = pre * post
        common = (scale, bias, est_mean, est_var, counter, a["momentum"], eps, layout)
        if allreduce is None:
            if n <= 1:
                raise too_few_values(op, n, x, layout)
            y, mean, var = gpu.forward_train(x, *common, guard=gpu_guard(op.type))
        else:
            sums = allreduce(gpu.local_stats(x, layout))
            if n <= 1:          # only then can the global count be <= 1: read it back
                n = int(round(float(sums.get()[0])))
                if n <= 1:
                    raise too_few_values(op, n, x, layout)
            y, mean, var = gpu.forward_train_from_sums(x, sums, *common,
                                                       guard=gpu_guard(op.type))
    return {"y": y, "batch_mean": mean, "batch_var": var, "saved_mean": est_mean,
            "saved_var": est_var, "saved_num_batches": counter}


def backward_gpu(op, ins, allreduce=None):
    """The GPU grad kernel; unbound outputs are not computed. `allreduce` (see
    forward_gpu) sums (n, Σdy, Σdy·(x−μ)) over ranks when the statistics came
    from the batch: dscale and dbias are then the whole batch's, dx uses the
    global n."""
    a = op.attrs
    x, dy, scale, mean, var = ins["x"], ins["dy"], ins["scale"], ins["mean"], ins["var"]
    check_gpu_float(op, x=x, dy=dy)
    layout, eps = a["data_layout"], a["epsilon"]
    need = dict(need_dx=wants(op, "dx"), need_dscale=wants(op, "dscale"),
                need_dbias=wants(op, "dbias"))
    if allreduce is None or a["use_global_est"]:
        dx, dscale, dbias = gpu.backward(x, dy, scale, mean, var, eps, layout,
                                         a["use_global_est"], **need)
    else:
        sums = allreduce(gpu.backward_sums(x, dy, mean, layout))
        dx, dscale, dbias = gpu.backward_from_sums(x, dy, scale, mean, var, sums, eps, layout,
                                                   **need)
    return present(dx=dx, dscale=dscale, dbias=dbias)


register(bn_schema("batch_norm"))
register(bn_grad_schema("batch_norm"))
kernel("batch_norm", "cpu")(forward_cpu)
kernel("batch_norm_grad", "cpu")(backward_cpu)
kernel("batch_norm", "gpu")(forward_gpu)
kernel("batch_norm_grad", "gpu")(backward_gpu)
