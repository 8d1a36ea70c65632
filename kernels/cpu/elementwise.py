"""CPU kernels of elementwise_add (y broadcast along x's dims from `axis`) and sum
(ops/elementwise.py).
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import rows_native


def y_start(x_ndim, y_ndim, axis):
    """The dim of x where y's dims start (axis -1: the trailing dims)."""
    return x_ndim - y_ndim if axis == -1 else axis


def y_view(x_ndim, y, start):
    """y reshaped so numpy broadcasting lines it up with x's dims from `start`."""
    return y.reshape(y.shape + (1,) * (x_ndim - start - y.ndim))


def elementwise_add_cpu(op, ins, ctx):
    """out = x + y, y broadcast along x's dims from `axis`; into x's array when it is
    handed over."""
    x, y = ins["x"], ins["y"]
    if y.ndim == 1 and op.attrs["axis"] in (-1, x.ndim - 1):     # a bias on the last axis
        into = x if "x" in ctx.donated else None
        done = rows_native.add_bias(x, y, into)
        return {"out": np.add(x, y, out=into) if done is None else done}
    start = y_start(x.ndim, y.ndim, op.attrs["axis"])
    into = x if "x" in ctx.donated else None
    done = rows_native.add_channel_bias(x, y, start, into) if y.ndim == 1 else None
    return {"out": np.add(x, y_view(x.ndim, y, start), out=into) if done is None else done}


def elementwise_add_grad_cpu(op, ins, ctx):
    """dx = dout (the same array: kernels write only inputs handed over to them,
    OpSchema.reuse); dy = dout summed over every dim of x outside y's run - along
    the trailing dims by one BLAS product with a ones vector, over the leading ones
    in float64 (then rounded once: checkpoints of earlier versions resume bit for bit;
    in float32, by rows_native.sum_rows where it applies, numpy's bits)."""
    y, d = ins["y"], ins["dout"]
    out = {}
    if op.wants("dx"):
        out["dx"] = d
    if op.wants("dy"):
        start = y_start(d.ndim, y.ndim, op.attrs["axis"])
        post = math.prod(d.shape[start + y.ndim:])
        rows = np.ascontiguousarray(d).reshape(-1, y.size, post)
        if post > 1:
            rows = rows @ np.ones(post, dtype=d.dtype)
        else:
            rows = rows[..., 0]
        dy = rows_native.sum_rows(rows)
        if dy is None:
            dy = np.add.reduce(rows, axis=0, dtype=np.float64).astype(d.dtype)
        out["dy"] = dy.reshape(y.shape)
    return out


def sum_cpu(op, ins, ctx):
    """out = x[0] + x[1] + ..., added in that order (a new array; the first two in
    one pass, not a copy and an add; on the threads where rows_native.add takes
    them, with numpy's bits)."""
    xs = ins["x"]
    if len(xs) == 1:
        return {"out": xs[0].copy()}
    out = np.empty_like(xs[0])
    for i, x in enumerate(xs[1:]):
        a = xs[0] if i == 0 else out
        if rows_native.add(a, x, out) is None:
            np.add(a, x, out=out)
    return {"out": out}


def sum_grad_cpu(op, ins, ctx):
    """dx = a copy of dout."""
    return {"dx": ins["dout"].copy()}
