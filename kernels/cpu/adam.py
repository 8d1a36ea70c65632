"""CPU kernel of adam (ops/adam.py): one Adam/AdamW step. The native kernel
(optim_native) makes it in one pass where it takes the arrays and the parameter is
large enough to be worth the call (optim_native.worth_it); the numpy path below is
its reference. New values go into the state arrays in place, or into the spare
arrays a training step offers for them (KernelContext.spares), after every new
value is computed. A float16 parameter is updated in float32 (its moments are
float32) and the result rounded to float16.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import optim_native
from minigraph.kernels.cpu.blocks import get_num_threads
from minigraph.kernels.cpu.optimizer_ops import learning_rate, targets


def adam_cpu(op, ins, ctx):
    """One Adam/AdamW step (see the module doc)."""
    a = op.attrs
    param, grad, m, v = ins["param"], ins["grad"], ins["moment1"], ins["moment2"]
    b1p, b2p = ins["beta1_pow"], ins["beta2_pow"]
    po, mo, vo, b1o, b2o = targets(ctx, ins, ("param", "moment1", "moment2", "beta1_pow",
                                              "beta2_pow"))
    if param.dtype == np.float16:
        param, grad = param.astype(np.float32), grad.astype(np.float32)
    dt = param.dtype.type
    lr, wd = learning_rate(ins), a["weight_decay"]
    beta1, new_b1p = a["beta1"], float(b1p) * a["beta1"]
    if ins.get("beta1_value") is not None:          # cycled: torch's beta1 ** step
        beta1 = float(np.asarray(ins["beta1_value"]).reshape(()))
        new_b1p = beta1 ** float(np.asarray(ins["step"]).reshape(()))
    new_b2p = float(b2p) * a["beta2"]
    if not optim_native.worth_it("adam", param) or not optim_native.update(
            "adam", param, grad, (m, v), (po, mo, vo), lr=lr, wd=wd,
            betas=(beta1, a["beta2"]), eps=a["epsilon"],
            corrections=(lr / (1.0 - new_b1p), math.sqrt(1.0 - new_b2p)),
            decoupled=a["decoupled"], threads=get_num_threads()):
        if a["decoupled"]:
            new_param = param * dt(1.0 - lr * wd)
        else:
            new_param = param
            if wd:
                grad = grad + dt(wd) * param
        new_m = m + dt(1.0 - beta1) * (grad - m)
        new_v = v * dt(a["beta2"]) + dt(1.0 - a["beta2"]) * grad * grad
        denom = np.sqrt(new_v) / dt(np.sqrt(1.0 - new_b2p)) + dt(a["epsilon"])
        new_param = new_param - dt(lr / (1.0 - new_b1p)) * new_m / denom
        np.copyto(po, new_param)
        np.copyto(mo, new_m)
        np.copyto(vo, new_v)
    b1o[...] = new_b1p
    b2o[...] = new_b2p
    return {"param_out": po, "moment1_out": mo, "moment2_out": vo,
            "beta1_pow_out": b1o, "beta2_pow_out": b2o}
