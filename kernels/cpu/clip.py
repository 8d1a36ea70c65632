"""CPU kernel of clip_by_global_norm (ops/clip.py): one float64 norm over every x,
then each x scaled by torch's clip_grad_norm_ factor.
"""
from __future__ import annotations

import numpy as np


def clip_coefficient(total_norm, max_norm):
    """min(max_norm / (total_norm + 1e-6), 1), torch's clip_grad_norm_ factor."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


def clip_by_global_norm_cpu(op, ins, ctx):
    """out_i = x_i * min(max_norm / (||x||_2 + 1e-6), 1) over all the x at once."""
    xs = ins["x"]
    total = np.sqrt(sum(float(np.dot(x.ravel().astype(np.float64), x.ravel())) for x in xs))
    coef = clip_coefficient(total, op.attrs["max_norm"])
    return {"out": [x * x.dtype.type(coef) for x in xs]}
