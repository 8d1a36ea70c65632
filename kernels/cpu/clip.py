"""CPU kernel of clip_by_global_norm (ops/clip.py): one float64 norm over every x
(rows_native.sum_squares where it applies), then each x scaled by torch's
clip_grad_norm_ factor; a factor of 1 passes each x on as it is (x * 1 is x, value
for value), as elementwise_add_grad passes dout on.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import rows_native


def clip_coefficient(total_norm, max_norm):
    """min(max_norm / (total_norm + 1e-6), 1), torch's clip_grad_norm_ factor."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


def clip_by_global_norm_cpu(op, ins, ctx):
    """out_i = x_i * min(max_norm / (||x||_2 + 1e-6), 1) over all the x at once."""
    xs = ins["x"]
    total = math.sqrt(sum(sum_squares(x) for x in xs))
    coef = clip_coefficient(total, op.attrs["max_norm"])
    if coef == 1.0:
        return {"out": list(xs)}
    return {"out": [x * x.dtype.type(coef) for x in xs]}


def sum_squares(x):
    """The float64 sum of the squares of x's values."""
    done = rows_native.sum_squares(x)
    if done is not None:
        return done
    x64 = x.astype(np.float64).ravel()
    return float(x64 @ x64)
