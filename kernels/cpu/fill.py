"""CPU kernels of fill_constant, uniform_random and gaussian_random (ops/fill.py); the
random ones draw from np.random.default_rng(seed) afresh on every run.
"""
from __future__ import annotations

import numpy as np


def fill_constant_cpu(op, ins, ctx):
    """out = an array of `shape` and `dtype` holding `value` everywhere."""
    a = op.attrs
    return {"out": np.full(a["shape"], a["value"], dtype=a["dtype"])}


def uniform_random_cpu(op, ins, ctx):
    """out ~ U[min, max), drawn by default_rng(seed) in float64, cast to `dtype`."""
    a = op.attrs
    rng = np.random.default_rng(a["seed"])
    return {"out": rng.uniform(a["min"], a["max"], size=a["shape"]).astype(a["dtype"])}


def gaussian_random_cpu(op, ins, ctx):
    """out ~ N(mean, std^2), drawn by default_rng(seed) in float64, cast to `dtype`; the
    row `zero_row` (if not -1) then set to 0."""
    a = op.attrs
    rng = np.random.default_rng(a["seed"])
    out = rng.normal(a["mean"], a["std"], size=a["shape"]).astype(a["dtype"])
    if a.get("zero_row", -1) != -1:
        out[a["zero_row"]] = 0
    return {"out": out}
