"""Launchers for activation.cu (map kernels): relu and its gradient on device arrays,
and the GPU kernels of the ops relu and relu_grad."""
from __future__ import annotations

from minigraph.kernels.cuda import map as maps

MODULE = "activation"


def relu(x, out=None):
    """out = max(x, 0) elementwise (NaN stays NaN); a new array unless `out`
    (same shape and dtype) is given. Returns out."""
    return maps.unary(MODULE, "relu", x, out=out)


def relu_grad(out, dout, dx=None):
    """dx = dout where out > 0, else 0 (out: relu's output). Returns dx."""
    return maps.binary(MODULE, "relu_grad", out, dout, out=dx)


# ---- op kernels -------------------------------------------------------------------

def relu_gpu(op, ins, ctx):
    """out = max(x, 0) on the device."""
    return {"out": relu(ins["x"])}


def relu_grad_gpu(op, ins, ctx):
    """dx = dout where out > 0, else 0, on the device; nothing when dx is unbound."""
    if not op.wants("dx"):
        return {}
    return {"dx": relu_grad(ins["out"], ins["dout"])}
