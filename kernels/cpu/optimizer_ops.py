"""CPU kernels of sgd and momentum (ops/optimizer_ops.py): every new value computed
first, then written into the parameter and state arrays in place.
"""
from __future__ import annotations

import numpy as np


def learning_rate(ins):
    return float(np.asarray(ins["learning_rate"]).reshape(()))


def decayed_grad(op, ins):
    """grad + weight_decay * param, in param's dtype (grad itself when no decay)."""
    param, grad = ins["param"], ins["grad"]
    wd = op.attrs["weight_decay"]
    return grad + param.dtype.type(wd) * param if wd else grad


def sgd_cpu(op, ins, ctx):
    """param -= learning_rate * (grad + weight_decay * param), in place; returns param."""
    param = ins["param"]
    step = decayed_grad(op, ins) * param.dtype.type(learning_rate(ins))
    param -= step
    return {"param_out": param}


def momentum_cpu(op, ins, ctx):
    """d = grad + weight_decay * param; velocity = mu * velocity + d; param -= lr *
    (velocity, or d + mu * velocity with use_nesterov); both in place; returns them."""
    param, velocity = ins["param"], ins["velocity"]
    grad = decayed_grad(op, ins)
    mu = param.dtype.type(op.attrs["mu"])
    lr = param.dtype.type(learning_rate(ins))
    new_velocity = mu * velocity + grad
    step = grad + mu * new_velocity if op.attrs["use_nesterov"] else new_velocity
    step = lr * step
    np.copyto(velocity, new_velocity)
    param -= step
    return {"param_out": param, "velocity_out": velocity}
