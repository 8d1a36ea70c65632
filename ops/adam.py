"""adam: the Adam update (torch.optim.Adam), or AdamW's with decoupled=True; in place.

With t the step this update makes (beta1_pow = beta1^t after it, and the
same for beta2), g = grad, lr the learning rate, wd the weight decay:
    decoupled (AdamW):  param *= 1 - lr * wd            else  g = g + wd * param (L2)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)
beta1_pow and beta2_pow are float64 scalars that start at 1 (torch keeps the
step count and raises the betas to it in double; the running products agree
to the last bits). Every output is its input Variable, updated in place.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import optimizer_ops as gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.ops.optimizer_ops import check_update_inputs, decay_attr, learning_rate
from minigraph.schema import Meta, OpSchema, Slot, kernel, register
from minigraph.validators import bool_attr, fail, float_attr, positive

STATE = ("moment1", "moment2")
POWERS = ("beta1_pow", "beta2_pow")


def beta_range(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def infer_adam(ins, attrs):
    meta = check_update_inputs("adam", ins, STATE)
    for slot in POWERS:
        m = ins[slot]
        if tuple(m.shape) != () or m.dtype != np.float64:
            fail("adam", slot, f"must be a float64 scalar (shape ()), got {m.dtype} of shape "
                               f"{m.shape}")
    scalar = Meta((), np.dtype(np.float64))
    return {"param_out": meta, "moment1_out": meta, "moment2_out": meta,
            "beta1_pow_out": scalar, "beta2_pow_out": scalar}


SLOTS = ("param",) + STATE + POWERS
register(OpSchema(
    type="adam",
    inputs=(Slot("param"), Slot("grad")) + tuple(Slot(s) for s in SLOTS[1:])
    + (Slot("learning_rate"),),
    outputs=tuple(Slot(f"{s}_out") for s in SLOTS),
    attrs=(float_attr("beta1", 0.9, beta_range), float_attr("beta2", 0.999, beta_range),
           float_attr("epsilon", 1e-8, positive), decay_attr(), bool_attr("decoupled", False)),
    inplace={f"{s}_out": s for s in SLOTS},
    infer=infer_adam, doc=__doc__))


@kernel("adam", "cpu")
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


# ---- GPU bindings: kernels/optimizer_ops.cu ----

@kernel("adam", "gpu", dtypes=GPU_FLOATS)
def adam_gpu(op, ins, ctx):
    """One Adam/AdamW step on the device, every state array (the beta powers too)
    updated in place there; returns them."""
    a = op.attrs
    gpu.adam(ins["param"], ins["grad"], ins["moment1"], ins["moment2"], ins["beta1_pow"],
             ins["beta2_pow"], ins["learning_rate"], a["beta1"], a["beta2"], a["epsilon"],
             a["weight_decay"], a["decoupled"])
    return {f"{s}_out": ins[s] for s in SLOTS}
