"""relu: out = max(x, 0); its grad passes dout where out > 0."""
from __future__ import annotations

import numpy as np

from minigraph.kernels import activation as gpu
from minigraph.ops.device import check_gpu_float, wants
from minigraph.schema import Meta, OpDesc, OpSchema, Slot, check_float, kernel, register


def infer_relu(ins, attrs):
    check_float("relu", "x", ins["x"])
    return {"out": Meta(ins["x"].shape, ins["x"].dtype)}


def grad_relu(op, dout, make_grad):
    """relu_grad: dx = dout * (out > 0)."""
    d = dout.get("out")
    dx = make_grad(op.inputs["x"])
    if d is None or dx is None:
        return []
    return [OpDesc("relu_grad", dict(out=op.outputs["out"], dout=d, dx=dx))]


def infer_relu_grad(ins, attrs):
    return {"dx": Meta(ins["out"].shape, ins["out"].dtype)}


register(OpSchema(type="relu", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  infer=infer_relu, grad=grad_relu, doc=__doc__))
register(OpSchema(type="relu_grad", inputs=(Slot("out"), Slot("dout")),
                  outputs=(Slot("dx", optional=True),), infer=infer_relu_grad))


@kernel("relu", "cpu")
def relu_cpu(op, ins):
    """out = max(x, 0), elementwise."""
    x = ins["x"]
    return {"out": np.maximum(x, np.zeros((), dtype=x.dtype))}


@kernel("relu_grad", "cpu")
def relu_grad_cpu(op, ins):
    """dx = dout where out > 0, else 0."""
    out, d = ins["out"], ins["dout"]
    return {"dx": np.where(out > 0, d, np.zeros((), dtype=d.dtype))}


@kernel("relu", "gpu")
def relu_gpu(op, ins):
    """out = max(x, 0) on the device."""
    check_gpu_float(op, x=ins["x"])
    return {"out": gpu.relu(ins["x"])}


@kernel("relu_grad", "gpu")
def relu_grad_gpu(op, ins):
    """dx = dout where out > 0, else 0, on the device; nothing when dx is unbound."""
    out, d = ins["out"], ins["dout"]
    check_gpu_float(op, out=out, dout=d)
    if not wants(op, "dx"):
        return {}
    return {"dx": gpu.relu_grad(out, d)}
