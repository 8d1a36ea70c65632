"""CPU kernels of softmax (ops/softmax.py), in float64 from the max-shifted values.
"""
from __future__ import annotations

import numpy as np


def softmax_cpu(op, ins, ctx):
    """out = exp(z) / sum(exp(z), axis), z = x - max(x, axis), in float64."""
    x = ins["x"]
    if x.size == 0:
        return {"out": np.empty_like(x)}
    axis = op.attrs["axis"]
    z = x.astype(np.float64)
    with np.errstate(over="ignore"):        # x - max = -inf only where exp gives 0 anyway
        z -= z.max(axis=axis, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=axis, keepdims=True)
    return {"out": z.astype(x.dtype)}


def softmax_grad_cpu(op, ins, ctx):
    """dx = out * (dout - sum(dout * out, axis)), in float64."""
    if not op.wants("dx"):
        return {}
    out, d = ins["out"].astype(np.float64), ins["dout"]
    inner = (d * out).sum(axis=op.attrs["axis"], keepdims=True)
    return {"dx": (out * (d - inner)).astype(d.dtype)}
