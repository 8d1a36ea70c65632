"""Learning-rate schedules: pass one as an optimizer's `learning_rate`.

    StepDecay(learning_rate, step_size, gamma=0.1)                   torch StepLR
    ExponentialDecay(learning_rate, gamma)                           torch ExponentialLR
    MultiStepDecay(learning_rate, milestones, gamma=0.1)             torch MultiStepLR
    CosineDecay(learning_rate, total_steps, end_lr=0.0, warmup_steps=0)
        t < W: learning_rate * (t + 1) / W  (linear warm-up over W = warmup_steps)
        then end_lr + (learning_rate - end_lr) * (1 + cos(pi * (t - W) / (T - W))) / 2
        with T = total_steps; warmup_steps=0 is torch's
        CosineAnnealingLR(T_max=total_steps, eta_min=end_lr), closed form.
    OneCycleLR(max_learning_rate, total_steps, divide_factor=25.0,
               end_learning_rate=1e-4, phase_pct=0.3, *, div_factor=None,
               final_div_factor=None, three_phase=False, anneal_strategy="cos",
               cycle_momentum=False, base_momentum=0.85, max_momentum=0.95)
        torch OneCycleLR(max_lr, total_steps, pct_start=phase_pct, div_factor=
        divide_factor, final_div_factor=max_lr / divide_factor / end_learning_rate,
        anneal_strategy, three_phase, cycle_momentum, base_momentum, max_momentum);
        div_factor is torch's name for divide_factor, final_div_factor sets
        end_learning_rate = max_learning_rate / divide_factor / final_div_factor.
        Our defaults differ from torch's in two places: the end rate (1e-4, where
        torch's is max_lr / 25 / 1e4) and cycle_momentum (False; torch's True).
        OneCycleLR.with_torch_defaults(max_lr, total_steps, ...) takes torch's
        signature and defaults. With cycle_momentum the optimizer's momentum
        (Momentum) or beta1 (Adam, AdamW) follows max_momentum -> base_momentum ->
        max_momentum against the rate, step for step as torch sets them; it lives in
        the persistable `<learning rate name>.momentum`. After total_steps the rate
        stays at the end rate (torch raises there).
    LinearWarmup(learning_rate, warmup_steps, start_lr, end_lr)
        t < warmup_steps: start_lr + (end_lr - start_lr) * t / warmup_steps, then
        learning_rate: a number, or one of the schedules above started at its own step 0
        (torch: SequentialLR of LinearLR and that schedule).
    ReduceOnPlateau(learning_rate, mode="min", factor=0.1, patience=10, threshold=1e-4,
                    threshold_mode="rel", cooldown=0, min_lr=0.0, epsilon=1e-8)
        torch ReduceLROnPlateau: the user calls `step(metric)` (say once per epoch).

t counts the optimizer's updates (t = 0 for the first). Every schedule but
ReduceOnPlateau runs as an `lr_schedule` op at the start of the update section,
so it advances once per update; its counter is the persistable
`<learning rate name>.step`. ReduceOnPlateau keeps its state in the persistable
`<learning rate name>.plateau`. Both are saved in checkpoints, so a loaded
checkpoint resumes the schedule where it stopped, bit for bit.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from minigraph.io import checkpoint_values
from minigraph.kernels.cpu.lr_schedule import momentum_value, schedule_value
from minigraph.validators import check_number, is_int


def _count(value, what, low):
    if not is_int(value) or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


class Schedule:
    """Base of the schedules run by the lr_schedule op: `attrs()` are its attributes."""

    kind = ""

    def __init__(self, learning_rate):
        self.learning_rate = check_number(learning_rate, f"{type(self).__name__}: learning_rate")

    def attrs(self):
        return {"kind": self.kind, "base_lr": self.learning_rate}

    def value(self, t):
        """The learning rate of update t (t = 0 for the first), in float64."""
        return schedule_value({**_OP_DEFAULTS, **self.attrs()}, _count(t, "t", 0))


_OP_DEFAULTS = {"step_size": 1, "gamma": 0.1, "total_steps": 1, "end_lr": 0.0,
                "warmup_steps": 0, "milestones": (), "divide_factor": 25.0, "phase_pct": 0.3,
                "linear_warmup_steps": 0, "linear_warmup_start": 0.0, "linear_warmup_end": 0.0,
                "three_phase": False, "anneal": "cos", "base_momentum": 0.85,
                "max_momentum": 0.95}


class StepDecay(Schedule):
    """learning_rate * gamma ** (t // step_size) (torch StepLR, stepped per update)."""

    kind = "step"

    def __init__(self, learning_rate, step_size, gamma=0.1):
        super().__init__(learning_rate)
        self.step_size = _count(step_size, "StepDecay: step_size", 1)
        self.gamma = check_number(gamma, "StepDecay: gamma")

    def attrs(self):
        return {**super().attrs(), "step_size": self.step_size, "gamma": self.gamma}


class ExponentialDecay(Schedule):
    """learning_rate * gamma ** t (torch ExponentialLR)."""

    kind = "exponential"

    def __init__(self, learning_rate, gamma):
        super().__init__(learning_rate)
        self.gamma = check_number(gamma, "ExponentialDecay: gamma")

    def attrs(self):
        return {**super().attrs(), "gamma": self.gamma}


class MultiStepDecay(Schedule):
    """learning_rate * gamma ** (the number of milestones <= t) (torch MultiStepLR);
    milestones: strictly increasing ints >= 0."""

    kind = "multistep"

    def __init__(self, learning_rate, milestones, gamma=0.1):
        super().__init__(learning_rate)
        try:
            ms = tuple(milestones)
        except TypeError:
            ms = None
        if not ms or not all(is_int(m) and m >= 0 for m in ms) or \
                any(b <= a for a, b in zip(ms, ms[1:])):
            raise ValueError(f"MultiStepDecay: milestones must be a non-empty, strictly "
                             f"increasing sequence of ints >= 0, got {milestones!r}")
        self.milestones = tuple(int(m) for m in ms)
        self.gamma = check_number(gamma, "MultiStepDecay: gamma")

    def attrs(self):
        return {**super().attrs(), "milestones": self.milestones, "gamma": self.gamma}


class CosineDecay(Schedule):
    """Cosine from learning_rate to end_lr over total_steps, after an optional
    linear warm-up (see the module doc)."""

    kind = "cosine"

    def __init__(self, learning_rate, total_steps, end_lr=0.0, warmup_steps=0):
        super().__init__(learning_rate)
        self.total_steps = _count(total_steps, "CosineDecay: total_steps", 1)
        self.warmup_steps = _count(warmup_steps, "CosineDecay: warmup_steps", 0)
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"CosineDecay: warmup_steps ({self.warmup_steps}) must be smaller "
                             f"than total_steps ({self.total_steps})")
        self.end_lr = check_number(end_lr, "CosineDecay: end_lr")

    def attrs(self):
        return {**super().attrs(), "total_steps": self.total_steps, "end_lr": self.end_lr,
                "warmup_steps": self.warmup_steps}


class OneCycleLR(Schedule):
    """Up from max_learning_rate / divide_factor to max_learning_rate over the first
    phase_pct of total_steps, then down to end_learning_rate (three_phase: back to
    the start rate first), along a cosine or a line (torch OneCycleLR; see the module
    doc). cycle_momentum cycles the optimizer's momentum or Adam's beta1 the other
    way."""

    kind = "onecycle"

    def __init__(self, max_learning_rate, total_steps, divide_factor=25.0,
                 end_learning_rate=None, phase_pct=0.3, *, div_factor=None,
                 final_div_factor=None, three_phase=False, anneal_strategy="cos",
                 cycle_momentum=False, base_momentum=0.85, max_momentum=0.95):
        name = "OneCycleLR"
        super().__init__(check_number(max_learning_rate, f"{name}: max_learning_rate"))
        self.total_steps = _count(total_steps, f"{name}: total_steps", 1)
        if div_factor is not None:
            if divide_factor != 25.0 and divide_factor != div_factor:
                raise ValueError(f"{name}: divide_factor ({divide_factor}) and div_factor "
                                 f"({div_factor}) are one setting (div_factor is PyTorch's "
                                 "name); give one")
            divide_factor = div_factor
        self.divide_factor = check_number(divide_factor, f"{name}: divide_factor",
                                          low_open=True)
        if final_div_factor is not None:
            if end_learning_rate is not None:
                raise ValueError(f"{name}: end_learning_rate and final_div_factor both set the "
                                 "end rate (end = max_learning_rate / divide_factor / "
                                 "final_div_factor); give one")
            final = check_number(final_div_factor, f"{name}: final_div_factor", low_open=True)
            end_learning_rate = self.learning_rate / self.divide_factor / final
        self.end_learning_rate = check_number(1e-4 if end_learning_rate is None else
                                              end_learning_rate, f"{name}: end_learning_rate")
        self.phase_pct = check_number(phase_pct, f"{name}: phase_pct", high=1.0)
        for arg, value in (("three_phase", three_phase), ("cycle_momentum", cycle_momentum)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: {arg} must be True or False, got {value!r}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"{name}: anneal_strategy must be 'cos' or 'linear', got "
                             f"{anneal_strategy!r}")
        self.three_phase, self.anneal_strategy = three_phase, anneal_strategy
        self.cycle_momentum = cycle_momentum
        self.base_momentum = check_number(base_momentum, f"{name}: base_momentum", high=1.0,
                                          high_open=True)
        self.max_momentum = check_number(max_momentum, f"{name}: max_momentum", high=1.0,
                                         high_open=True)
        ends = [self.phase_pct * self.total_steps - 1, self.total_steps - 1]
        if three_phase:
            ends.insert(1, 2 * self.phase_pct * self.total_steps - 2)
        if not 0 < ends[0] or any(b <= a for a, b in zip(ends, ends[1:])):
            where = ("phase_pct * total_steps - 1 and 2 * phase_pct * total_steps - 2 must lie "
                     "in (0, total_steps - 1), in that order, so the three phases have a step"
                     if three_phase else "phase_pct * total_steps - 1 must lie in (0, "
                     "total_steps - 1) so both phases have a step")
            raise ValueError(f"{name}: {where}, got phase_pct={self.phase_pct}, total_steps="
                             f"{self.total_steps}")

    @classmethod
    def with_torch_defaults(cls, max_lr, total_steps, pct_start=0.3, anneal_strategy="cos",
                            cycle_momentum=True, base_momentum=0.85, max_momentum=0.95,
                            div_factor=25.0, final_div_factor=1e4, three_phase=False):
        """torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr, total_steps, ...) with
        torch's argument names and defaults (cycle_momentum=True, final_div_factor=1e4)."""
        return cls(max_lr, total_steps, phase_pct=pct_start, div_factor=div_factor,
                   final_div_factor=final_div_factor, three_phase=three_phase,
                   anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum,
                   base_momentum=base_momentum, max_momentum=max_momentum)

    def attrs(self):
        return {**super().attrs(), "total_steps": self.total_steps,
                "divide_factor": self.divide_factor, "end_lr": self.end_learning_rate,
                "phase_pct": self.phase_pct, "three_phase": self.three_phase,
                "anneal": self.anneal_strategy, "base_momentum": self.base_momentum,
                "max_momentum": self.max_momentum}

    def momentum(self, t):
        """The cycled momentum (or beta1) of update t (t = 0 for the first), in float64."""
        return momentum_value({**_OP_DEFAULTS, **self.attrs()}, _count(t, "t", 0))


class LinearWarmup(Schedule):
    """Linear from start_lr to end_lr over warmup_steps, then learning_rate (a number
    or a schedule above, started at its own step 0)."""

    def __init__(self, learning_rate, warmup_steps, start_lr, end_lr):
        if isinstance(learning_rate, (LinearWarmup, ReduceOnPlateau)):
            raise TypeError(f"LinearWarmup: learning_rate must be a number or a StepDecay, "
                            f"ExponentialDecay, MultiStepDecay, CosineDecay or OneCycleLR, got "
                            f"a {type(learning_rate).__name__}")
        if getattr(learning_rate, "cycle_momentum", False):
            raise ValueError("LinearWarmup: a OneCycleLR that cycles the momentum cannot follow "
                             "a warm-up (the momentum of the warm-up steps is undefined)")
        self.after = learning_rate if isinstance(learning_rate, Schedule) else None
        super().__init__(self.after.learning_rate if self.after is not None
                         else learning_rate)
        self.warmup_steps = _count(warmup_steps, "LinearWarmup: warmup_steps", 1)
        self.start_lr = check_number(start_lr, "LinearWarmup: start_lr")
        self.end_lr = check_number(end_lr, "LinearWarmup: end_lr")

    def attrs(self):
        after = self.after.attrs() if self.after is not None else \
            {"kind": "constant", "base_lr": self.learning_rate}
        return {**after, "linear_warmup_steps": self.warmup_steps,
                "linear_warmup_start": self.start_lr, "linear_warmup_end": self.end_lr}


class ReduceOnPlateau:
    """Divide the rate by 1 / factor when a metric has stopped improving (torch
    ReduceLROnPlateau): `step(metric)` after each epoch. A metric improves on the
    best so far when it is below best * (1 - threshold) (mode "min", threshold_mode
    "rel"; "abs": best - threshold; mode "max" mirrors both). After more than
    `patience` steps without improvement the rate becomes max(rate * factor, min_lr)
    (unchanged when that moves it by epsilon or less) and `cooldown` steps follow in
    which bad steps are not counted."""

    def __init__(self, learning_rate, mode="min", factor=0.1, patience=10, threshold=1e-4,
                 threshold_mode="rel", cooldown=0, min_lr=0.0, epsilon=1e-8):
        name = "ReduceOnPlateau"
        self.learning_rate = check_number(learning_rate, f"{name}: learning_rate")
        for arg, value in (("mode", mode), ("threshold_mode", threshold_mode)):
            choices = ("min", "max") if arg == "mode" else ("rel", "abs")
            if value not in choices:
                raise ValueError(f"{name}: {arg} must be {choices[0]!r} or {choices[1]!r}, "
                                 f"got {value!r}")
        self.mode, self.threshold_mode = mode, threshold_mode
        self.factor = check_number(factor, f"{name}: factor", high=1.0, high_open=True)
        self.patience = _count(patience, f"{name}: patience", 0)
        self.threshold = check_number(threshold, f"{name}: threshold")
        self.cooldown = _count(cooldown, f"{name}: cooldown", 0)
        self.min_lr = check_number(min_lr, f"{name}: min_lr")
        self.epsilon = check_number(epsilon, f"{name}: epsilon")
        self.lr_var = self.state_var = self._place = None

    def bind(self, net, lr_var, make_state):
        """Called by the optimizer's minimize: the rate to set, and `make_state()` makes
        the state persistable `<lr name>.plateau` (whether a best exists, the best, bad
        steps, cooldown left, steps taken; all 0 at the start), which gets the rule
        its values obey."""
        if self.lr_var is not None:
            raise ValueError("ReduceOnPlateau: this schedule already drives an optimizer; make "
                             "one per optimizer")
        state_var = make_state()
        state_var.value_rule = checkpoint_values.plateau(self.cooldown)
        self.state_var, self.lr_var, self._place = state_var, lr_var, net.place

    def _better(self, metric, best):
        t, rel = self.threshold, self.threshold_mode == "rel"
        if self.mode == "min":
            return metric < (best * (1.0 - t) if rel else best - t)
        return metric > (best * (1.0 + t) if rel else best + t)

    def step(self, metric):
        """Record one epoch's `metric` (a real number; NaN never improves) and lower the
        rate when it has plateaued. Returns the learning rate for the next steps."""
        if self.lr_var is None:
            raise ValueError("ReduceOnPlateau.step: the optimizer has not been minimised yet")
        value = np.asarray(metric)
        if value.size != 1 or not (isinstance(metric, numbers.Real) or value.dtype.kind in "fiu"):
            raise TypeError(f"ReduceOnPlateau.step: metric must be a real number (a scalar), "
                            f"got {type(metric).__name__}"
                            f"{'' if value.size == 1 else f' of {value.size} values'}")
        metric = float(value.reshape(()))
        has_best, best, bad, cooling, steps = (float(v) for v in self.state_var.get())
        if not has_best:
            best = math.inf if self.mode == "min" else -math.inf
        old = float(self.lr_var.get())
        new = old
        if self._better(metric, best):
            has_best, best, bad = 1.0, metric, 0.0
        else:
            bad += 1.0
        if cooling > 0:
            cooling, bad = cooling - 1.0, 0.0
        if bad > self.patience:
            lowered = max(old * self.factor, self.min_lr)
            if old - lowered > self.epsilon:
                new = lowered
            cooling, bad = float(self.cooldown), 0.0
        state = np.array([has_best, best if has_best else 0.0, bad, cooling, steps + 1.0],
                         np.float64)
        rate = np.array(new, np.float64)
        self.state_var.set(self._place.to_device(state))
        self.lr_var.set(self._place.to_device(rate))
        return new
