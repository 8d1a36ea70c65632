"""softmax: exp(x - max) / sum(exp(x - max)) along one axis, and its grad.

x: a float tensor of rank >= 1; axis (default -1, negative from the end).
Computed in float64 from the max-shifted values (huge logits stay finite)
and cast back to x's dtype.
softmax_grad(out, dout; axis): dx = out * (dout - sum(dout * out, axis)).
Kernels: kernels/cpu/softmax.py, kernels/cuda/softmax.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import softmax as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import softmax as cuda
from minigraph.schema import (
    Meta,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import check_float, check_shape, fail, int_attr, normalized_axis


def infer_softmax(ins, attrs):
    x = ins["x"]
    check_float("softmax", "x", x)
    if len(x.shape) == 0:
        fail("softmax", "x", "must have rank >= 1, got a scalar (shape ())")
    normalized_axis("softmax", attrs["axis"], len(x.shape))
    return {"out": Meta(x.shape, x.dtype)}


def infer_softmax_grad(ins, attrs):
    out = ins["out"]
    check_shape("softmax_grad", "dout", ins["dout"], out.shape, " (the shape of 'out')")
    normalized_axis("softmax_grad", attrs["axis"], len(out.shape), "out")
    return {"dx": Meta(out.shape, out.dtype)}


def export_softmax(ctx, op):
    """Softmax along the op's axis (opset 13+: along that axis alone)."""
    return onnx_export.unary("Softmax", axis=int(op.attrs["axis"]))(ctx, op)


SOFTMAX = register(OpSchema(
    type="softmax", inputs=(Slot("x"),), outputs=(Slot("out"),), attrs=(int_attr("axis", -1),),
    infer=infer_softmax, grad=grad_maker("softmax_grad", keep=("out",)),
    export=export_softmax, doc=__doc__))
register(grad_schema(SOFTMAX, inputs=(Slot("out"), Slot("dout")),
                     outputs=(Slot("dx", optional=True),), infer=infer_softmax_grad))


kernel("softmax", "cpu", cpu.softmax_cpu)
kernel("softmax_grad", "cpu", cpu.softmax_grad_cpu)
kernel("softmax", "gpu", cuda.softmax_gpu, dtypes=GPU_FLOATS)
kernel("softmax_grad", "gpu", cuda.softmax_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def softmax_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("last-f32", {"x": ex.r(5, 11) * 10}, {}, (("x",),)),
        ("mid-f64", {"x": ex.r(2, 7, 3, dtype=np.float64)}, dict(axis=1), (("x",),)),
        ("first-f32", {"x": ex.r(4, 3, 2)}, dict(axis=0), (("x",),)),
    ]


examples("softmax", softmax_examples)
