"""CPU kernels of silu (ops/silu.py): out = x * sigmoid(x) and its gradient, in
float64, cast back to x's dtype."""
from __future__ import annotations

from minigraph.kernels.cpu.activation import sigmoid64, work


def silu_cpu(op, ins, ctx):
    """out = x * sigmoid(x)."""
    x = ins["x"]
    xw = work(x)
    return {"out": (xw * sigmoid64(xw)).astype(x.dtype)}


def silu_grad_cpu(op, ins, ctx):
    """dx = dout * s * (1 + x * (1 - s)), s = sigmoid(x)."""
    x, d = work(ins["x"]), ins["dout"]
    s = sigmoid64(x)
    return {"dx": (work(d) * s * (1.0 + x * (1.0 - s))).astype(d.dtype)}
