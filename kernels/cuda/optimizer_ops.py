"""Launchers for kernels/cuda/optimizer_ops.cu: sgd, momentum and adam, in place on
device arrays.

The learning rate is a one-element device array (float32 or float64), read
on the device, so changing it needs no recompilation and no host round trip;
so are adam's float64 beta powers, which the kernel also advances.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader

MODULE = "optimizer_ops"
_VARIANTS = [(t, lr, w) for t, ws in (("f32", (1, 4)), ("f64", (1, 2)))
             for lr in ("f32", "f64") for w in ws]
SIGNATURES = {**{f"sgd_{t}_lr{lr}_w{w}": "PPPqd" for t, lr, w in _VARIANTS},
              **{f"momentum_{t}_lr{lr}_w{w}": "PPPPqdidP" for t, lr, w in _VARIANTS},
              **{f"adam_{t}_lr{lr}_w{w}": "PPPPPPPPqddddiPP" for t, lr, w in _VARIANTS}}


def _check(op, param, others, lr):
    for name, a in others:
        if tuple(a.shape) != tuple(param.shape) or a.dtype != param.dtype:
            raise ValueError(f"{op}: '{name}' must match param {param.dtype}"
                             f"{tuple(param.shape)}, got {a.dtype}{tuple(a.shape)}")
    if lr.size != 1:
        raise ValueError(f"{op}: learning_rate must hold one value, got shape {tuple(lr.shape)}")
    return f"{op}_{{t}}_lr{loader.suffix(lr.dtype)}_w{{w}}"


def sgd(param, grad, learning_rate, weight_decay=0.0):
    """param -= learning_rate[0] * (grad + weight_decay * param), in place
    (arithmetic in param's dtype). Returns param."""
    base = _check("sgd", param, [("grad", grad)], learning_rate)
    if param.size:
        loader.launch_flat(MODULE, SIGNATURES, base, param.dtype, param.size,
                           (param, grad, learning_rate), param.size, float(weight_decay))
    return param


def _scalar_ptr(op, name, a, dtype):
    """The device pointer of an optional scalar input (0 for None), checked."""
    if a is None:
        return 0
    launch.check_array(f"{op}: {name}", a, (), dtype)
    return loader.ptr(a, f"{op}: {name}")


def momentum(param, grad, velocity, learning_rate, mu, use_nesterov=False, weight_decay=0.0,
             mu_value=None):
    """d = grad + weight_decay * param; velocity = mu * velocity + d; param -= lr *
    (velocity, or d + mu * velocity with use_nesterov); both in place. mu_value: a
    float64 device scalar read on the device instead of mu (a cycled momentum).
    Returns (param, velocity)."""
    base = _check("momentum", param, [("grad", grad), ("velocity", velocity)], learning_rate)
    mu_ptr = _scalar_ptr("momentum", "mu_value", mu_value, np.float64)
    if param.size:
        loader.launch_flat(MODULE, SIGNATURES, base, param.dtype, param.size,
                           (param, grad, velocity, learning_rate), param.size, float(mu),
                           int(bool(use_nesterov)), float(weight_decay), mu_ptr)
    return param, velocity


def adam(param, grad, moment1, moment2, beta1_pow, beta2_pow, learning_rate, beta1=0.9,
         beta2=0.999, epsilon=1e-8, weight_decay=0.0, decoupled=False, beta1_value=None,
         step=None):
    """One Adam step (AdamW's with `decoupled`), every array updated in place:
    beta1_pow *= beta1 and beta2_pow *= beta2 (float64 device scalars), then
    param, moment1 and moment2 as ops/adam.py says. With beta1_value (a float64 device
    scalar, a cycled beta1) and step (the int64 device count of updates, this one
    included), beta1 is read on the device and beta1_pow becomes beta1 ** step.
    Returns param."""
    if (beta1_value is None) != (step is None):
        raise ValueError("adam: beta1_value and step go together")
    base = _check("adam", param, [("grad", grad), ("moment1", moment1),
                                  ("moment2", moment2)], learning_rate)
    for name, a in (("beta1_pow", beta1_pow), ("beta2_pow", beta2_pow)):
        launch.check_array(f"adam: {name}", a, (), np.float64)
    sfx = loader.suffix(param.dtype)
    arrays = (param, grad, moment1, moment2)
    pointers = [loader.ptr(a, f"adam: {n}") for a, n in zip(arrays, ("param", "grad", "moment1",
                                                                      "moment2"))]
    width = launch.vector_width(np.dtype(param.dtype).itemsize)
    if not launch.is_aligned(*pointers):
        width = 1
    name = base.format(t=sfx, w=width)
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    grid = launch.flat_grid(-(-param.size // width), dev, threads, k.resources)
    k.launch((grid, 1, 1), (threads, 1, 1), *pointers, loader.ptr(beta1_pow),
             loader.ptr(beta2_pow), loader.ptr(learning_rate), loader.ptr(loader.tickets(1)),
             param.size, float(beta1), float(beta2), float(epsilon), float(weight_decay),
             int(bool(decoupled)), _scalar_ptr("adam", "beta1_value", beta1_value, np.float64),
             _scalar_ptr("adam", "step", step, np.int64))
    return param


# ---- op kernels -------------------------------------------------------------------

def sgd_gpu(op, ins, ctx):
    """param -= learning_rate * (grad + weight_decay * param) in place on the device
    (the rate is read there); returns param, the same device buffer."""
    param, grad, lr = ins["param"], ins["grad"], ins["learning_rate"]
    return {"param_out": sgd(param, grad, lr, op.attrs["weight_decay"])}


def momentum_gpu(op, ins, ctx):
    """d = grad + weight_decay * param; velocity = mu * velocity + d; param -= lr *
    (velocity, or d + mu * velocity with use_nesterov); both in place on the device."""
    param, grad, velocity = ins["param"], ins["grad"], ins["velocity"]
    lr = ins["learning_rate"]
    param, velocity = momentum(param, grad, velocity, lr, op.attrs["mu"],
                               op.attrs["use_nesterov"], op.attrs["weight_decay"],
                               ins.get("mu_value"))
    return {"param_out": param, "velocity_out": velocity}


def merged_momentum_gpu(op, ins, ctx):
    """momentum_gpu's update of every parameter in the lists (ops/merged_momentum.py), one
    launch per parameter, in place on the device."""
    a = op.attrs
    for param, grad, velocity in zip(ins["param"], ins["grad"], ins["velocity"]):
        momentum(param, grad, velocity, ins["learning_rate"], a["mu"], a["use_nesterov"],
                 a["weight_decay"], ins.get("mu_value"))
    return {"param_out": list(ins["param"]), "velocity_out": list(ins["velocity"])}


def adam_gpu(op, ins, ctx):
    """One Adam/AdamW step on the device, every state array (the beta powers too)
    updated in place there; returns them."""
    a = op.attrs
    adam(ins["param"], ins["grad"], ins["moment1"], ins["moment2"], ins["beta1_pow"],
         ins["beta2_pow"], ins["learning_rate"], a["beta1"], a["beta2"], a["epsilon"],
         a["weight_decay"], a["decoupled"], ins.get("beta1_value"), ins.get("step"))
    return {f"{s}_out": ins[s] for s in ("param", "moment1", "moment2", "beta1_pow",
                                         "beta2_pow")}
