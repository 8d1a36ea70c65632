"""Learning-rate schedules: pass one as an optimizer's `learning_rate`.

    StepDecay(learning_rate, step_size, gamma=0.1)
        lr_t = learning_rate * gamma ** (t // step_size)       (torch StepLR)
    CosineDecay(learning_rate, total_steps, end_lr=0.0, warmup_steps=0)
        t < W: learning_rate * (t + 1) / W  (linear warm-up over W = warmup_steps)
        then end_lr + (learning_rate - end_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
        with T = total_steps; warmup_steps=0 is torch's
        CosineAnnealingLR(T_max=total_steps, eta_min=end_lr), closed form.

t counts the net's training steps (t = 0 for the first). The schedule runs
as an `lr_schedule` op at the start of the update section, so it advances
once per `net.train` step; its counter is the persistable
`<learning rate name>.step`, saved in checkpoints, so a loaded checkpoint
resumes the schedule where it stopped.
"""
from __future__ import annotations

from minigraph.validators import check_number, is_int


def _count(value, what, low):
    if not is_int(value) or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


class Schedule:
    """Base of the schedules: `attrs()` are the lr_schedule op's attributes."""

    kind = ""

    def __init__(self, learning_rate):
        self.learning_rate = check_number(learning_rate, f"{type(self).__name__}: learning_rate")

    def attrs(self):
        return {"kind": self.kind, "base_lr": self.learning_rate}


class StepDecay(Schedule):
    """learning_rate * gamma ** (t // step_size) (torch StepLR, stepped per step)."""

    kind = "step"

    def __init__(self, learning_rate, step_size, gamma=0.1):
        super().__init__(learning_rate)
        self.step_size = _count(step_size, "StepDecay: step_size", 1)
        self.gamma = check_number(gamma, "StepDecay: gamma")

    def attrs(self):
        return {**super().attrs(), "step_size": self.step_size, "gamma": self.gamma}


class CosineDecay(Schedule):
    """Cosine from learning_rate to end_lr over total_steps, after an optional
    linear warm-up (see the module doc)."""

    kind = "cosine"

    def __init__(self, learning_rate, total_steps, end_lr=0.0, warmup_steps=0):
        from minigraph.optimizer import check_learning_rate

        super().__init__(learning_rate)
        self.total_steps = _count(total_steps, "CosineDecay: total_steps", 1)
        self.warmup_steps = _count(warmup_steps, "CosineDecay: warmup_steps", 0)
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"CosineDecay: warmup_steps ({self.warmup_steps}) must be smaller "
                             f"than total_steps ({self.total_steps})")
        self.end_lr = check_learning_rate(end_lr, "CosineDecay: end_lr")

    def attrs(self):
        return {**super().attrs(), "total_steps": self.total_steps, "end_lr": self.end_lr,
                "warmup_steps": self.warmup_steps}
