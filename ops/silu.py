"""silu: out = x * sigmoid(x) (torch.nn.SiLU, "swish").

silu_grad(x, dout): dx = dout * s * (1 + x * (1 - s)), s = sigmoid(x).
x must be a float tensor; the CPU kernels compute in float64 and cast back.
This module is the worked example of docs/adding_an_op.md: the schema and
grad op come from ops.activation's helper, the GPU kernels are the two lines
of kernels/silu.cu.
"""
from __future__ import annotations

from minigraph.ops.activation import register_activation, register_map_gpu, sigmoid64, work
from minigraph.schema import kernel

register_activation("silu", keep="x")


@kernel("silu", "cpu")
def silu_cpu(op, ins, ctx):
    """out = x * sigmoid(x)."""
    x = ins["x"]
    xw = work(x)
    return {"out": (xw * sigmoid64(xw)).astype(x.dtype)}


@kernel("silu_grad", "cpu")
def silu_grad_cpu(op, ins, ctx):
    """dx = dout * s * (1 + x * (1 - s)), s = sigmoid(x)."""
    x, d = work(ins["x"]), ins["dout"]
    s = sigmoid64(x)
    return {"dx": (work(d) * s * (1.0 + x * (1.0 - s))).astype(d.dtype)}


register_map_gpu("silu", "x")          # kernels/silu.cu: silu and silu_grad on the device
