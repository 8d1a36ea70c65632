"""CPU kernels of matmul (ops/matmul.py): np.matmul of x and y (each optionally with
its last two axes swapped) with batch axes broadcast; the gradients are summed back
over the batch axes an operand was broadcast along. A 2-D y shared by every batch (an
output projection tied to an embedding table) is one BLAS product of x's rows."""
from __future__ import annotations

import functools

import numpy as np

from minigraph.kernels.cpu import prepared
from minigraph.kernels.cpu.binary import reduce_to
from minigraph.kernels.cpu.mul import weight_grad


def _t(a, flag):
    return np.swapaxes(a, -1, -2) if flag else a


def _rows(x, a, y):
    """x's rows as one matrix when y is 2-D and x is not transposed (else None)."""
    if y.ndim != 2 or x.ndim < 3 or a["transpose_x"]:
        return None
    return x.reshape(-1, x.shape[-1])


def matmul_cpu(op, ins, ctx):
    """out = op(x) @ op(y), op the transpose of the last two axes where asked."""
    a = op.attrs
    x, y = ins["x"], ins["y"]
    rows = _rows(x, a, y)
    if rows is not None:
        ys = _t(y, a["transpose_y"])
        return {"out": (rows @ ys).reshape(x.shape[:-1] + (ys.shape[1],))}
    return {"out": np.matmul(_t(x, a["transpose_x"]), _t(y, a["transpose_y"]))}


def bind_matmul(op):
    """matmul_cpu's bound form (minigraph.bound_run) for a 2-D y shared by every batch
    (an output projection: x's rows as one BLAS product) into the same array every
    run; None for other products (the kernel runs)."""
    a = op.attrs
    kept = {"key": None}

    def prepare(x, y):
        rows = _rows(x, a, y)
        if rows is None or not x.flags.c_contiguous or x.dtype != y.dtype:
            return None
        ys = _t(y, a["transpose_y"])
        key = (x.shape, ys.shape, x.dtype)
        if key != kept["key"]:
            out = prepared.aligned_empty(x.shape[:-1] + (ys.shape[1],), x.dtype)
            kept.update(key=key, out2=out.reshape(-1, ys.shape[1]), outs={"out": out})
        return functools.partial(np.matmul, rows, ys, out=kept["out2"]), kept["outs"]
    return prepared.form(("x", "y"), prepare, streamed=("x",))


def matmul_grad_cpu(op, ins, ctx):
    """With X = op(x), Y = op(y): dX = dout @ Y^T, dY = X^T @ dout, summed over the
    broadcast batch axes, transposed back where x or y was."""
    a = op.attrs
    x, y, d = ins["x"], ins["y"], ins["dout"]
    xs, ys = _t(x, a["transpose_x"]), _t(y, a["transpose_y"])
    rows = _rows(x, a, y)
    if rows is not None:                  # y shared by every batch: 2-D products
        d2 = d.reshape(-1, d.shape[-1])
        out = {}
        if op.wants("dx"):
            out["dx"] = np.ascontiguousarray((d2 @ ys.T).reshape(x.shape), dtype=x.dtype)
        if op.wants("dy"):
            g = weight_grad(rows, d2)
            out["dy"] = np.ascontiguousarray(g.T if a["transpose_y"] else g, dtype=y.dtype)
        return out
    out = {}
    if op.wants("dx"):
        g = np.matmul(d, np.swapaxes(ys, -1, -2))
        g = _t(g, a["transpose_x"])
        out["dx"] = reduce_to(g, x.shape, x.dtype)
    if op.wants("dy"):
        g = np.matmul(np.swapaxes(xs, -1, -2), d)
        g = _t(g, a["transpose_y"])
        out["dy"] = reduce_to(g, y.shape, y.dtype)
    return out
