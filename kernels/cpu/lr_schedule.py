"""CPU kernel of lr_schedule (ops/lr_schedule.py): the learning rate of the step in
float64 (`schedule_value`, the reference of the GPU kernel too), then step += 1.
"""
from __future__ import annotations

import bisect
import math

import numpy as np


def cos_anneal(start, end, pct):
    """From start (pct 0) to end (pct 1) along half a cosine (torch's arithmetic order)."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


def one_cycle(attrs, t):
    """torch OneCycleLR (two phases, cos): up from max/divide_factor to max over the
    first phase_pct of the steps, then down to end_lr; end_lr after total_steps."""
    peak, total = attrs["base_lr"], attrs["total_steps"]
    rise_end = float(attrs["phase_pct"] * total) - 1.0
    if t <= rise_end:
        return cos_anneal(peak / attrs["divide_factor"], peak, t / rise_end)
    pct = min((t - rise_end) / (total - 1 - rise_end), 1.0)
    return cos_anneal(peak, attrs["end_lr"], pct)


def schedule_value(attrs, t):
    """The learning rate of step t (an int >= 0) under `attrs` (a float)."""
    warm = attrs.get("linear_warmup_steps", 0)
    if t < warm:
        start, end = attrs["linear_warmup_start"], attrs["linear_warmup_end"]
        return start + (end - start) * t / warm
    t -= warm
    kind, base = attrs["kind"], attrs["base_lr"]
    if kind == "constant":
        return base
    if kind == "step":
        return base * attrs["gamma"] ** (t // attrs["step_size"])
    if kind == "exponential":
        return base * attrs["gamma"] ** t
    if kind == "multistep":
        return base * attrs["gamma"] ** bisect.bisect_right(attrs["milestones"], t)
    if kind == "onecycle":
        return one_cycle(attrs, t)
    cw = attrs["warmup_steps"]
    if t < cw:
        return base * (t + 1) / cw
    end = attrs["end_lr"]
    span = attrs["total_steps"] - cw
    return end + (base - end) * (1.0 + math.cos(math.pi * (t - cw) / span)) / 2.0


def lr_schedule_cpu(op, ins, ctx):
    """learning_rate = schedule(step); step += 1 in place."""
    step = ins["step"]
    lr = np.asarray(schedule_value(op.attrs, int(step)), dtype=np.float64)
    step[...] = step + 1
    return {"learning_rate": lr, "step_out": step}
