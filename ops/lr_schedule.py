"""lr_schedule: the learning rate of step t from a schedule, then t += 1.

t is the int64 scalar `step` (a persistable, so a checkpoint resumes the
schedule); `learning_rate` is the optimizer's float64 scalar. With
base = base_lr:
  kind="step":    base * gamma ** (t // step_size)           (torch StepLR)
  kind="cosine":  t < W: base * (t + 1) / W                  (linear warm-up)
                  else, with t' = t - W and T = total_steps - W:
                  end_lr + (base - end_lr) * (1 + cos(pi * t' / T)) / 2
                  (torch CosineAnnealingLR's closed form; W = warmup_steps)
No gradient. Kernels: kernels/cpu/lr_schedule.py, kernels/cuda/lr_schedule.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import lr_schedule as cpu
from minigraph.kernels.cuda import lr_schedule as cuda
from minigraph.schema import Meta, OpError, OpSchema, Slot, examples, kernel, register
from minigraph.validators import (
    fail,
    float_attr,
    int_attr,
    non_negative,
    one_of,
    positive,
    str_attr,
)


def infer_schedule(ins, attrs):
    step = ins["step"]
    if tuple(step.shape) != () or step.dtype != np.int64:
        fail("lr_schedule", "step", f"must be an int64 scalar (shape ()), got {step.dtype} of "
                                    f"shape {step.shape}")
    return {"learning_rate": Meta((), np.dtype(np.float64)), "step_out": step}


def validate_schedule(op):
    a = op.attrs
    if a["kind"] == "cosine" and a["warmup_steps"] >= a["total_steps"]:
        raise OpError(f"lr_schedule: attribute 'warmup_steps' ({a['warmup_steps']}) must be "
                      f"smaller than 'total_steps' ({a['total_steps']})")


register(OpSchema(
    type="lr_schedule", inputs=(Slot("step"),),
    outputs=(Slot("learning_rate"), Slot("step_out")),
    attrs=(str_attr("kind", "step", one_of("step", "cosine")),
           float_attr("base_lr", 0.1, non_negative), int_attr("step_size", 1, positive),
           float_attr("gamma", 0.1, non_negative), int_attr("total_steps", 1, positive),
           float_attr("end_lr", 0.0, non_negative), int_attr("warmup_steps", 0, non_negative)),
    inplace={"step_out": "step"}, infer=infer_schedule, validate=validate_schedule,
    no_export="a training schedule (an inference graph has none)", doc=__doc__))


kernel("lr_schedule", "cpu", cpu.lr_schedule_cpu)
kernel("lr_schedule", "gpu", cuda.lr_schedule_gpu)


# ---- examples ---------------------------------------------------------------------

def lr_schedule_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("step", {"step": np.array(7, np.int64)},
         dict(kind="step", base_lr=0.1, step_size=3, gamma=0.5), ()),
        ("cosine-warmup", {"step": np.array(1, np.int64)},
         dict(kind="cosine", base_lr=0.1, total_steps=10, warmup_steps=3), ()),
        ("cosine", {"step": np.array(6, np.int64)},
         dict(kind="cosine", base_lr=0.1, total_steps=10, end_lr=0.01), ()),
    ]


examples("lr_schedule", lr_schedule_examples)
