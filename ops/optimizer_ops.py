"""sgd and momentum: parameter updates written in place (no gradients).

With d = grad + weight_decay * param (L2, as torch.optim.SGD):
sgd:      param -= learning_rate * d
momentum: velocity = mu * velocity + d (the PyTorch convention), then
          param -= learning_rate * velocity, or with use_nesterov
          param -= learning_rate * (d + mu * velocity).
`param_out` (and `velocity_out`) are the input Variables themselves: the
kernels compute every new value first, then overwrite the arrays and
return them. learning_rate is a float array of shape () or (1,).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import optimizer_ops as gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpSchema, Slot, kernel, register
from minigraph.validators import (
    bool_attr,
    check_float,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
    in_range,
    non_negative,
)


def check_update_inputs(op_type, ins, state_slots=()):
    """param float; grad and each state slot shaped and typed like param; a scalar rate."""
    param = ins["param"]
    check_float(op_type, "param", param)
    for slot in ("grad",) + state_slots:
        check_shape(op_type, slot, ins[slot], param.shape, " (the shape of 'param')")
        check_same_dtype(op_type, slot, ins[slot], "param", param)
    lr = ins["learning_rate"]
    check_float(op_type, "learning_rate", lr)
    if tuple(lr.shape) not in ((), (1,)):
        fail(op_type, "learning_rate", f"must be a scalar of shape () or (1,), got {lr.shape}")
    return Meta(param.shape, param.dtype)


def learning_rate(ins):
    return float(np.asarray(ins["learning_rate"]).reshape(()))


def decay_attr():
    """weight_decay: the L2 coefficient added to the gradient (>= 0)."""
    return float_attr("weight_decay", 0.0, non_negative)


def decayed_grad(op, ins):
    """grad + weight_decay * param, in param's dtype (grad itself when no decay)."""
    param, grad = ins["param"], ins["grad"]
    wd = op.attrs["weight_decay"]
    return grad + param.dtype.type(wd) * param if wd else grad


register(OpSchema(
    type="sgd", inputs=(Slot("param"), Slot("grad"), Slot("learning_rate")),
    outputs=(Slot("param_out"),), inplace={"param_out": "param"}, attrs=(decay_attr(),),
    infer=lambda ins, attrs: {"param_out": check_update_inputs("sgd", ins)}, doc=__doc__))
register(OpSchema(
    type="momentum",
    inputs=(Slot("param"), Slot("grad"), Slot("velocity"), Slot("learning_rate")),
    outputs=(Slot("param_out"), Slot("velocity_out")),
    attrs=(float_attr("mu", 0.9, in_range(0.0, 1.0)), bool_attr("use_nesterov", False),
           decay_attr()),
    inplace={"param_out": "param", "velocity_out": "velocity"},
    infer=lambda ins, attrs: dict.fromkeys(
        ("param_out", "velocity_out"), check_update_inputs("momentum", ins, ("velocity",))),
    doc=__doc__))


@kernel("sgd", "cpu")
def sgd_cpu(op, ins, ctx):
    """param -= learning_rate * (grad + weight_decay * param), in place; returns param."""
    param = ins["param"]
    step = decayed_grad(op, ins) * param.dtype.type(learning_rate(ins))
    param -= step
    return {"param_out": param}


@kernel("momentum", "cpu")
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


@kernel("sgd", "gpu", dtypes=GPU_FLOATS)
def sgd_gpu(op, ins, ctx):
    """param -= learning_rate * (grad + weight_decay * param) in place on the device
    (the rate is read there); returns param, the same device buffer."""
    param, grad, lr = ins["param"], ins["grad"], ins["learning_rate"]
    return {"param_out": gpu.sgd(param, grad, lr, op.attrs["weight_decay"])}


@kernel("momentum", "gpu", dtypes=GPU_FLOATS)
def momentum_gpu(op, ins, ctx):
    """d = grad + weight_decay * param; velocity = mu * velocity + d; param -= lr *
    (velocity, or d + mu * velocity with use_nesterov); both in place on the device."""
    param, grad, velocity = ins["param"], ins["grad"], ins["velocity"]
    lr = ins["learning_rate"]
    param, velocity = gpu.momentum(param, grad, velocity, lr, op.attrs["mu"],
                                   op.attrs["use_nesterov"], op.attrs["weight_decay"])
    return {"param_out": param, "velocity_out": velocity}
