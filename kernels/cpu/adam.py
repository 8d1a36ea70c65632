"""CPU kernel of adam (ops/adam.py): one Adam/AdamW step, every state array updated
in place after every new value is computed.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu.optimizer_ops import learning_rate


def adam_cpu(op, ins, ctx):
    """One Adam/AdamW step (see the module doc); every state array updated in place."""
    a = op.attrs
    param, grad, m, v = ins["param"], ins["grad"], ins["moment1"], ins["moment2"]
    b1p, b2p = ins["beta1_pow"], ins["beta2_pow"]
    dt = param.dtype.type
    lr, wd = learning_rate(ins), a["weight_decay"]
    new_b1p, new_b2p = float(b1p) * a["beta1"], float(b2p) * a["beta2"]
    if a["decoupled"]:
        new_param = param * dt(1.0 - lr * wd)
    else:
        new_param = param
        if wd:
            grad = grad + dt(wd) * param
    new_m = m + dt(1.0 - a["beta1"]) * (grad - m)
    new_v = v * dt(a["beta2"]) + dt(1.0 - a["beta2"]) * grad * grad
    denom = np.sqrt(new_v) / dt(np.sqrt(1.0 - new_b2p)) + dt(a["epsilon"])
    new_param = new_param - dt(lr / (1.0 - new_b1p)) * new_m / denom
    np.copyto(param, new_param)
    np.copyto(m, new_m)
    np.copyto(v, new_v)
    b1p[...] = new_b1p
    b2p[...] = new_b2p
    return {"param_out": param, "moment1_out": m, "moment2_out": v,
            "beta1_pow_out": b1p, "beta2_pow_out": b2p}
