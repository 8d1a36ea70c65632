"""CPU kernels of sgd and momentum (ops/optimizer_ops.py) and merged_momentum
(ops/merged_momentum.py). The native kernels (optim_native) make each update in one
pass where they take the arrays and the parameter is large enough to be worth the
call (optim_native.worth_it; merged_momentum's one call for its whole list always
is); the numpy paths are their reference. New values go into the parameter and state arrays in
place, or into the spare arrays a training step offers for them
(KernelContext.spares), after every new value is computed.
"""
from __future__ import annotations

import itertools

import numpy as np

from minigraph.kernels.cpu import optim_native
from minigraph.kernels.cpu.blocks import get_num_threads


def learning_rate(ins):
    return float(np.asarray(ins["learning_rate"]).reshape(()))


def targets(ctx, ins, slots):
    """Where the new values of in-place `slots` go: the spare array the context offers
    for `<slot>_out`, else the input array itself."""
    return tuple(ctx.spares.get(f"{slot}_out", ins[slot]) for slot in slots)


def decayed_grad(op, ins):
    """grad + weight_decay * param, in param's dtype (grad itself when no decay)."""
    param, grad = ins["param"], ins["grad"]
    wd = op.attrs["weight_decay"]
    return grad + param.dtype.type(wd) * param if wd else grad


def sgd_cpu(op, ins, ctx):
    """param_out = param - learning_rate * (grad + weight_decay * param)."""
    param = ins["param"]
    (out,) = targets(ctx, ins, ("param",))
    lr = learning_rate(ins)
    if not optim_native.worth_it("sgd", param) or not optim_native.update(
            "sgd", param, ins["grad"], out=(out, None, None), lr=lr,
            wd=op.attrs["weight_decay"], threads=get_num_threads()):
        np.subtract(param, decayed_grad(op, ins) * param.dtype.type(lr), out=out)
    return {"param_out": out}


def momentum_value(op, ins):
    """mu: the input `mu_value` when bound (a cycled momentum), else the attribute."""
    value = ins.get("mu_value")
    return op.attrs["mu"] if value is None else float(np.asarray(value).reshape(()))


def momentum_cpu(op, ins, ctx):
    """d = grad + weight_decay * param; velocity = mu * velocity + d; param -= lr *
    (velocity, or d + mu * velocity with use_nesterov)."""
    param, velocity = ins["param"], ins["velocity"]
    po, vo = targets(ctx, ins, ("param", "velocity"))
    a = op.attrs
    lr, mu = learning_rate(ins), momentum_value(op, ins)
    if not optim_native.worth_it("momentum", param) or not optim_native.update(
            "momentum", param, ins["grad"], (velocity, None), (po, vo, None), lr=lr,
            wd=a["weight_decay"], mu=mu, nesterov=a["use_nesterov"],
            threads=get_num_threads()):
        _momentum_numpy(param, ins["grad"], velocity, po, vo, lr, mu, a)
    return {"param_out": po, "velocity_out": vo}


def _momentum_numpy(param, grad, velocity, po, vo, lr, mu, attrs):
    """momentum's numpy update of one parameter into po and vo (the reference)."""
    wd = attrs["weight_decay"]
    grad = grad + param.dtype.type(wd) * param if wd else grad
    mu = param.dtype.type(mu)
    new_velocity = mu * velocity + grad
    step = grad + mu * new_velocity if attrs["use_nesterov"] else new_velocity
    step = param.dtype.type(lr) * step
    np.copyto(vo, new_velocity)
    np.subtract(param, step, out=po)


def merged_momentum_cpu(op, ins, ctx):
    """momentum_cpu's update of every parameter in the lists (ops/merged_momentum.py): one
    native call for all of them where it takes the arrays, else momentum's numpy update
    per parameter. ctx.spares offers a list per in-place slot (None: in place)."""
    params, velocities = ins["param"], ins["velocity"]
    outs = {}
    for slot, inputs in (("param_out", params), ("velocity_out", velocities)):
        offered = ctx.spares.get(slot) or ()
        outs[slot] = [a if a is not None else x
                      for a, x in itertools.zip_longest(offered, inputs)]
    a = op.attrs
    lr, mu = learning_rate(ins), momentum_value(op, ins)
    if not optim_native.update_list(
            "momentum", params, ins["grad"], (velocities, None),
            (outs["param_out"], outs["velocity_out"], None), lr=lr, wd=a["weight_decay"],
            mu=mu, nesterov=a["use_nesterov"], threads=get_num_threads()):
        for param, grad, velocity, po, vo in zip(params, ins["grad"], velocities,
                                                 outs["param_out"], outs["velocity_out"]):
            _momentum_numpy(param, grad, velocity, po, vo, lr, mu, a)
    return outs
