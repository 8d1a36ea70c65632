"""CPU kernels of add_inplace and fill_inplace (ops/accumulate.py): the new values go
into the spare array a training step offers for x_out (KernelContext.spares), else
into x itself.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import rows_native


def add_inplace_cpu(op, ins, ctx):
    """x_out = x + y (sum's bits: on the threads where rows_native.add takes it)."""
    x, y = ins["x"], ins["y"]
    out = ctx.spares.get("x_out", x)
    if rows_native.add(x, y, out) is None:
        np.add(x, y, out=out)
    return {"x_out": out}


def fill_inplace_cpu(op, ins, ctx):
    """x_out = `value` everywhere, converted as np.full converts it."""
    out = ctx.spares.get("x_out", ins["x"])
    out[...] = np.array(op.attrs["value"]).astype(out.dtype)
    return {"x_out": out}
