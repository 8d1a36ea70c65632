"""Launchers for kernels/cuda/batch_norm.cu: batch norm on device arrays (no graph).

Layouts: "NCHW" (channel axis 1; rank 2 to 5) or "NHWC" (channel axis last).
Every launch is asynchronous and nothing is copied to the host:

  forward_train  2 kernels: statistics (Welford per thread, Chan merges across
                 the warp, the block and, when one channel is split over
                 several blocks, the last block of the channel) and
                 normalisation, which also commits the running estimates and
                 the counter - on the device, unless the batch was flagged.
                 NCHW with small planes: 1 kernel, each channel group resident in
                 shared memory (bn_resident.py).
  forward_infer  1 elementwise kernel.
  backward       2 kernels: sums of dy and dy (x - mean) per channel (giving
                 dscale and dbias), then the elementwise dx; 1 resident kernel
                 for small planes.
(rows, C) tensors - NHWC, and NCHW with one value per plane - take the rows
reductions planned by bn_rows.py and its elementwise kernels (coefficients in
registers). `relu=True` (batch_norm_relu) applies max(y, 0) to the output; its
backward masks dy with the forward output's sign.

Synchronized batch norm (one collective each way between two launches) has
its own entry points on top of these kernels: kernels/cuda/batch_norm_sync.py.

Non-finite statistics. The statistics kernel flags a batch whose mean or
variance is NaN or Inf in any channel, or whose new estimates would be (as
the CPU kernel checks them), by writing its epoch into the Guard's status
word; the normalisation kernel then writes neither estimate nor the counter
(for any channel) and counts the batch as rejected. The host learns of it only
when it asks: `Guard.check()` reads the status (a synchronising copy of
8 bytes) and raises; call it where the host synchronises anyway (when results
are fetched), or after every step in a debug mode. y and the batch statistics
of a flagged batch are written (they hold the NaNs); only the estimates and the
counter are protected.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import bn_rows, launch, loader

MODULE = "batch_norm"
_STATS_TAIL = "PPPPPddiIPPPPP"
STATS_TAIL = _STATS_TAIL        # what every statistics entry point ends with (MG_BN_STATS_ARGS)
SIGNATURES = {}
for _t, _ws in (("f32", (1, 4)), ("f64", (1, 2))):
    for _w in _ws:
        SIGNATURES.update({
            f"bn_stats_planar_{_t}_w{_w}": "PqqqqiPP" + _STATS_TAIL,
            f"bn_stats_rows_{_t}_w{_w}": "PqqqiPP" + _STATS_TAIL,
            f"bn_normalize_{_t}_w{_w}": "PPqqqPiPPPPPIi",
            f"bn_infer_{_t}_w{_w}": "PPqqqPPPPdi",
            f"bn_grad_planar_{_t}_w{_w}": "PPqqqqiPPPPPddiPPPPP",
            f"bn_grad_rows_{_t}_w{_w}": "PPqqqiPPPPPddiPPPPP",
            f"bn_grad_dx_{_t}_w{_w}": "PPPqqqPPPi",
            f"bn_grad_dx_global_{_t}_w{_w}": "PPqqqPPPi",
            f"bn_local_stats_planar_{_t}_w{_w}": "PqqqqiPPP",
            f"bn_local_stats_rows_{_t}_w{_w}": "PqqqiPPP",
            f"bn_grad_sums_planar_{_t}_w{_w}": "PPqqqqiPPPdPP",
            f"bn_grad_sums_rows_{_t}_w{_w}": "PPqqqiPPPdPP",
        })
    SIGNATURES[f"bn_stats_from_sums_{_t}"] = "Pq" + _STATS_TAIL
    SIGNATURES[f"bn_grad_from_sums_{_t}"] = "PqPPPdPPPd"
SIGNATURES["bn_merge_stats"] = "PqqP"


def kernel(name):
    return loader.kernel(MODULE, name, SIGNATURES[name])


class Guard:
    """Device-side record of training batches whose statistics were not finite.

    status[0] = the epoch of the last flagged launch, status[1] = batches
    rejected so far (`address`: its device address). Each forward_train launch
    takes a fresh epoch.
    """

    def __init__(self):
        from minigraph.kernels.cuda import fill

        self.status = fill.full((2,), 0, np.uint32)
        self.address = loader.address(self.status)
        self.epoch = 0
        self._reported = 0

    def next_epoch(self):
        """A new nonzero epoch for the next launch."""
        self.epoch = self.epoch % 0xFFFFFFFF + 1
        return self.epoch

    def rejected(self):
        """Batches rejected since the last call (reads the device: synchronises)."""
        total = int(self.status.get()[1])
        new, self._reported = total - self._reported, total
        return new

    def check(self, what="batch_norm"):
        """Raise FloatingPointError if a batch was rejected since the last check."""
        n = self.rejected()
        if n:
            raise FloatingPointError(
                f"{what}: {n} training batch(es) had NaN or Inf batch statistics (input 'x' "
                "has non-finite values); the running estimates and the counter were left "
                "unchanged for them")


def default_guard():
    """The Guard used by forward_train calls that are not given one (per device)."""
    return loader.cached("batch_norm.default_guard", Guard)


def geometry(x, layout):
    """(pre, channels, post) of x; its layout and rank checked once per device, shape
    and layout."""
    shapes = loader.cached("batch_norm.geometry", dict)
    key = (x.shape, layout)
    found = shapes.get(key)
    if found is None:
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"batch_norm: layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if not 2 <= len(x.shape) <= 5:
            raise ValueError(f"batch_norm: x must have rank 2 to 5, got shape {tuple(x.shape)}")
        found = shapes[key] = launch.channel_view(x.shape, layout)
    return found


_LABELS = {}


def param_ptrs(x, layout, channels, params):
    """The device pointers of `params` ((name, array or None) pairs; 0 for None),
    each checked to be C-contiguous, of x's dtype and of shape (channels,)."""
    found = []
    want, dtype = (channels,), x.dtype
    for name, a in params:
        if a is None:
            found.append(0)
            continue
        if a.shape != want and tuple(a.shape) != want or \
                a.dtype is not dtype and a.dtype != dtype:
            raise ValueError(f"batch_norm: '{name}' must be {np.dtype(x.dtype)} of shape "
                             f"({channels},) for x {tuple(x.shape)} ({layout}), got "
                             f"{a.dtype}{tuple(a.shape)}")
        if a.gpudata is not None and a.flags.c_contiguous:
            found.append(int(a.gpudata))
        else:
            label = _LABELS.get(name)
            if label is None:
                label = _LABELS[name] = f"batch_norm: '{name}'"
            found.append(loader.ptr(a, label))
    return found


def _check(x, layout, params):
    """(pre, channels, post) of x, after checking x and `params` (see param_ptrs)."""
    pre, channels, post = geometry(x, layout)
    loader.ptr(x, "batch_norm: x")
    param_ptrs(x, layout, channels, params)
    return pre, channels, post


def flat_launch(name, total, width, at_least, *args):
    """Launch the grid-stride kernel `name` over `total` values in packs of `width`
    (its grid memoised per device)."""
    configs = loader.cached("batch_norm.flat", dict)
    key = (name, total, width, at_least)
    go = configs.get(key)
    if go is None:
        go = configs[key] = _flat_go(name, total, width, at_least)
    go(*args)


def _flat_go(name, total, width, at_least):
    k = kernel(name)
    dev = loader.device()
    threads = launch.block_threads(dev)
    grid = launch.flat_grid(-(-total // width), dev, threads, k.resources, at_least=at_least)
    return k.prepared((grid, 1, 1), (threads, 1, 1))


def packed_launch(stem, dtype, total, aligned, at_least, *args):
    """flat_launch of the kernel `stem`_<f32|f64>_w<width>: packs of 16 bytes when
    `aligned` (every pointer it reads or writes is), else single values."""
    configs = loader.cached("batch_norm.packed", dict)
    key = (stem, dtype, total, aligned, at_least)
    go = configs.get(key)
    if go is None:
        width = launch.vector_width(np.dtype(dtype).itemsize) if aligned else 1
        go = configs[key] = _flat_go(f"{stem}_{loader.suffix(dtype)}_w{width}", total, width,
                                     at_least)
    go(*args)


def aligned(*pointers):
    """True when every pointer allows 16-byte packs."""
    return not any(p % launch.VECTOR_BYTES for p in pointers)


def reduce_plan(name_stem, x, aligned, pre, channels, post):
    """(ReducePlan, its prepared launch) of a reduction of x, memoised per device;
    `aligned`: the data pointers allow 16-byte packs."""
    key = (name_stem, pre, channels, post, x.dtype, aligned, launch.tunables())
    plans = loader.cached("batch_norm.plans", dict)
    found = plans.get(key)
    if found is None:
        dev = loader.device()
        sfx = loader.suffix(x.dtype)
        itemsize = np.dtype(x.dtype).itemsize
        plan = _reduce_plan(pre, channels, post, itemsize, aligned, dev)
        # size the grid with the resources of the kernel the plan picked
        k = kernel(f"{name_stem}_{plan.kind}_{sfx}_w{plan.width}")
        plan = _reduce_plan(pre, channels, post, itemsize, aligned, dev, k.resources)
        k = kernel(f"{name_stem}_{plan.kind}_{sfx}_w{plan.width}")
        found = plans[key] = (plan, k.prepared(plan.grid, plan.block))
    return found


def _reduce_plan(pre, channels, post, itemsize, aligned, dev, res=None):
    """launch.reduce_plan for planar tensors (post > 1), bn_rows.reduce_plan for rows."""
    res = launch.KernelResources() if res is None else res
    if post > 1:
        return launch.reduce_plan(pre, channels, post, itemsize, aligned, dev, res)
    return bn_rows.reduce_plan(pre, channels, itemsize, aligned, dev, res)


_TRAIN_PARAMS = ("scale", "bias", "estimated_mean", "estimated_var")
_INT64 = np.dtype(np.int64)


def check_train(x, scale, bias, est_mean, est_var, counter, momentum, layout):
    """(pre, channels, post, x's pointer, the pointers of scale, bias, est_mean,
    est_var and counter) after checking them all."""
    pre, channels, post = geometry(x, layout)
    xp = loader.ptr(x, "batch_norm: x")
    params = param_ptrs(x, layout, channels, zip(_TRAIN_PARAMS,
                                                  (scale, bias, est_mean, est_var)))
    return pre, channels, post, xp, (*params, _counter_ptr(counter, momentum))


def _counter_ptr(counter, momentum):
    """The counter's device pointer (0 for None) after checking it."""
    if counter is None:
        if momentum is None:
            raise ValueError("batch_norm: momentum=None (cumulative average) needs the counter")
        return 0
    if counter.dtype is not _INT64 and counter.dtype != _INT64 or counter.size != 1:
        raise ValueError(f"batch_norm: counter must be an int64 scalar, got "
                         f"{counter.dtype}{tuple(counter.shape)}")
    return loader.ptr(counter, "batch_norm: counter")


class _Training:
    """The buffers and arguments one training forward shares between its two
    launches: outputs, the scratch (loader.scratch) holding the per-channel
    coefficients [3C], the candidate estimates [2C], then `partials` values for
    the statistics kernel's split partials (at `self.partial`), and the
    Guard's epoch. `params`: the pointers of scale, bias, est_mean, est_var and
    the counter (check_train)."""

    def __init__(self, x, xp, channels, post, params, momentum, eps, out, guard, partials=0,
                 first_batch=True):
        dtype = np.dtype(x.dtype)
        self.x, self.xp, self.channels, self.post = x, xp, channels, post
        self.guard = default_guard() if guard is None else guard
        self.epoch = self.guard.next_epoch()
        if out is None:
            self.y = loader.empty(x.shape, dtype)
            self.yp = loader.address(self.y)
        else:
            launch.check_array("batch_norm: out", out, x.shape, dtype)
            self.y, self.yp = out, loader.ptr(out, "batch_norm: out")
        self.batch_mean, self.batch_var = loader.empty_group(((channels,), (channels,)), dtype)
        self.coef = loader.scratch(5 * channels + partials, dtype)
        self.newest = self.coef + 3 * channels * dtype.itemsize
        self.partial = self.coef + 5 * channels * dtype.itemsize
        self.params = params
        self.status = self.guard.address
        # the StatsOut arguments every statistics kernel ends with (MG_BN_STATS_ARGS)
        self.stats_args = (
            *params, float(eps), 0.0 if momentum is None else float(momentum),
            estimate_rule(momentum, first_batch), self.epoch, loader.address(self.batch_mean),
            loader.address(self.batch_var), self.coef, self.newest, self.status)

    def normalize(self, relu=False):
        """y from the coefficients (max(y, 0) with relu); commit the estimates and the
        counter unless flagged."""
        x, xp, yp = self.x, self.xp, self.yp
        if self.post == 1:
            bn_rows.normalize(x, xp, yp, self.channels, self.coef, 1, self.params[2],
                              self.params[3], self.newest, self.params[4], self.status,
                              self.epoch, relu)
        else:
            packed_launch("bn_normalize", x.dtype, x.size, aligned(xp, yp), self.channels, xp,
                          yp, x.size, self.channels, self.post, self.coef, 1, self.params[2],
                          self.params[3], self.newest, self.params[4], self.status, self.epoch,
                          int(bool(relu)))
        return self.y, self.batch_mean, self.batch_var


def estimate_rule(momentum, first_batch=True):
    """The kernels' `rule` word: bit 0 for momentum=None (the cumulative average), bit 1
    without the first-batch rule (first_batch_sets_estimates=False)."""
    return int(momentum is None) | (0 if first_batch else 2)


def forward_train(x, scale, bias, est_mean, est_var, counter, momentum, eps, layout="NCHW",
                  out=None, guard=None, first_batch=True, relu=False):
    """Training forward: normalise x with its own batch statistics and update
    the running estimates in place.

    x: (N, C, ...) for "NCHW" or (..., C) for "NHWC", float32/float64;
    scale, bias, est_mean, est_var: (C,) of x's dtype; counter: int64 device
    scalar of batches seen, or None (then the first-batch rule is skipped);
    momentum: weight of the OLD estimate in [0, 1], or None for the cumulative
    average est += (batch - est) / k of the k-th batch (needs the counter).
    Estimates take the unbiased variance var * n / (n - 1); on the first batch
    (counter == 0) they are set to the batch statistics unless first_batch is
    False (then momentum blends them from the first batch on, PyTorch's rule); the
    counter goes up by one. All of that happens on the device, skipped for a batch with
    non-finite statistics or estimates (see the module doc and Guard).

    Returns (y, batch_mean, batch_var) (biased batch variance), y in `out`
    when given; relu=True: y = max(y, 0) (batch_norm_relu). Raises ValueError when
    a channel has fewer than 2 values.
    """
    xp = loader.ptr(x, "batch_norm: x")
    plans = loader.cached("batch_norm.train", dict)
    key = (x.shape, x.dtype, layout, aligned(xp), launch.tunables())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _TrainPlan(x, layout, key[3])
    params = param_ptrs(x, layout, plan.channels, zip(_TRAIN_PARAMS,
                                                       (scale, bias, est_mean, est_var)))
    params.append(_counter_ptr(counter, momentum))
    run = _Training(x, xp, plan.channels, plan.post, params, momentum, eps, out, guard,
                    plan.partials, first_batch)
    resident = plan.resident
    if resident is not None and (resident.width == 1 or aligned(run.yp)):
        from minigraph.kernels.cuda import bn_resident

        return bn_resident.train(resident, run, plan.pre, plan.channels, plan.post, relu)
    plan.stats(xp, plan.pre, plan.channels, *plan.split_args, run.partial,
               loader.address(loader.tickets(plan.tickets)), *run.stats_args)
    return run.normalize(relu)


class _TrainPlan:
    """forward_train's geometry and statistics launch for one device, x shape,
    dtype, layout and alignment of x (checked when made: ValueError for a channel
    with fewer than 2 values)."""

    def __init__(self, x, layout, aligned):
        self.pre, self.channels, self.post = geometry(x, layout)
        n = self.pre * self.post
        if n <= 1:
            raise ValueError(f"batch_norm: training needs more than one value per channel, got "
                             f"n={n} for x of shape {tuple(x.shape)} ({layout})")
        reduce, self.stats = reduce_plan("bn_stats", x, aligned, self.pre, self.channels,
                                          self.post)
        self.split_args, self.tickets = reduce.split_args, reduce.tickets
        self.partials = 3 * self.channels * reduce.splits
        from minigraph.kernels.cuda import bn_resident

        self.resident = bn_resident.cached_plan(x, self.pre, self.channels, self.post, aligned, 1)


def forward_infer(x, scale, bias, est_mean, est_var, eps, layout="NCHW", out=None, relu=False):
    """Inference (and use_global_est) forward, one elementwise kernel:
    y = (x - est_mean) / sqrt(est_var + eps) * scale + bias per channel (then
    max(y, 0) with relu). Nothing else is written. Returns y (in `out` when given)."""
    pre, channels, post = geometry(x, layout)
    xp = loader.ptr(x, "batch_norm: x")
    sp, bp, mp, vp = param_ptrs(x, layout, channels, zip(_TRAIN_PARAMS,
                                                          (scale, bias, est_mean, est_var)))
    if out is None:
        y = loader.empty(x.shape, x.dtype)
    else:
        launch.check_array("batch_norm: out", out, x.shape, x.dtype)
        y = out
    if x.size:
        yp = loader.ptr(y)
        if post == 1:
            bn_rows.infer(x, xp, yp, channels, mp, vp, sp, bp, eps, relu)
        else:
            packed_launch("bn_infer", x.dtype, x.size, aligned(xp, yp), 1, xp, yp, x.size,
                          channels, post, mp, vp, sp, bp, float(eps), int(bool(relu)))
    return y
