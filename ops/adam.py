"""adam: the Adam update (torch.optim.Adam), or AdamW's with decoupled=True; in place.

With t the step this update makes (beta1_pow = beta1^t after it, and the
same for beta2), g = grad, lr the learning rate, wd the weight decay:
    decoupled (AdamW):  param *= 1 - lr * wd            else  g = g + wd * param (L2)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + epsilon)
beta1_pow and beta2_pow are float64 scalars that start at 1 (torch keeps the
step count and raises the betas to it in double; the running products agree
to the last bits). With the optional inputs `beta1_value` (a float64 scalar: a
cycled beta1, OneCycleLR's momentum) and `step` (the int64 count of updates made,
this one included) bound, beta1 is beta1_value and beta1_pow becomes
beta1_value ** step, torch's bias correction with the current beta1. Every output
is its input Variable, updated in place. A float16 param takes float32 moments,
and its update is computed in float32 (in float16 epsilon = 1e-8 is 0 and small
squared gradients underflow, so the first step divided by zero); the new param
is rounded to float16.
Kernels: kernels/cpu/adam.py, kernels/cuda/optimizer_ops.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import adam as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import optimizer_ops as cuda
from minigraph.ops.optimizer_ops import UPDATE, check_scalar, check_update_inputs, decay_attr
from minigraph.schema import Meta, OpSchema, Slot, examples, kernel, register
from minigraph.validators import bool_attr, fail, float_attr, positive

STATE = ("moment1", "moment2")
POWERS = ("beta1_pow", "beta2_pow")


def beta_range(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


def infer_adam(ins, attrs):
    meta = check_update_inputs("adam", ins)
    work = np.dtype(np.float32) if meta.dtype == np.float16 else meta.dtype
    for slot in STATE:
        m = ins[slot]
        if tuple(m.shape) != tuple(meta.shape) or m.dtype != work:
            fail("adam", slot, f"must have shape {tuple(meta.shape)} and dtype {work} (those "
                               "of 'param'; float32 for a float16 param), got "
                               f"{m.dtype} of shape {tuple(m.shape)}")
    check_scalar("adam", "beta1_value", ins.get("beta1_value"), np.float64)
    check_scalar("adam", "step", ins.get("step"), np.int64)
    if (ins.get("beta1_value") is None) != (ins.get("step") is None):
        fail("adam", "beta1_value", "and input 'step' go together (a cycled beta1 needs the "
                                    "update count for its bias correction)")
    for slot in POWERS:
        m = ins[slot]
        if tuple(m.shape) != () or m.dtype != np.float64:
            fail("adam", slot, f"must be a float64 scalar (shape ()), got {m.dtype} of shape "
                               f"{m.shape}")
    scalar = Meta((), np.dtype(np.float64))
    state = Meta(meta.shape, work)
    return {"param_out": meta, "moment1_out": state, "moment2_out": state,
            "beta1_pow_out": scalar, "beta2_pow_out": scalar}


SLOTS = ("param",) + STATE + POWERS
register(OpSchema(
    type="adam",
    inputs=(Slot("param"), Slot("grad")) + tuple(Slot(s) for s in SLOTS[1:])
    + (Slot("learning_rate"), Slot("beta1_value", optional=True), Slot("step", optional=True)),
    outputs=tuple(Slot(f"{s}_out") for s in SLOTS),
    attrs=(float_attr("beta1", 0.9, beta_range), float_attr("beta2", 0.999, beta_range),
           float_attr("epsilon", 1e-8, positive), decay_attr(), bool_attr("decoupled", False)),
    inplace={f"{s}_out": s for s in SLOTS}, spares=True,
    infer=infer_adam, no_export=UPDATE, doc=__doc__))


kernel("adam", "cpu", cpu.adam_cpu)
kernel("adam", "gpu", cuda.adam_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def adam_inputs(ex, dtype, shape=(3, 7)):
    """Adam's inputs: state arrays of `shape`, the beta powers partway, a float32 rate."""
    return {"param": ex.r(*shape, dtype=dtype), "grad": ex.r(*shape, dtype=dtype, seed=1),
            "moment1": ex.r(*shape, dtype=dtype, seed=2) * 0.1,
            "moment2": np.abs(ex.r(*shape, dtype=dtype, seed=3)) * 0.01,
            "beta1_pow": np.array(0.9), "beta2_pow": np.array(0.999),
            "learning_rate": np.array(1e-3, np.float32)}


def adam_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", adam_inputs(ex, np.float32), {}, ()),
        ("l2-f64", adam_inputs(ex, np.float64, (11,)), dict(weight_decay=0.05), ()),
        ("adamw-f32", adam_inputs(ex, np.float32, (2, 9)),
         dict(weight_decay=0.01, decoupled=True), ()),
        ("cycled-beta1-f64", {**adam_inputs(ex, np.float64, (5,)), "beta1_value": np.array(0.88),
                              "step": np.array(3, np.int64)}, {}, ()),
    ]


examples("adam", adam_examples)
