"""Launchers for kernels/activation.cu: relu and its gradient on device arrays."""
from __future__ import annotations

from minigraph.kernels import launch, loader

MODULE = "activation"
SIGNATURES = {**{f"relu_{s}_w{w}": "PPq" for s, ws in (("f32", (1, 4)), ("f64", (1, 2)))
                 for w in ws},
              **{f"relu_grad_{s}_w{w}": "PPPq" for s, ws in (("f32", (1, 4)), ("f64", (1, 2)))
                 for w in ws}}


def _check_like(what, a, b):
    launch.check_array(what, b, a.shape, a.dtype)


def relu(x, out=None):
    """out = max(x, 0) elementwise (NaN stays NaN); a new array unless `out`
    (same shape and dtype) is given. Returns out."""
    out = loader.empty(x.shape, x.dtype) if out is None else out
    _check_like("relu: out", x, out)
    loader.launch_flat(MODULE, SIGNATURES, "relu_{t}_w{w}", x.dtype, x.size, (x, out), x.size)
    return out


def relu_grad(out, dout, dx=None):
    """dx = dout where out > 0, else 0 (out: relu's output). Returns dx."""
    _check_like("relu_grad: dout", out, dout)
    dx = loader.empty(out.shape, out.dtype) if dx is None else dx
    _check_like("relu_grad: dx", out, dx)
    loader.launch_flat(MODULE, SIGNATURES, "relu_grad_{t}_w{w}", out.dtype, out.size,
                       (out, dout, dx), out.size)
    return dx
