"""CPU kernels of silu (ops/silu.py): out = x * sigmoid(x) and its gradient, in
float64, cast back to x's dtype; float32 in C where the native kernel applies
(activation_native, within a few float32 ulps)."""
from __future__ import annotations

from minigraph.kernels.cpu.activation import (
    bind_native,
    into_dout,
    native_backward,
    native_forward,
    sigmoid64,
    work,
)


def silu_cpu(op, ins, ctx):
    """out = x * sigmoid(x)."""
    x = ins["x"]
    out = native_forward("silu", x)               # None: not float32, or no C compiler
    if out is not None:
        return {"out": out}
    xw = work(x)                                  # float64 (no copy when it already is)
    return {"out": (xw * sigmoid64(xw)).astype(x.dtype)}


bind_silu = bind_native("silu")       # inference: the native kernel into a kept array


def silu_grad_cpu(op, ins, ctx):
    """dx = dout * s * (1 + x * (1 - s)), s = sigmoid(x)."""
    dx = native_backward("silu", ins, ctx, ins["x"])
    if dx is not None:
        return {"dx": dx}
    x, d = work(ins["x"]), ins["dout"]
    s = sigmoid64(x)
    return into_dout(ins, ctx, (work(d) * s * (1.0 + x * (1.0 - s))).astype(d.dtype))
