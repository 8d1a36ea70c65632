"""CPU kernels of reduce_sum, reduce_mean and reduce_max (ops/reduce.py): sums in
float64, the result in x's dtype; reduce_max's gradient is shared equally by the
values equal to the maximum (torch.amax's)."""
from __future__ import annotations

import numpy as np


def axes(op, ndim):
    """The reduced axes as a tuple (every axis for None)."""
    a = op.attrs["axis"]
    return tuple(range(ndim)) if a is None else tuple(d % ndim for d in a)


def _kept(d, op, x_ndim):
    """dout with the reduced axes back as size-1 dims (for broadcasting against x)."""
    if op.attrs["keepdim"]:
        return d
    return np.expand_dims(d, axes(op, x_ndim)) if x_ndim else d


def reduce_sum_cpu(op, ins, ctx):
    """out = the sum over `axis`, in float64."""
    x = ins["x"]
    out = np.add.reduce(x, axis=axes(op, x.ndim), dtype=np.float64, keepdims=op.attrs["keepdim"])
    return {"out": np.asarray(out).astype(x.dtype)}


def reduce_mean_cpu(op, ins, ctx):
    """out = the mean over `axis`, in float64 (nan for no values, as numpy and torch)."""
    x = ins["x"]
    reduced = axes(op, x.ndim)
    total = np.add.reduce(x, axis=reduced, dtype=np.float64, keepdims=op.attrs["keepdim"])
    with np.errstate(invalid="ignore", divide="ignore"):
        out = total / int(np.prod([x.shape[a] for a in reduced]))
    return {"out": np.asarray(out).astype(x.dtype)}


def reduce_max_cpu(op, ins, ctx):
    """out = the largest value over `axis` (nan when a reduced value is nan)."""
    x = ins["x"]
    return {"out": np.asarray(np.max(x, axis=axes(op, x.ndim),
                                     keepdims=op.attrs["keepdim"])).astype(x.dtype)}


def reduce_sum_grad_cpu(op, ins, ctx):
    """dx = dout broadcast back over the reduced axes."""
    x, d = ins["x"], ins["dout"]
    return {"dx": np.broadcast_to(_kept(d, op, x.ndim), x.shape).astype(x.dtype)}


def reduce_mean_grad_cpu(op, ins, ctx):
    """dx = dout / count broadcast back over the reduced axes."""
    x, d = ins["x"], ins["dout"]
    count = max(int(np.prod([x.shape[a] for a in axes(op, x.ndim)])), 1)
    share = _kept(d, op, x.ndim).astype(np.float64) / count
    return {"dx": np.broadcast_to(share, x.shape).astype(x.dtype)}


def reduce_max_grad_cpu(op, ins, ctx):
    """dx = dout / ties where x equals the maximum, else 0."""
    x, out, d = ins["x"], ins["out"], ins["dout"]
    hit = x == _kept(out, op, x.ndim)
    ties = np.add.reduce(hit, axis=axes(op, x.ndim), keepdims=True, dtype=np.float64)
    share = _kept(d, op, x.ndim).astype(np.float64).reshape(ties.shape) / np.maximum(ties, 1)
    return {"dx": (hit * share).astype(x.dtype)}
