"""mean: the mean of every element of x, a scalar (shape ()).

The mean of an empty x (a batch with no rows, as a data-parallel rank may
hold) is defined as 0, and its gradient is the empty dx: a rank without rows
adds nothing to the loss or to the averaged gradients (weight ranks by their
rows with data_parallel(batch_size_from=...)).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import fill
from minigraph.kernels import mean as gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpSchema, Slot, grad_maker, kernel, register
from minigraph.validators import check_float, check_shape


def infer_mean(ins, attrs):
    check_float("mean", "x", ins["x"])
    return {"out": Meta((), ins["x"].dtype)}


def infer_mean_grad(ins, attrs):
    check_shape("mean_grad", "dout", ins["dout"], (), " (the shape of mean's output)")
    return {"dx": Meta(ins["x"].shape, ins["x"].dtype)}


register(OpSchema(type="mean", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  infer=infer_mean, grad=grad_maker("mean_grad"), doc=__doc__))
register(OpSchema(type="mean_grad", inputs=(Slot("x"), Slot("dout")),
                  outputs=(Slot("dx", optional=True),), infer=infer_mean_grad))


@kernel("mean", "cpu")
def mean_cpu(op, ins, ctx):
    """out = mean(x), accumulated in float64 (pairwise), cast back to x's dtype; 0 when
    x is empty."""
    x = ins["x"]
    if x.size == 0:
        return {"out": np.zeros((), dtype=x.dtype)}
    return {"out": np.asarray(np.mean(x, dtype=np.float64), dtype=x.dtype)}


@kernel("mean_grad", "cpu")
def mean_grad_cpu(op, ins, ctx):
    """dx = full_like(x, dout / x.size)."""
    x, d = ins["x"], ins["dout"]
    share = np.asarray(d, dtype=np.float64).reshape(()) / max(x.size, 1)
    return {"dx": np.full_like(x, share)}


@kernel("mean", "gpu", dtypes=GPU_FLOATS)
def mean_gpu(op, ins, ctx):
    """out = mean(x), summed in double on the device, in x's dtype; 0 when x is empty."""
    x = ins["x"]
    if x.size == 0:
        return {"out": fill.full((), 0.0, x.dtype)}
    return {"out": gpu.mean(x)}


@kernel("mean_grad", "gpu", dtypes=GPU_FLOATS)
def mean_grad_gpu(op, ins, ctx):
    """dx = dout / x.size everywhere, dout read on the device; nothing when dx is unbound."""
    x, d = ins["x"], ins["dout"]
    if not op.wants("dx"):
        return {}
    return {"dx": gpu.mean_grad(tuple(x.shape), d)}
