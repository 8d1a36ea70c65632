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


def linear_anneal(start, end, pct):
    """From start (pct 0) to end (pct 1) along a line (torch's arithmetic order)."""
    return (end - start) * pct + start


def one_cycle_phases(attrs):
    """OneCycleLR's phases as torch lists them: (last step, start lr, end lr, start
    momentum, end momentum); last steps as floats."""
    peak, total, pct = attrs["base_lr"], attrs["total_steps"], attrs["phase_pct"]
    initial = peak / attrs["divide_factor"]
    low, high = attrs.get("base_momentum", 0.85), attrs.get("max_momentum", 0.95)
    rise = float(pct * total) - 1.0
    if attrs.get("three_phase", False):
        return ((rise, initial, peak, high, low),
                (float(2 * pct * total) - 2.0, peak, initial, low, high),
                (float(total - 1), initial, attrs["end_lr"], high, high))
    return ((rise, initial, peak, high, low), (float(total - 1), peak, attrs["end_lr"], low, high))


def one_cycle(attrs, t, momentum=False):
    """torch OneCycleLR: the learning rate (or, with `momentum`, the cycled momentum) of
    step t; the last phase's end value after total_steps (torch raises there)."""
    anneal = linear_anneal if attrs.get("anneal", "cos") == "linear" else cos_anneal
    phases = one_cycle_phases(attrs)
    start = 0.0
    for i, (end, lr0, lr1, m0, m1) in enumerate(phases):
        if t <= end or i == len(phases) - 1:
            pct = min((t - start) / (end - start), 1.0)
            return anneal(m0, m1, pct) if momentum else anneal(lr0, lr1, pct)
        start = end
    raise AssertionError("unreachable")


def momentum_value(attrs, t):
    """The momentum of step t in float64: kind "onecycle" cycles it (OneCycleLR's
    cycle_momentum); other kinds keep max_momentum."""
    if attrs["kind"] != "onecycle":
        return attrs.get("max_momentum", 0.95)
    return one_cycle(attrs, t, momentum=True)


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
    """learning_rate = schedule(step) (and momentum, when cycled); step += 1 in place."""
    step = ins["step"]
    t = int(step)
    out = {"learning_rate": np.asarray(schedule_value(op.attrs, t), dtype=np.float64)}
    if op.wants("momentum"):
        out["momentum"] = np.asarray(momentum_value(op.attrs, t), dtype=np.float64)
    step[...] = step + 1
    return {**out, "step_out": step}
