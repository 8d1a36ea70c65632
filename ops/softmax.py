"""softmax: exp(x - max) / sum(exp(x - max)) along one axis, and its grad.

x: a float tensor of rank >= 1; axis (default -1, negative from the end).
Computed in float64 from the max-shifted values (huge logits stay finite)
and cast back to x's dtype.
softmax_grad(out, dout; axis): dx = out * (dout - sum(dout * out, axis)).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import softmax as gpu
from minigraph.ops.axis import normalized_axis
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpSchema, Slot, grad_maker, grad_schema, kernel, register
from minigraph.validators import check_float, check_shape, fail, int_attr


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


SOFTMAX = register(OpSchema(
    type="softmax", inputs=(Slot("x"),), outputs=(Slot("out"),), attrs=(int_attr("axis", -1),),
    infer=infer_softmax, grad=grad_maker("softmax_grad", keep=("out",)), doc=__doc__))
register(grad_schema(SOFTMAX, inputs=(Slot("out"), Slot("dout")),
                     outputs=(Slot("dx", optional=True),), infer=infer_softmax_grad))


@kernel("softmax", "cpu")
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


@kernel("softmax_grad", "cpu")
def softmax_grad_cpu(op, ins, ctx):
    """dx = out * (dout - sum(dout * out, axis)), in float64."""
    if not op.wants("dx"):
        return {}
    out, d = ins["out"].astype(np.float64), ins["dout"]
    inner = (d * out).sum(axis=op.attrs["axis"], keepdims=True)
    return {"dx": (out * (d - inner)).astype(d.dtype)}


# ---- GPU bindings: kernels/softmax.cu ----

@kernel("softmax", "gpu", dtypes=GPU_FLOATS)
def softmax_gpu(op, ins, ctx):
    """out = softmax of x along axis, in double on the device."""
    return {"out": gpu.softmax(ins["x"], op.attrs["axis"])}


@kernel("softmax_grad", "gpu", dtypes=GPU_FLOATS)
def softmax_grad_gpu(op, ins, ctx):
    """dx = out * (dout - sum(dout * out, axis)) on the device, when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": gpu.softmax_grad(ins["out"], ins["dout"], op.attrs["axis"])}
