"""CPU kernels of concat (ops/concat.py).
"""
from __future__ import annotations

import numpy as np


def concat_cpu(op, ins, ctx):
    """out = np.concatenate(x, axis)."""
    return {"out": np.concatenate(ins["x"], axis=op.attrs["axis"])}


def concat_grad_cpu(op, ins, ctx):
    """dx = dout[..., start:start + x[index].shape[axis], ...] along axis (a copy)."""
    if not op.wants("dx"):
        return {}
    xs, d = ins["x"], ins["dout"]
    index = op.attrs["index"]
    ax = op.attrs["axis"] % d.ndim
    start = sum(x.shape[ax] for x in xs[:index])
    where = [slice(None)] * d.ndim
    where[ax] = slice(start, start + xs[index].shape[ax])
    return {"dx": d[tuple(where)].copy()}
