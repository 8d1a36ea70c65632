"""Launchers for kernels/optimizer_ops.cu: sgd and momentum, in place on device arrays.

The learning rate is a one-element device array (float32 or float64), read
on the device, so changing it needs no recompilation and no host round trip.
"""
from __future__ import annotations

from minigraph.kernels import loader

MODULE = "optimizer_ops"
_VARIANTS = [(t, lr, w) for t, ws in (("f32", (1, 4)), ("f64", (1, 2)))
             for lr in ("f32", "f64") for w in ws]
SIGNATURES = {**{f"sgd_{t}_lr{lr}_w{w}": "PPPq" for t, lr, w in _VARIANTS},
              **{f"momentum_{t}_lr{lr}_w{w}": "PPPPqdi" for t, lr, w in _VARIANTS}}


def _check(op, param, others, lr):
    for name, a in others:
        if tuple(a.shape) != tuple(param.shape) or a.dtype != param.dtype:
            raise ValueError(f"{op}: '{name}' must match param {param.dtype}"
                             f"{tuple(param.shape)}, got {a.dtype}{tuple(a.shape)}")
    if lr.size != 1:
        raise ValueError(f"{op}: learning_rate must hold one value, got shape {tuple(lr.shape)}")
    return f"{op}_{{t}}_lr{loader.suffix(lr.dtype)}_w{{w}}"


def sgd(param, grad, learning_rate):
    """param -= learning_rate[0] * grad, in place (arithmetic in param's dtype).
    Returns param."""
    base = _check("sgd", param, [("grad", grad)], learning_rate)
    if param.size:
        loader.launch_flat(MODULE, SIGNATURES, base, param.dtype, param.size,
                    (param, grad, learning_rate), param.size)
    return param


def momentum(param, grad, velocity, learning_rate, mu, use_nesterov=False):
    """velocity = mu * velocity + grad; param -= lr * (velocity, or grad + mu *
    velocity with use_nesterov); both in place. Returns (param, velocity)."""
    base = _check("momentum", param, [("grad", grad), ("velocity", velocity)], learning_rate)
    if param.size:
        loader.launch_flat(MODULE, SIGNATURES, base, param.dtype, param.size,
                    (param, grad, velocity, learning_rate), param.size, float(mu),
                    int(bool(use_nesterov)))
    return param, velocity
