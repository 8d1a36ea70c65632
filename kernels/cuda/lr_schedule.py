"""Launchers for kernels/cuda/lr_schedule.cu: a learning-rate schedule evaluated on the
device from the int64 device step counter, which it then increments (no host sync)."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader

MODULE = "lr_schedule"
SIGNATURES = {f"lr_schedule_{t}": "PPidqdqdq" for t in ("f32", "f64")}
KINDS = {"step": 0, "cosine": 1}


def lr_schedule(step, learning_rate, kind, base_lr, step_size=1, gamma=0.1, total_steps=1,
                end_lr=0.0, warmup_steps=0):
    """learning_rate (a float32/64 device scalar) = the schedule's rate at step t
    (step: an int64 device scalar), then step += 1; both in place (see
    lr_schedule.cu). Returns learning_rate."""
    if kind not in KINDS:
        raise ValueError(f"lr_schedule: kind must be one of {sorted(KINDS)}, got {kind!r}")
    if int(step_size) <= 0:
        raise ValueError(f"lr_schedule: step_size must be > 0, got {step_size}")
    if kind == "cosine" and not 0 <= int(warmup_steps) < int(total_steps):
        raise ValueError(f"lr_schedule: warmup_steps ({warmup_steps}) must be in "
                         f"[0, total_steps={total_steps})")
    launch.check_array("lr_schedule: step", step, (), np.int64)
    if learning_rate.size != 1:
        raise ValueError(f"lr_schedule: learning_rate must hold one value, got shape "
                         f"{tuple(learning_rate.shape)}")
    name = f"lr_schedule_{loader.suffix(learning_rate.dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    k.launch((1, 1, 1), (32, 1, 1), loader.ptr(step, "lr_schedule: step"),
             loader.ptr(learning_rate, "lr_schedule: learning_rate"), KINDS[kind],
             float(base_lr), int(step_size), float(gamma), int(total_steps), float(end_lr),
             int(warmup_steps))
    return learning_rate


# ---- op kernels -------------------------------------------------------------------

def lr_schedule_gpu(op, ins, ctx):
    """learning_rate = schedule(step) into a new float64 device scalar, then step += 1,
    both by one device thread (no host sync)."""
    step = ins["step"]
    a = op.attrs
    lr = lr_schedule(step, loader.empty((), np.float64), a["kind"], a["base_lr"],
                         a["step_size"], a["gamma"], a["total_steps"], a["end_lr"],
                         a["warmup_steps"])
    return {"learning_rate": lr, "step_out": step}
