"""CPU kernels of add, subtract, multiply and divide (ops/binary.py): numpy broadcasting both ways;
the gradients are summed in float64 back to each input's shape (`reduce_to`).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import prepared, rows_native


def reduce_to(g, shape, dtype):
    """g (of the broadcast shape) summed in float64 over the axes that broadcast
    `shape` to it, reshaped to `shape`, as a new `dtype` array."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and g.shape[lead + i] != 1)
    if axes:
        g = np.add.reduce(g, axis=axes, dtype=np.float64)
    return np.array(g.reshape(shape), dtype=dtype)


def add_cpu(op, ins, ctx):
    """out = x + y, broadcast; into x's or y's array when one of out's shape is
    handed over."""
    x, y = ins["x"], ins["y"]
    into = None
    if ctx.donated:
        shape = np.broadcast_shapes(x.shape, y.shape)
        into = next((ins[s] for s in ctx.donated if ins[s].shape == shape), None)
    done = rows_native.add(x, y, into) if x.shape == y.shape else None
    return {"out": np.add(x, y, out=into) if done is None else done}   # numpy's bits


def bind_add(op):
    """add_cpu's bound form (minigraph.bound_run): the sum into the same array every
    run."""
    kept = {"key": None}

    def run(ins):
        x, y = ins["x"], ins["y"]
        key = (x.shape, y.shape, x.dtype, y.dtype)
        if key != kept["key"]:
            out = prepared.aligned_empty(np.broadcast_shapes(x.shape, y.shape),
                                         np.result_type(x, y))
            # rows_native.add splits only arrays of 2 * MIN_THREAD_ADD values or more
            threads = x.shape == y.shape and x.size >= 2 * rows_native.MIN_THREAD_ADD
            kept.update(key=key, out=out, outs={"out": out}, threads=threads)
        out = kept["out"]
        if not kept["threads"] or rows_native.add(x, y, out) is None:
            np.add(x, y, out=out)
        return kept["outs"]
    return run


def add_grad_cpu(op, ins, ctx):
    """dx = dout reduced to x's shape, dy = dout reduced to y's shape (each when bound);
    an input of dout's shape and dtype gets dout itself, not a copy (kernels never
    write their inputs unless handed them: see OpSchema.reuse)."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    out = {}
    for slot, v in (("dx", x), ("dy", y)):
        if op.wants(slot):
            same = v.shape == d.shape and v.dtype == d.dtype
            out[slot] = d if same else reduce_to(d, v.shape, v.dtype)
    return out


def multiply_cpu(op, ins, ctx):
    """out = x * y, broadcast."""
    return {"out": np.multiply(ins["x"], ins["y"])}


def multiply_grad_cpu(op, ins, ctx):
    """dx = (dout * y) reduced to x's shape, dy = (dout * x) reduced to y's shape; the
    products in float64."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    out = {}
    if op.wants("dx"):
        out["dx"] = reduce_to(np.multiply(d, y, dtype=np.float64), x.shape, x.dtype)
    if op.wants("dy"):
        out["dy"] = reduce_to(np.multiply(d, x, dtype=np.float64), y.shape, y.dtype)
    return out


def subtract_cpu(op, ins, ctx):
    """out = x - y, broadcast; into x's or y's array when one of out's shape is handed
    over."""
    x, y = ins["x"], ins["y"]
    shape = np.broadcast_shapes(x.shape, y.shape)
    into = next((ins[s] for s in ctx.donated if ins[s].shape == shape), None)
    return {"out": np.subtract(x, y, out=into)}


def subtract_grad_cpu(op, ins, ctx):
    """dx = dout reduced to x's shape (dout itself when it has it), dy = -dout reduced to
    y's shape."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    out = {}
    if op.wants("dx"):
        same = x.shape == d.shape and x.dtype == d.dtype
        out["dx"] = d if same else reduce_to(d, x.shape, x.dtype)
    if op.wants("dy"):
        out["dy"] = np.negative(reduce_to(d, y.shape, y.dtype))
    return out


def divide_cpu(op, ins, ctx):
    """out = x / y, broadcast (IEEE: x / 0 is inf or nan, as numpy and torch give)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return {"out": np.divide(ins["x"], ins["y"])}


def divide_grad_cpu(op, ins, ctx):
    """dx = (dout / y) reduced to x's shape, dy = -(dout * x / y^2) reduced to y's shape;
    in float64."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    y64 = y.astype(np.float64)
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.divide(d, y64, dtype=np.float64)
        if op.wants("dx"):
            out["dx"] = reduce_to(q, x.shape, x.dtype)
        if op.wants("dy"):
            out["dy"] = reduce_to(-q * x / y64, y.shape, y.dtype)
    return out
