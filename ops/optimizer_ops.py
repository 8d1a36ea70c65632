"""sgd and momentum: parameter updates written in place (no gradients).

With d = grad + weight_decay * param (L2, as torch.optim.SGD):
sgd:      param -= learning_rate * d
momentum: velocity = mu * velocity + d (the PyTorch convention), then
          param -= learning_rate * velocity, or with use_nesterov
          param -= learning_rate * (d + mu * velocity).
`param_out` (and `velocity_out`) are the input Variables themselves: the
kernels compute every new value first, then overwrite the arrays and
return them. learning_rate is a float array of shape () or (1,). momentum's
optional input `mu_value` (a float64 scalar, e.g. OneCycleLR's cycled momentum)
replaces the attribute mu when bound; it is read where the update runs.
Kernels: kernels/cpu/optimizer_ops.py, kernels/cuda/optimizer_ops.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import optimizer_ops as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import optimizer_ops as cuda
from minigraph.schema import Meta, OpSchema, Slot, examples, kernel, register
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


UPDATE = "a training update (an inference graph has none)"


def check_scalar(op_type, slot, meta, dtype):
    """An OpError unless the optional input `slot` (when bound) is a scalar of `dtype`."""
    if meta is not None and (tuple(meta.shape) != () or meta.dtype != np.dtype(dtype)):
        fail(op_type, slot, f"must be a {np.dtype(dtype)} scalar (shape ()), got {meta.dtype} "
                            f"of shape {meta.shape}")


def infer_momentum(ins, attrs):
    check_scalar("momentum", "mu_value", ins.get("mu_value"), np.float64)
    return dict.fromkeys(("param_out", "velocity_out"),
                         check_update_inputs("momentum", ins, ("velocity",)))


def momentum_attrs():
    """mu (the momentum, in [0, 1]) and use_nesterov: momentum's own attributes."""
    return float_attr("mu", 0.9, in_range(0.0, 1.0)), bool_attr("use_nesterov", False)


def decay_attr():
    """weight_decay: the L2 coefficient added to the gradient (>= 0)."""
    return float_attr("weight_decay", 0.0, non_negative)


register(OpSchema(
    type="sgd", inputs=(Slot("param"), Slot("grad"), Slot("learning_rate")),
    outputs=(Slot("param_out"),), inplace={"param_out": "param"}, spares=True,
    attrs=(decay_attr(),),
    infer=lambda ins, attrs: {"param_out": check_update_inputs("sgd", ins)}, no_export=UPDATE,
    doc=__doc__))
register(OpSchema(
    type="momentum",
    inputs=(Slot("param"), Slot("grad"), Slot("velocity"), Slot("learning_rate"),
            Slot("mu_value", optional=True)),
    outputs=(Slot("param_out"), Slot("velocity_out")),
    attrs=momentum_attrs() + (decay_attr(),), merged_variant="merged_momentum",
    inplace={"param_out": "param", "velocity_out": "velocity"}, spares=True,
    infer=infer_momentum, no_export=UPDATE, doc=__doc__))

kernel("sgd", "cpu", cpu.sgd_cpu)
kernel("momentum", "cpu", cpu.momentum_cpu)
kernel("sgd", "gpu", cuda.sgd_gpu, dtypes=GPU_FLOATS)
kernel("momentum", "gpu", cuda.momentum_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def sgd_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"param": ex.r(3, 5),
                "grad": ex.r(3, 5, seed=1),
                "learning_rate": np.array(0.1, np.float32)},
         {}, ()),
        ("f64-lr64", {"param": ex.r(9, dtype=np.float64),
                "grad": ex.r(9, dtype=np.float64, seed=1),
                "learning_rate": np.array([0.3])},
         {}, ()),
        ("decay-f32", {"param": ex.r(3, 5),
                "grad": ex.r(3, 5, seed=1),
                "learning_rate": np.array(0.05, np.float32)},
         dict(weight_decay=0.01), ()),
    ]


def momentum_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"param": ex.r(3, 5),
                "grad": ex.r(3, 5, seed=1),
                "velocity": ex.r(3, 5, seed=2),
                "learning_rate": np.array(0.1, np.float32)},
         dict(mu=0.8), ()),
        ("nesterov-f64", {"param": ex.r(4, 3, dtype=np.float64),
                "grad": ex.r(4, 3, dtype=np.float64, seed=1),
                "velocity": ex.r(4, 3, dtype=np.float64, seed=2),
                "learning_rate": np.array(0.1, np.float32)},
         dict(mu=0.9, use_nesterov=True), ()),
        ("decay-nesterov-f64", {"param": ex.r(4, 3, dtype=np.float64),
                "grad": ex.r(4, 3, dtype=np.float64, seed=1),
                "velocity": ex.r(4, 3, dtype=np.float64, seed=2),
                "learning_rate": np.array(0.05, np.float32)},
         dict(mu=0.9, use_nesterov=True, weight_decay=0.1), ()),
        ("cycled-mu-f32", {"param": ex.r(3, 6), "grad": ex.r(3, 6, seed=1),
                           "velocity": ex.r(3, 6, seed=2),
                           "learning_rate": np.array(0.1, np.float32),
                           "mu_value": np.array(0.87)}, dict(mu=0.5), ()),
    ]


examples("sgd", sgd_examples)
examples("momentum", momentum_examples)
