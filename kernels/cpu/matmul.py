"""CPU kernels of matmul (ops/matmul.py): np.matmul of x and y (each optionally with
its last two axes swapped) with batch axes broadcast; the gradients are summed back
over the batch axes an operand was broadcast along."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu.binary import reduce_to


def _t(a, flag):
    return np.swapaxes(a, -1, -2) if flag else a


def matmul_cpu(op, ins, ctx):
    """out = op(x) @ op(y), op the transpose of the last two axes where asked."""
    a = op.attrs
    return {"out": np.matmul(_t(ins["x"], a["transpose_x"]), _t(ins["y"], a["transpose_y"]))}


def matmul_grad_cpu(op, ins, ctx):
    """With X = op(x), Y = op(y): dX = dout @ Y^T, dY = X^T @ dout, summed over the
    broadcast batch axes, transposed back where x or y was."""
    a = op.attrs
    x, y, d = ins["x"], ins["y"], ins["dout"]
    xs, ys = _t(x, a["transpose_x"]), _t(y, a["transpose_y"])
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
