"""lr_schedule: the learning rate of step t from a schedule, then t += 1.

t is the int64 scalar `step` (a persistable, so a checkpoint resumes the
schedule); `learning_rate` is the optimizer's float64 scalar. First an optional
linear warm-up: t < L = linear_warmup_steps gives
  linear_warmup_start + (linear_warmup_end - linear_warmup_start) * t / L
and later steps run the schedule below at t - L. With base = base_lr:
  kind="constant":    base
  kind="step":        base * gamma ** (t // step_size)           (torch StepLR)
  kind="exponential": base * gamma ** t                          (torch ExponentialLR)
  kind="multistep":   base * gamma ** (the number of milestones <= t)  (MultiStepLR)
  kind="cosine":      t < W: base * (t + 1) / W                  (its own warm-up)
                      else, with t' = t - W and T = total_steps - W:
                      end_lr + (base - end_lr) * (1 + cos(pi * t' / T)) / 2
                      (torch CosineAnnealingLR's closed form; W = warmup_steps)
  kind="onecycle":    torch OneCycleLR with max_lr = base, initial = base /
                      divide_factor: R = phase_pct * total_steps - 1; t <= R: from
                      initial up to base at pct t / R; then down to end_lr at pct
                      (t - R) / (total_steps - 1 - R), end_lr from then on. With
                      three_phase: up to R, back down to initial at R2 = 2 *
                      phase_pct * total_steps - 2, then down to end_lr at
                      total_steps - 1. anneal "cos": a cosine between a and b,
                      b + (a - b) / 2 * (cos(pi pct) + 1); "linear": a + (b - a) pct.
                      The optional output `momentum` (bound: OneCycleLR's
                      cycle_momentum) follows the phases the other way,
                      max_momentum -> base_momentum -> max_momentum (three_phase:
                      then stays at max_momentum), for the optimizer's momentum or
                      Adam's beta1; other kinds keep it at max_momentum.
No gradient. Kernels: kernels/cpu/lr_schedule.py, kernels/cuda/lr_schedule.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import lr_schedule as cpu
from minigraph.kernels.cuda import lr_schedule as cuda
from minigraph.schema import Meta, OpError, OpSchema, Slot, examples, kernel, register
from minigraph.validators import (
    bool_attr,
    fail,
    float_attr,
    in_range,
    int_attr,
    ints_attr,
    is_int,
    non_negative,
    one_of,
    positive,
    str_attr,
)

KINDS = ("constant", "step", "exponential", "multistep", "cosine", "onecycle")


def infer_schedule(ins, attrs):
    step = ins["step"]
    if tuple(step.shape) != () or step.dtype != np.int64:
        fail("lr_schedule", "step", f"must be an int64 scalar (shape ()), got {step.dtype} of "
                                    f"shape {step.shape}")
    scalar = Meta((), np.dtype(np.float64))
    return {"learning_rate": scalar, "step_out": step, "momentum": scalar}


def check_milestones(v):
    """A complaint unless `v` is a strictly increasing tuple of ints >= 0."""
    if not all(is_int(m) and m >= 0 for m in v) or any(b <= a for a, b in zip(v, v[1:])):
        return "must be a strictly increasing tuple of ints >= 0"
    return None


def phase_ends(phase_pct, total_steps, three_phase):
    """The last steps of OneCycleLR's phases (floats, torch's arithmetic)."""
    rise = float(phase_pct * total_steps) - 1.0
    if three_phase:
        return rise, float(2 * phase_pct * total_steps) - 2.0, float(total_steps - 1)
    return rise, float(total_steps - 1)


def validate_schedule(op):
    a = op.attrs
    if a["kind"] == "onecycle" and a["three_phase"]:
        ends = phase_ends(a["phase_pct"], a["total_steps"], True)
        if not 0 < ends[0] < ends[1] < ends[2]:
            raise OpError(f"lr_schedule: three-phase onecycle needs 0 < phase_pct * total_steps "
                          f"- 1 < 2 * phase_pct * total_steps - 2 < total_steps - 1 (three "
                          f"phases of at least one step), got phase_pct={a['phase_pct']}, "
                          f"total_steps={a['total_steps']}")
        return
    if a["kind"] == "cosine" and a["warmup_steps"] >= a["total_steps"]:
        raise OpError(f"lr_schedule: attribute 'warmup_steps' ({a['warmup_steps']}) must be "
                      f"smaller than 'total_steps' ({a['total_steps']})")
    if a["kind"] == "onecycle":
        rise_end = a["phase_pct"] * a["total_steps"] - 1
        if not 0 < rise_end < a["total_steps"] - 1:
            raise OpError(f"lr_schedule: onecycle needs 0 < phase_pct * total_steps - 1 < "
                          f"total_steps - 1 (a rise and a fall of at least one step each), got "
                          f"phase_pct={a['phase_pct']}, total_steps={a['total_steps']}")


def resolve(attrs):
    """Stored form: milestones as a tuple of Python ints."""
    return {**attrs, "milestones": tuple(int(m) for m in attrs["milestones"])}



register(OpSchema(
    type="lr_schedule", inputs=(Slot("step"),),
    outputs=(Slot("learning_rate"), Slot("step_out"), Slot("momentum", optional=True)),
    attrs=(str_attr("kind", "step", one_of(*KINDS)),
           float_attr("base_lr", 0.1, non_negative), int_attr("step_size", 1, positive),
           float_attr("gamma", 0.1, non_negative), int_attr("total_steps", 1, positive),
           float_attr("end_lr", 0.0, non_negative), int_attr("warmup_steps", 0, non_negative),
           ints_attr("milestones", (), check_milestones),
           float_attr("divide_factor", 25.0, positive),
           float_attr("phase_pct", 0.3, in_range(0.0, 1.0)),
           int_attr("linear_warmup_steps", 0, non_negative),
           float_attr("linear_warmup_start", 0.0, non_negative),
           float_attr("linear_warmup_end", 0.0, non_negative),
           bool_attr("three_phase", False), str_attr("anneal", "cos", one_of("cos", "linear")),
           float_attr("base_momentum", 0.85, in_range(0.0, 1.0)),
           float_attr("max_momentum", 0.95, in_range(0.0, 1.0))),
    inplace={"step_out": "step"}, infer=infer_schedule, validate=validate_schedule,
    resolve_attrs=resolve,
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
        ("exponential", {"step": np.array(5, np.int64)},
         dict(kind="exponential", base_lr=0.1, gamma=0.9), ()),
        ("multistep", {"step": np.array(6, np.int64)},
         dict(kind="multistep", base_lr=0.1, milestones=(2, 6, 9), gamma=0.5), ()),
        ("onecycle-rise", {"step": np.array(2, np.int64)},
         dict(kind="onecycle", base_lr=0.1, total_steps=20, end_lr=1e-4), ()),
        ("onecycle-fall", {"step": np.array(13, np.int64)},
         dict(kind="onecycle", base_lr=0.1, total_steps=20, end_lr=1e-4, phase_pct=0.25), ()),
        ("warmup-constant", {"step": np.array(2, np.int64)},
         dict(kind="constant", base_lr=0.1, linear_warmup_steps=4, linear_warmup_start=0.01,
              linear_warmup_end=0.1), ()),
        ("onecycle-three-phase-linear", {"step": np.array(9, np.int64)},
         dict(kind="onecycle", base_lr=0.1, total_steps=20, end_lr=1e-5, three_phase=True,
              anneal="linear"), ()),
        ("onecycle-momentum-cos", {"step": np.array(4, np.int64)},
         dict(kind="onecycle", base_lr=0.1, total_steps=12, end_lr=1e-5, base_momentum=0.8,
              max_momentum=0.9), ()),
        ("warmup-then-step", {"step": np.array(9, np.int64)},
         dict(kind="step", base_lr=0.1, step_size=2, gamma=0.5, linear_warmup_steps=4,
              linear_warmup_end=0.1), ()),
    ]


examples("lr_schedule", lr_schedule_examples)
