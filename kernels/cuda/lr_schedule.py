"""Launchers for kernels/cuda/lr_schedule.cu: a learning-rate schedule evaluated on the
device from the int64 device step counter, which it then increments (no host sync).

The milestones of kind "multistep" reach the kernel as a small int64 device array,
uploaded once per device and milestone tuple (`milestones_on_device`), with their
count; other kinds pass a null pointer and 0.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader

MODULE = "lr_schedule"
SIGNATURES = {f"lr_schedule_{t}": "PPidqdqdqPiddqddiiPdd" for t in ("f32", "f64")}
KINDS = {"step": 0, "cosine": 1, "constant": 2, "exponential": 3, "multistep": 4,
         "onecycle": 5}


def milestones_on_device(milestones):
    """(device address, count) of an int64 device array holding `milestones` (a
    tuple of ints), uploaded once per device and tuple; (0, 0) for none."""
    milestones = tuple(int(m) for m in milestones)
    if not milestones:
        return 0, 0
    arrays = loader.cached("lr_schedule.milestones", dict)
    found = arrays.get(milestones)
    if found is None:
        found = loader.cache_put(arrays, milestones,
                                 loader.to_device(np.array(milestones, np.int64)), limit=256)
    return loader.address(found), len(milestones)


def check_schedule(kind, step_size=1, total_steps=1, warmup_steps=0, milestones=(),
                   divide_factor=25.0, phase_pct=0.3, linear_warmup_steps=0, three_phase=False):
    """ValueError naming the first attribute the kernel cannot run with."""
    if kind not in KINDS:
        raise ValueError(f"lr_schedule: kind must be one of {sorted(KINDS)}, got {kind!r}")
    if int(step_size) <= 0:
        raise ValueError(f"lr_schedule: step_size must be > 0, got {step_size}")
    if kind == "cosine" and not 0 <= int(warmup_steps) < int(total_steps):
        raise ValueError(f"lr_schedule: warmup_steps ({warmup_steps}) must be in "
                         f"[0, total_steps={total_steps})")
    if kind == "onecycle":
        ends = [float(phase_pct * total_steps) - 1.0, float(int(total_steps) - 1)]
        if three_phase:
            ends.insert(1, float(2 * phase_pct * total_steps) - 2.0)
        if float(divide_factor) <= 0 or not 0 < ends[0] or \
                any(b <= a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"lr_schedule: onecycle needs divide_factor > 0 and 0 < "
                             f"phase_pct * total_steps - 1 < total_steps - 1, got "
                             f"divide_factor={divide_factor}, phase_pct={phase_pct}, "
                             f"total_steps={total_steps}")
    ms = tuple(milestones)
    if any(int(m) < 0 for m in ms) or any(int(b) <= int(a) for a, b in zip(ms, ms[1:])):
        raise ValueError(f"lr_schedule: milestones must be strictly increasing ints >= 0, "
                         f"got {ms}")
    if int(linear_warmup_steps) < 0:
        raise ValueError(f"lr_schedule: linear_warmup_steps must be >= 0, got "
                         f"{linear_warmup_steps}")


def lr_schedule(step, learning_rate, kind, base_lr, step_size=1, gamma=0.1, total_steps=1,
                end_lr=0.0, warmup_steps=0, milestones=(), divide_factor=25.0, phase_pct=0.3,
                linear_warmup_steps=0, linear_warmup_start=0.0, linear_warmup_end=0.0,
                three_phase=False, anneal="cos", momentum=None, base_momentum=0.85,
                max_momentum=0.95):
    """learning_rate (a float32/64 device scalar) = the schedule's rate at step t
    (step: an int64 device scalar), then step += 1; both in place (see
    lr_schedule.cu and ops/lr_schedule.py for the kinds and the linear warm-up in
    front of them). momentum: a float64 device scalar that gets onecycle's cycled
    momentum of step t (max_momentum for other kinds), or None. Returns
    learning_rate."""
    check_schedule(kind, step_size, total_steps, warmup_steps, milestones, divide_factor,
                   phase_pct, linear_warmup_steps, three_phase)
    if anneal not in ("cos", "linear"):
        raise ValueError(f"lr_schedule: anneal must be 'cos' or 'linear', got {anneal!r}")
    if momentum is not None:
        launch.check_array("lr_schedule: momentum", momentum, (), np.float64)
    launch.check_array("lr_schedule: step", step, (), np.int64)
    if learning_rate.size != 1:
        raise ValueError(f"lr_schedule: learning_rate must hold one value, got shape "
                         f"{tuple(learning_rate.shape)}")
    points, count = milestones_on_device(milestones) if kind == "multistep" else (0, 0)
    name = f"lr_schedule_{loader.suffix(learning_rate.dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    k.launch((1, 1, 1), (32, 1, 1), loader.ptr(step, "lr_schedule: step"),
             loader.ptr(learning_rate, "lr_schedule: learning_rate"), KINDS[kind],
             float(base_lr), int(step_size), float(gamma), int(total_steps), float(end_lr),
             int(warmup_steps), points, count, float(divide_factor), float(phase_pct),
             int(linear_warmup_steps), float(linear_warmup_start), float(linear_warmup_end),
             int(bool(three_phase)), int(anneal == "linear"),
             0 if momentum is None else loader.ptr(momentum, "lr_schedule: momentum"),
             float(base_momentum), float(max_momentum))
    return learning_rate


# ---- op kernels -------------------------------------------------------------------

ATTRS = ("kind", "base_lr", "step_size", "gamma", "total_steps", "end_lr", "warmup_steps",
         "milestones", "divide_factor", "phase_pct", "linear_warmup_steps",
         "linear_warmup_start", "linear_warmup_end", "three_phase", "anneal")


def lr_schedule_gpu(op, ins, ctx):
    """learning_rate = schedule(step) into a new float64 device scalar (and the cycled
    momentum into another, when asked for), then step += 1, all by one device thread
    (no host sync)."""
    step = ins["step"]
    a = op.attrs
    momentum = loader.empty((), np.float64) if op.wants("momentum") else None
    lr = lr_schedule(step, loader.empty((), np.float64), *(a[k] for k in ATTRS),
                     momentum=momentum, base_momentum=a["base_momentum"],
                     max_momentum=a["max_momentum"])
    out = {"learning_rate": lr, "step_out": step}
    if momentum is not None:
        out["momentum"] = momentum
    return out
