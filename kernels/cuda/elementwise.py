"""Launchers for kernels/cuda/elementwise.cu: elementwise_add with Paddle
broadcasting and its gradient, sum of n tensors, copy, per-channel sums."""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import launch, loader

MODULE = "elementwise"
_WIDTHS = (("f32", (1, 4)), ("f64", (1, 2)))
SIGNATURES = {}
for _t, _ws in _WIDTHS:
    for _w in _ws:
        SIGNATURES.update({
            f"add_{_t}_w{_w}": "PPPqqq",
            f"copy_{_t}_w{_w}": "PPq",
            f"sum_{_t}_w{_w}": "Pqii" + "P" * 8,
            f"channel_sum_planar_{_t}_w{_w}": "PqqqqiPPP",
            f"channel_sum_rows_{_t}_w{_w}": "PqqqiPPP",
        })
SUM_ARITY = 8          # inputs per sum launch (elementwise.cu's SUM_ARITY)


def broadcast_view(x_shape, y_shape, axis=-1):
    """(pre, n, post): y's dims are x's dims [start, start + y.ndim) with start
    = axis (or x.ndim - y.ndim for axis=-1); ValueError when they are not."""
    x_shape, y_shape = tuple(x_shape), tuple(y_shape)
    start = len(x_shape) - len(y_shape) if axis == -1 else axis
    if not 0 <= start <= len(x_shape) - len(y_shape) or \
            x_shape[start:start + len(y_shape)] != y_shape:
        raise ValueError(f"elementwise_add: y of shape {y_shape} does not match the dims of x "
                         f"{x_shape} from axis={axis}")
    return (math.prod(x_shape[:start]), math.prod(y_shape),
            math.prod(x_shape[start + len(y_shape):]))


def add(x, y, axis=-1, out=None):
    """out = x + y with y broadcast along x's dims from `axis` (Paddle rules; see
    broadcast_view). A new array of x's shape unless `out` is given. Returns out."""
    if x.dtype != y.dtype:
        raise ValueError(f"elementwise_add: dtypes differ ({x.dtype} and {y.dtype})")
    views = loader.cached("elementwise.views", dict)
    key = (x.shape, y.shape, axis)
    view = views.get(key)
    if view is None:
        view = views[key] = broadcast_view(x.shape, y.shape, axis)
    _, n, post = view
    launch.check_contiguous("elementwise_add: x", x)
    launch.check_contiguous("elementwise_add: y", y)
    if out is None:
        out = loader.empty(x.shape, x.dtype)
    else:
        launch.check_array("elementwise_add: out", out, x.shape, x.dtype)
    if x.size:
        loader.launch_flat(MODULE, SIGNATURES, "add_{t}_w{w}", x.dtype, x.size, (x, y, out),
                           x.size, n, post)
    return out


def copy(src, out=None):
    """A device-to-device copy of `src` (into `out` when given). Returns out."""
    launch.check_contiguous("copy: src", src)
    if out is None:
        out = loader.empty(src.shape, src.dtype)
    else:
        launch.check_array("copy: out", out, src.shape, src.dtype)
    if src.size:
        loader.launch_flat(MODULE, SIGNATURES, "copy_{t}_w{w}", src.dtype, src.size, (src, out),
                           src.size)
    return out


def sum_n(xs, out=None):
    """out = xs[0] + xs[1] + ... (same shapes and dtypes), at most SUM_ARITY
    inputs per launch. Returns out (a new array unless given)."""
    if not xs:
        raise ValueError("sum: needs at least one input")
    first = xs[0]
    launch.check_contiguous("sum: inputs", *xs)
    for i, a in enumerate(xs):
        if tuple(a.shape) != tuple(first.shape) or a.dtype != first.dtype:
            raise ValueError(f"sum: input {i} is {a.dtype}{tuple(a.shape)}, input 0 is "
                             f"{first.dtype}{tuple(first.shape)}")
    out = loader.empty(first.shape, first.dtype) if out is None else out
    launch.check_array("sum: out", out, first.shape, first.dtype)
    if first.size == 0:
        return out
    for lo in range(0, len(xs), SUM_ARITY):
        part = list(xs[lo:lo + SUM_ARITY])
        pointers = [loader.ptr(a) for a in part] + [0] * (SUM_ARITY - len(part))
        width = launch.vector_width(np.dtype(first.dtype).itemsize)
        if not launch.is_aligned(loader.ptr(out), *pointers[:len(part)]):
            width = 1
        name = f"sum_{loader.suffix(first.dtype)}_w{width}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        dev = loader.device()
        threads = launch.block_threads(dev)
        grid = launch.flat_grid(-(-first.size // width), dev, threads, k.resources)
        k.launch((grid, 1, 1), (threads, 1, 1), loader.ptr(out), first.size, len(part),
                 int(lo > 0), *pointers)
    return out


def channel_sum(d, pre, channels, post, out=None):
    """out[c] = the sum of d viewed as (pre, channels, post) over pre and post,
    accumulated in double on the device. Returns out (shape (channels,) unless
    an `out` of another shape with `channels` elements is given). The split
    partials live in the device's scratch (loader.scratch)."""
    dp = loader.ptr(d, "channel_sum: d")
    out = loader.empty((channels,), d.dtype) if out is None else out
    if d.size != pre * channels * post:
        raise ValueError(f"channel_sum: {d.size} values do not form ({pre}, {channels}, {post})")
    if out.size != channels or out.dtype != d.dtype:
        raise ValueError(f"channel_sum: out must hold {channels} values of {d.dtype}, got "
                         f"{out.dtype}{tuple(out.shape)}")
    if channels == 0:
        return out
    aligned = dp % launch.VECTOR_BYTES == 0
    plans = loader.cached("elementwise.channel_sum", dict)
    key = (pre, channels, post, d.dtype, aligned, launch.tunables())
    found = plans.get(key)
    if found is None:
        found = plans[key] = _channel_sum_plan(pre, channels, post, d.dtype, aligned)
    plan, go = found
    partial = loader.scratch(channels * plan.splits, np.float64)
    go(dp, pre, channels, *plan.split_args, partial,
       loader.address(loader.tickets(plan.tickets)), loader.ptr(out, "channel_sum: out"))
    return out


def _channel_sum_plan(pre, channels, post, dtype, aligned):
    """(ReducePlan, its prepared launch) of channel_sum."""
    plan = launch.reduce_plan(pre, channels, post, np.dtype(dtype).itemsize, aligned,
                              loader.device())
    name = f"channel_sum_{plan.kind}_{loader.suffix(dtype)}_w{plan.width}"
    return plan, loader.kernel(MODULE, name, SIGNATURES[name]).prepared(plan.grid, plan.block)


def add_grad(dout, y_shape, axis=-1, need_dx=True, need_dy=True):
    """(dx, dy) of out = x + y: dx = a copy of dout, dy = dout summed over every
    dim outside y's run (shape y_shape); None for the ones not needed."""
    views = loader.cached("elementwise.views", dict)
    key = (dout.shape, y_shape, axis)
    view = views.get(key)
    if view is None:
        view = views[key] = broadcast_view(dout.shape, y_shape, axis)
    dx = copy(dout) if need_dx else None
    dy = None
    if need_dy:
        dy = loader.empty(tuple(y_shape), dout.dtype)
        channel_sum(dout, *view, out=dy)
    return dx, dy


# ---- op kernels -------------------------------------------------------------------

def elementwise_add_gpu(op, ins, ctx):
    """out = x + y on the device, y broadcast along x's dims from `axis`."""
    x, y = ins["x"], ins["y"]
    return {"out": add(x, y, op.attrs["axis"])}


def elementwise_add_grad_gpu(op, ins, ctx):
    """dx = a device copy of dout; dy = dout summed over the broadcast dims (in
    double on the device); each only when bound."""
    y, d = ins["y"], ins["dout"]
    dx, dy = add_grad(d, tuple(y.shape), op.attrs["axis"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


def sum_gpu(op, ins, ctx):
    """out = x[0] + x[1] + ... (a new device array)."""
    return {"out": sum_n(ins["x"])}


def sum_grad_gpu(op, ins, ctx):
    """dx = a device copy of dout."""
    return {"dx": copy(ins["dout"])}
