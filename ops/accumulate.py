"""add_inplace and fill_inplace: a running sum kept in a persistable, and its reset.

add_inplace:  x = x + y          (x_out is x: an in-place pair)
fill_inplace: x = value          (x_out is x), value converted as np.full converts it

GradientMerge adds each step's gradient into its merged gradient with
add_inplace and zeroes the sums after an update with fill_inplace. Both write
the persistable's own array (on the CPU, the spare a training step offers: the
journal keeps the old one to put back), so a step writes the same arrays every
time and a GPU step can be replayed as a CUDA graph; a `sum` into the
persistable would give it a new array every step. add_inplace adds as `sum` of
two tensors does (the same bits). Neither has a gradient.
Kernels: kernels/cpu/accumulate.py, kernels/cuda/accumulate.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import accumulate as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import accumulate as cuda
from minigraph.schema import Meta, OpSchema, Slot, examples, kernel, register
from minigraph.validators import check_float, check_same_dtype, check_shape, fail, float_attr

STATE = "a training state's update in place (an inference graph has none)"


def infer_add_inplace(ins, attrs):
    x = ins["x"]
    check_float("add_inplace", "x", x)
    check_shape("add_inplace", "y", ins["y"], x.shape, " (the shape of 'x')")
    check_same_dtype("add_inplace", "y", ins["y"], "x", x)
    return {"x_out": Meta(x.shape, x.dtype)}


def infer_fill_inplace(ins, attrs):
    x = ins["x"]
    if np.dtype(x.dtype).kind not in "biuf":
        fail("fill_inplace", "x", f"must be a bool, int or float tensor, got {x.dtype}")
    return {"x_out": Meta(x.shape, x.dtype)}


register(OpSchema(
    type="add_inplace", inputs=(Slot("x"), Slot("y")), outputs=(Slot("x_out"),),
    inplace={"x_out": "x"}, spares=True, infer=infer_add_inplace, replication="inputs",
    no_export=STATE, doc=__doc__))
register(OpSchema(
    type="fill_inplace", inputs=(Slot("x"),), outputs=(Slot("x_out"),),
    attrs=(float_attr("value", 0.0),), inplace={"x_out": "x"}, spares=True,
    infer=infer_fill_inplace, replication="always", no_export=STATE, doc=__doc__))

kernel("add_inplace", "cpu", cpu.add_inplace_cpu)
kernel("fill_inplace", "cpu", cpu.fill_inplace_cpu)
kernel("add_inplace", "gpu", cuda.add_inplace_gpu, dtypes=GPU_FLOATS)
kernel("fill_inplace", "gpu", cuda.fill_inplace_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def add_inplace_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values."""
    return [
        ("f32", {"x": ex.r(3, 5), "y": ex.r(3, 5, seed=1)}, {}, ()),
        ("f64-odd", {"x": ex.r(37, dtype=np.float64), "y": ex.r(37, dtype=np.float64, seed=1)},
         {}, ()),
        ("scalar-f32", {"x": np.array(1.5, np.float32), "y": np.array(-0.25, np.float32)},
         {}, ()),
    ]


def fill_inplace_examples(ex):
    """Cases the device tests run on every place against the CPU (see above)."""
    return [
        ("zero-f32", {"x": ex.r(4, 6)}, {}, ()),
        ("f64", {"x": ex.r(7, dtype=np.float64)}, dict(value=-2.5), ()),
        ("int64", {"x": np.arange(5, dtype=np.int64)}, dict(value=7.9), ()),
    ]


examples("add_inplace", add_inplace_examples)
examples("fill_inplace", fill_inplace_examples)
