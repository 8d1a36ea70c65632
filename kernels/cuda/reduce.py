"""Launchers for kernels/cuda/reduce.cu: reduce_sum, reduce_mean and reduce_max of a
device array over any set of axes, and their gradients; the op kernels of
ops/reduce.py.

The shapes are collapsed (kernels/cuda/strided.py) into kept and reduced dims. A
sum or mean whose kept dims form one run (a full sum, a row or column sum) is
elementwise.channel_sum, split over many blocks (a mean then divides by the
count in the dtype); any other reduction runs reduce.cu's `rows` kernels (the
innermost dim reduced: a block per output) or `cols` kernels (the innermost dim
kept: a warp over 32 neighbouring outputs). Sums add in double.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

from minigraph.kernels.cuda import elementwise, launch, loader, shape_ops, strided
from minigraph.kernels.cuda import map as maps

MODULE = "reduce"
_DIMS = "q" * strided.MAX_DIMS
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"reduce_rows_{_t}": "PPqqid" + 4 * _DIMS,
                       f"reduce_cols_{_t}": "PPqqid" + 4 * _DIMS,
                       f"reduce_max_grad_rows_{_t}": "PPPPqq" + 4 * _DIMS,
                       f"reduce_max_grad_cols_{_t}": "PPPPqq" + 4 * _DIMS,
                       f"broadcast_back_{_t}": "PPqd" + 2 * _DIMS})
KINDS = {"sum": 0, "max": 1}          # reduce.cu's ReduceKind; a mean is a sum / count
COLS_BLOCK = (32, 8, 1)               # threads across outputs x threads along the reduction


def normalize_axes(rank, axis):
    """The reduced axes of a rank-`rank` tensor, sorted, from None (every axis) or a
    tuple of axes (negative from the end); ValueError for an axis out of range or
    named twice."""
    if axis is None:
        return tuple(range(rank))
    out = set()
    for a in axis:
        if not -rank <= int(a) < rank:
            raise ValueError(f"reduce: no axis {a} in a tensor of rank {rank}")
        if int(a) % rank in out:
            raise ValueError(f"reduce: axis {a} is named twice in {tuple(axis)}")
        out.add(int(a) % rank)
    return tuple(sorted(out))


class Plan(NamedTuple):
    """How a reduction runs (see `plan`)."""

    keep: tuple       # x's shape with the reduced axes as 1
    count: int        # values per output
    layout: str       # "copy" (nothing reduced), "rows" or "cols" (see reduce.cu)
    kn: tuple         # the collapsed kept dims and their x strides
    ks: tuple
    rn: tuple         # the collapsed reduced dims and their x strides
    rs: tuple
    dims: tuple       # every collapsed dim, and dout's strides there (0 where reduced)
    ds: tuple
    view: tuple       # (pre, C, post) when the kept dims form one run, else None


@functools.lru_cache(maxsize=1024)
def plan(shape, axes):
    """The Plan of a reduction of a tensor of `shape` over sorted `axes`."""
    shape = tuple(int(n) for n in shape)
    keep = tuple(1 if i in axes else n for i, n in enumerate(shape))
    count = math.prod(shape[a] for a in axes)
    dims, (xs, ts) = strided.collapse(shape, strided.contiguous_strides(shape),
                                      strided.broadcast_strides(shape, keep))
    kn, ks, rn, rs = strided.split_kept(dims, xs, ts)
    layout = "copy" if not rn else "cols" if ts[-1] else "rows"
    return Plan(keep, count, layout, tuple(kn), tuple(ks), tuple(rn), tuple(rs), dims,
                tuple(ts), strided.channel_view_of(dims, ts))


def out_shape(shape, axes, keepdim):
    """The shape of the reduction of `shape` over sorted `axes`."""
    if keepdim:
        return tuple(1 if i in axes else int(n) for i, n in enumerate(shape))
    return tuple(int(n) for i, n in enumerate(shape) if i not in axes)


def _config(layout, kept, reduced, res):
    dev = loader.device()
    if layout == "rows":
        threads = launch.row_block_threads(reduced, dev)
        return (launch.rows_grid(kept, threads, dev, res), 1, 1), (threads, 1, 1)
    tiles = -(-kept // COLS_BLOCK[0])
    return (launch.rows_grid(tiles, math.prod(COLS_BLOCK), dev, res), 1, 1), COLS_BLOCK


def _launch(name, layout, kept, reduced, *args):
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    grid, block = _config(layout, kept, reduced, k.resources)
    k.launch(grid, block, *args)


def reduce(x, kind, axis=None, keepdim=False, out=None):
    """out = x reduced over `axis` (None: every axis; a tuple, negative from the end),
    `kind` "sum", "mean" or "max"; keepdim keeps the reduced axes as size 1. Sums
    and means add in double; a mean of no values is nan; the maximum of no values
    is a ValueError; NaN wins a maximum. Returns out (new unless given)."""
    if kind not in ("sum", "mean", "max"):
        raise ValueError(f"reduce: kind must be 'sum', 'mean' or 'max', got {kind!r}")
    launch.check_contiguous(f"reduce_{kind}: x", x)
    axes = normalize_axes(len(x.shape), axis)
    shape = out_shape(x.shape, axes, keepdim)
    if out is None:
        out = loader.empty(shape, x.dtype)
    launch.check_array(f"reduce_{kind}: out", out, shape, x.dtype)
    p = plan(tuple(x.shape), axes)
    if out.size == 0:
        return out
    if p.count == 0:
        if kind == "max":
            raise ValueError(f"reduce_max: x of shape {tuple(x.shape)} has no values along "
                             f"the reduced axes {axes}")
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(out, 0.0 if kind == "sum" else math.nan)
    if p.layout == "copy":
        return shape_ops.copy(x, out=out)
    if kind != "max" and p.view is not None:
        elementwise.channel_sum(x, *p.view, out=out)
        if kind == "mean":
            maps.unary(MODULE, "divide_by", out, float(p.count), out=out)
        return out
    what = f"reduce_{kind}"
    name = f"reduce_{p.layout}_{loader.suffix(x.dtype)}"
    _launch(name, p.layout, out.size, p.count, loader.ptr(x, f"{what}: x"),
            loader.ptr(out, f"{what}: out"), out.size, p.count, KINDS.get(kind, 0),
            float(p.count) if kind == "mean" else 1.0,
            *strided.padded(what, p.kn, p.ks), *strided.padded(what, p.rn, p.rs))
    return out


def reduce_grad(x_shape, dout, kind, axis=None, keepdim=False):
    """dx of x_shape for reduce_sum ("sum": dout broadcast back over the reduced axes)
    or reduce_mean ("mean": dout / count, in double); dout has the reduction's shape."""
    if kind not in ("sum", "mean"):
        raise ValueError(f"reduce_grad: kind must be 'sum' or 'mean', got {kind!r}")
    x_shape = tuple(int(n) for n in x_shape)
    what = f"reduce_{kind}_grad"
    axes = normalize_axes(len(x_shape), axis)
    launch.check_array(f"{what}: dout", dout, out_shape(x_shape, axes, keepdim), dout.dtype)
    p = plan(x_shape, axes)
    dx = loader.empty(x_shape, dout.dtype)
    if dx.size == 0:
        return dx
    if p.layout == "copy":
        return shape_ops.copy(dout, out=dx)
    name = f"broadcast_back_{loader.suffix(dout.dtype)}"
    loader.flat_go(MODULE, name, SIGNATURES[name], dx.size)(
        loader.ptr(dout, f"{what}: dout"), loader.address(dx), dx.size,
        float(p.count) if kind == "mean" else 1.0, *strided.padded(what, p.dims, p.ds))
    return dx


def reduce_max_grad(x, out, dout, axis=None, keepdim=False):
    """dx of out = reduce_max(x): dout / ties where x equals its output's maximum, else
    0 (ties: how many values of that output equal it; the share in double)."""
    what = "reduce_max_grad"
    launch.check_contiguous(f"{what}: x", x)
    axes = normalize_axes(len(x.shape), axis)
    shape = out_shape(x.shape, axes, keepdim)
    launch.check_array(f"{what}: out", out, shape, x.dtype)
    launch.check_array(f"{what}: dout", dout, shape, x.dtype)
    p = plan(tuple(x.shape), axes)
    dx = loader.empty(tuple(x.shape), x.dtype)
    if dx.size == 0:
        return dx
    layout, kn, ks = p.layout, p.kn, p.ks
    if layout == "copy":                     # one value per output
        layout, kn, ks = "cols", (x.size,), (1,)
    name = f"reduce_max_grad_{layout}_{loader.suffix(x.dtype)}"
    _launch(name, layout, out.size, p.count, loader.ptr(x, f"{what}: x"), loader.ptr(out),
            loader.ptr(dout), loader.address(dx), out.size, p.count,
            *strided.padded(what, kn, ks), *strided.padded(what, p.rn, p.rs))
    return dx


# ---- op kernels -------------------------------------------------------------------

def _reduce_op(kind):
    def forward(op, ins, ctx):
        return {"out": reduce(ins["x"], kind, op.attrs["axis"], op.attrs["keepdim"])}
    forward.__doc__ = f"out = the {kind} of x over `axis` on the device (sums in double)."
    forward.__name__ = f"reduce_{kind}_gpu"
    return forward


def _reduce_grad_op(kind):
    def backward(op, ins, ctx):
        if not op.wants("dx"):
            return {}
        return {"dx": reduce_grad(ins["x"].shape, ins["dout"], kind, op.attrs["axis"],
                                  op.attrs["keepdim"])}
    backward.__doc__ = (f"dx = dout{' / count' if kind == 'mean' else ''} broadcast back "
                        "over the reduced axes on the device, when bound.")
    backward.__name__ = f"reduce_{kind}_grad_gpu"
    return backward


reduce_sum_gpu = _reduce_op("sum")
reduce_mean_gpu = _reduce_op("mean")
reduce_max_gpu = _reduce_op("max")
reduce_sum_grad_gpu = _reduce_grad_op("sum")
reduce_mean_grad_gpu = _reduce_grad_op("mean")


def reduce_max_grad_gpu(op, ins, ctx):
    """dx = dout / ties where x equals the maximum, else 0, on the device, when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": reduce_max_grad(ins["x"], ins["out"], ins["dout"], op.attrs["axis"],
                                  op.attrs["keepdim"])}
