"""mean: the mean of every element of x, a scalar (shape ()).

The mean of an empty x (a batch with no rows, as a data-parallel rank may
hold) is defined as 0, and its gradient is the empty dx: a rank without rows
adds nothing to the loss or to the averaged gradients (weight ranks by their
rows with data_parallel(batch_size_from=...)). Kernels: kernels/cpu/mean.py,
kernels/cuda/mean.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import mean as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import mean as cuda
from minigraph.schema import Meta, OpSchema, Slot, examples, grad_maker, kernel, register
from minigraph.validators import check_float, check_shape


def infer_mean(ins, attrs):
    check_float("mean", "x", ins["x"])
    return {"out": Meta((), ins["x"].dtype)}


def infer_mean_grad(ins, attrs):
    check_shape("mean_grad", "dout", ins["dout"], (), " (the shape of mean's output)")
    return {"dx": Meta(ins["x"].shape, ins["x"].dtype)}


def export_mean(ctx, op):
    """ReduceMean over every axis, keepdims=0: a scalar."""
    return [ctx.node("ReduceMean", [ctx.value(op.inputs["x"])],
                     [ctx.output(op.outputs["out"])], keepdims=0)]


register(OpSchema(type="mean", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  infer=infer_mean, grad=grad_maker("mean_grad"), export=export_mean,
                  doc=__doc__))
register(OpSchema(type="mean_grad", inputs=(Slot("x"), Slot("dout")),
                  outputs=(Slot("dx", optional=True),), infer=infer_mean_grad,
                  no_export="a gradient op (training only)"))

kernel("mean", "cpu", cpu.mean_cpu)
kernel("mean_grad", "cpu", cpu.mean_grad_cpu)
kernel("mean", "gpu", cuda.mean_gpu, dtypes=GPU_FLOATS)
kernel("mean_grad", "gpu", cuda.mean_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def mean_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(3, 4, 5)}, {}, (("x",),)),
        ("f64", {"x": ex.r(6, dtype=np.float64)}, {}, (("x",),)),
    ]


examples("mean", mean_examples)
