"""Launchers for kernels/activation.cu (map kernels): relu and its gradient on device arrays."""
from __future__ import annotations

from minigraph.kernels import map as maps

MODULE = "activation"


def relu(x, out=None):
    """out = max(x, 0) elementwise (NaN stays NaN); a new array unless `out`
    (same shape and dtype) is given. Returns out."""
    return maps.unary(MODULE, "relu", x, out=out)


def relu_grad(out, dout, dx=None):
    """dx = dout where out > 0, else 0 (out: relu's output). Returns dx."""
    return maps.binary(MODULE, "relu_grad", out, dout, out=dx)
