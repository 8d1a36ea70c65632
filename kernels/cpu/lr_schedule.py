"""CPU kernel of lr_schedule (ops/lr_schedule.py): the learning rate of the step in
float64 (`schedule_value`, the reference of the GPU kernel too), then step += 1.
"""
from __future__ import annotations

import math

import numpy as np


def schedule_value(attrs, t):
    """The learning rate of step t (an int >= 0) under `attrs` (a float)."""
    base = attrs["base_lr"]
    if attrs["kind"] == "step":
        return base * attrs["gamma"] ** (t // attrs["step_size"])
    warm = attrs["warmup_steps"]
    if t < warm:
        return base * (t + 1) / warm
    end = attrs["end_lr"]
    span = attrs["total_steps"] - warm
    return end + (base - end) * (1.0 + math.cos(math.pi * (t - warm) / span)) / 2.0


def lr_schedule_cpu(op, ins, ctx):
    """learning_rate = schedule(step); step += 1 in place."""
    step = ins["step"]
    lr = np.asarray(schedule_value(op.attrs, int(step)), dtype=np.float64)
    step[...] = step + 1
    return {"learning_rate": lr, "step_out": step}
