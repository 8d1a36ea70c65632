"""CPU kernels of mean (ops/mean.py): the mean of every element, accumulated in
float64; 0 for an empty x.
"""
from __future__ import annotations

import numpy as np


def mean_cpu(op, ins, ctx):
    """out = mean(x), accumulated in float64 (pairwise), cast back to x's dtype; 0 when
    x is empty."""
    x = ins["x"]
    if x.size == 0:
        return {"out": np.zeros((), dtype=x.dtype)}
    # np.mean's own steps (a float64 add.reduce over every axis, then / the count)
    # without its Python wrapper, which a step's loss paid several times over cold
    total = np.add.reduce(x, axis=None, dtype=np.float64)
    return {"out": np.asarray(total / x.size, dtype=x.dtype)}


def mean_grad_cpu(op, ins, ctx):
    """dx = full_like(x, dout / x.size)."""
    x, d = ins["x"], ins["dout"]
    share = np.asarray(d, dtype=np.float64).reshape(()) / max(x.size, 1)
    return {"dx": np.full_like(x, share)}
