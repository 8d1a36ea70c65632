"""CPU kernels of the elementwise math ops (ops/math.py): exp, log, sqrt, square, abs,
pow, scale and clip, and their gradients. Outputs keep x's dtype; the transcendental
ones compute in float64 and cast back (log of a negative number is nan, of 0 -inf,
as numpy and torch give)."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import rows_native
from minigraph.kernels.cpu.activation import work


def _unary(fn):
    def kernel(op, ins, ctx):
        x = ins["x"]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return {"out": fn(work(x), op.attrs).astype(x.dtype)}
    return kernel


def _grad(fn, keep):
    def kernel(op, ins, ctx):
        k, d = work(ins[keep]), ins["dout"]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return {"dx": (work(d) * fn(k, op.attrs)).astype(d.dtype)}
    return kernel


exp_cpu = _unary(lambda x, a: np.exp(x))
exp_grad_cpu = _grad(lambda out, a: out, "out")                 # d exp(x) = exp(x)
log_cpu = _unary(lambda x, a: np.log(x))
log_grad_cpu = _grad(lambda x, a: 1.0 / x, "x")
sqrt_cpu = _unary(lambda x, a: np.sqrt(x))
sqrt_grad_cpu = _grad(lambda out, a: 0.5 / out, "out")
square_cpu = _unary(lambda x, a: x * x)
square_grad_cpu = _grad(lambda x, a: 2.0 * x, "x")
abs_cpu = _unary(lambda x, a: np.abs(x))
abs_grad_cpu = _grad(lambda x, a: np.sign(x), "x")              # 0 at 0, as torch
pow_cpu = _unary(lambda x, a: np.power(x, a["factor"]))
pow_grad_cpu = _grad(lambda x, a: a["factor"] * np.power(x, a["factor"] - 1.0), "x")
_scale_numpy = _unary(lambda x, a: x * a["scale"] + a["bias"])


def scale_cpu(op, ins, ctx):
    """out = x * scale + bias in float64, cast back: without a bias, in one native pass
    where rows_native.scale takes x (the same bits; an optimizer's averaging of merged
    gradients), else in numpy."""
    if op.attrs["bias"] == 0.0:
        done = rows_native.scale(ins["x"], op.attrs["scale"])
        if done is not None:
            return {"out": done}
    return _scale_numpy(op, ins, ctx)


clip_cpu = _unary(lambda x, a: np.minimum(np.maximum(x, a["min"]), a["max"]))
# torch's clamp: the gradient passes where min <= x <= max (both ends included)
clip_grad_cpu = _grad(lambda x, a: ((x >= a["min"]) & (x <= a["max"])).astype(np.float64), "x")


def scale_grad_cpu(op, ins, ctx):
    """dx = dout * scale."""
    d = ins["dout"]
    return {"dx": (work(d) * op.attrs["scale"]).astype(d.dtype)}
