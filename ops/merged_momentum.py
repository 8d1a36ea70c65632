"""merged_momentum: the momentum update of several parameters in one op (Paddle's
merged_momentum, PyTorch's foreach momentum), made by passes.merge_updates.

Its lists param, grad and velocity (and param_out, velocity_out, the same
Variables: in-place pairs) are aligned by parameter; learning_rate and the
optional mu_value are shared, and so are the attributes mu, use_nesterov and
weight_decay. Each parameter gets the momentum op's update (ops/optimizer_ops.py), its
formulas in the same order, all through the native kernel that momentum runs for
parameters of 2^14 values and more (below, numpy's separate steps may round a last
bit otherwise than its fused multiply-adds). The op saves the executor's and the
kernel's per-op costs, one per parameter, which on a small net are most of the
update.
Kernels: kernels/cpu/optimizer_ops.py (one native call for the whole list),
kernels/cuda/optimizer_ops.py (the momentum kernel per parameter).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import optimizer_ops as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import optimizer_ops as cuda
from minigraph.ops.optimizer_ops import (
    UPDATE,
    check_scalar,
    check_update_inputs,
    decay_attr,
    momentum_attrs,
)
from minigraph.schema import Meta, OpSchema, Slot, examples, kernel, register
from minigraph.validators import fail

OP = "merged_momentum"
LISTS = ("param", "grad", "velocity")


def infer_merged(ins, attrs):
    """Each parameter checked as momentum checks it (errors name `parameter i`)."""
    check_scalar(OP, "mu_value", ins.get("mu_value"), np.float64)
    lengths = {slot: len(ins[slot]) for slot in LISTS}
    if len(set(lengths.values())) != 1:
        fail(OP, "grad", f"param, grad and velocity must list one entry per parameter, got "
                         f"{lengths['param']}, {lengths['grad']} and {lengths['velocity']}")
    metas = []
    for i in range(lengths["param"]):
        one = {slot: ins[slot][i] for slot in LISTS}
        metas.append(check_update_inputs(f"{OP} (parameter {i})", {
            **one, "learning_rate": ins["learning_rate"]}, ("velocity",)))
    return {"param_out": metas, "velocity_out": [Meta(m.shape, m.dtype) for m in metas]}


def validate_merged(op):
    """Each parameter at most once: two updates of one array in one op would race."""
    seen = set()
    for v in op.inputs["param"]:
        if id(v) in seen:
            fail(OP, "param", f"lists the parameter {v.name!r} twice")
        seen.add(id(v))


register(OpSchema(
    type=OP,
    inputs=(Slot("param", duplicable=True), Slot("grad", duplicable=True),
            Slot("velocity", duplicable=True), Slot("learning_rate"),
            Slot("mu_value", optional=True)),
    outputs=(Slot("param_out", duplicable=True), Slot("velocity_out", duplicable=True)),
    attrs=momentum_attrs() + (decay_attr(),),
    inplace={"param_out": "param", "velocity_out": "velocity"}, spares=True,
    roles=("merged_update",), infer=infer_merged, validate=validate_merged, no_export=UPDATE,
    doc=__doc__))

kernel(OP, "cpu", cpu.merged_momentum_cpu)
kernel(OP, "gpu", cuda.merged_momentum_gpu, dtypes=GPU_FLOATS)


def merged_momentum_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values."""
    def lists(shapes, dtype=np.float32):
        return {slot: [ex.r(*s, dtype=dtype, seed=3 * i + k) for i, s in enumerate(shapes)]
                for k, slot in enumerate(LISTS)}
    return [
        ("f32", {**lists([(3, 5), (7,), (40, 600)]),
                 "learning_rate": np.array(0.1, np.float32)}, dict(mu=0.8), ()),
        ("nesterov-decay-f64", {**lists([(4, 3), (5,)], np.float64),
                                "learning_rate": np.array([0.05])},
         dict(mu=0.9, use_nesterov=True, weight_decay=0.1), ()),
        ("cycled-mu-f32", {**lists([(3, 6), (2,)]), "learning_rate": np.array(0.1, np.float32),
                           "mu_value": np.array(0.87)}, dict(mu=0.5), ()),
    ]


examples(OP, merged_momentum_examples)
