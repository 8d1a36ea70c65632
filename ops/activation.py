"""relu: out = max(x, 0); its grad passes dout where out > 0."""
from __future__ import annotations

import numpy as np

from minigraph.kernels import activation as gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpSchema, Slot, check_float, grad_maker, kernel, register


def infer_relu(ins, attrs):
    check_float("relu", "x", ins["x"])
    return {"out": Meta(ins["x"].shape, ins["x"].dtype)}


register(OpSchema(type="relu", inputs=(Slot("x"),), outputs=(Slot("out"),), infer=infer_relu,
                  grad=grad_maker("relu_grad", keep=("out",)), doc=__doc__))
register(OpSchema(type="relu_grad", inputs=(Slot("out"), Slot("dout")),
                  outputs=(Slot("dx", optional=True),),
                  infer=lambda ins, attrs: {"dx": Meta(ins["out"].shape, ins["out"].dtype)}))


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


@kernel("relu", "gpu", dtypes=GPU_FLOATS)
def relu_gpu(op, ins):
    """out = max(x, 0) on the device."""
    return {"out": gpu.relu(ins["x"])}


@kernel("relu_grad", "gpu", dtypes=GPU_FLOATS)
def relu_grad_gpu(op, ins):
    """dx = dout where out > 0, else 0, on the device; nothing when dx is unbound."""
    if not op.wants("dx"):
        return {}
    return {"dx": gpu.relu_grad(ins["out"], ins["dout"])}
