"""lr_schedule: the rate of each step from its counter, against torch's StepLR and
CosineAnnealingLR closed forms (with an optional linear warm-up)."""
import math

import numpy as np
import pytest

import minigraph as mg


def run(attrs, steps, start=0):
    scope = mg.Scope()
    step, lr = scope.new_var("step"), scope.new_var("lr")
    step.set(np.array(start, np.int64))
    op = mg.Operator("lr_schedule", step=step, step_out=step, learning_rate=lr, **attrs)
    counter = step.value
    rates = []
    for _ in range(steps):
        mg.Executor().run([op], scope)
        rates.append(float(lr.get()))
    assert step.value is counter and int(counter) == start + steps
    assert lr.get().dtype == np.float64
    return rates


def test_step_decay_is_step_lr():
    rates = run({"kind": "step", "base_lr": 0.5, "step_size": 3, "gamma": 0.1}, 10)
    np.testing.assert_allclose(rates, [0.5 * 0.1 ** (t // 3) for t in range(10)], rtol=1e-15)


def test_cosine_without_warmup_is_cosine_annealing():
    base, end, total = 0.1, 0.001, 7
    rates = run({"kind": "cosine", "base_lr": base, "end_lr": end, "total_steps": total}, 16)
    want = [end + (base - end) * (1 + math.cos(math.pi * t / total)) / 2 for t in range(16)]
    np.testing.assert_allclose(rates, want, rtol=1e-14)
    assert rates[total] == pytest.approx(end)


def test_cosine_with_warmup_and_resume():
    attrs = {"kind": "cosine", "base_lr": 0.2, "total_steps": 10, "warmup_steps": 4}
    rates = run(attrs, 10)
    np.testing.assert_allclose(rates[:4], [0.05, 0.1, 0.15, 0.2])
    np.testing.assert_allclose(rates[4:], [0.1 * (1 + math.cos(math.pi * t / 6)) for t in range(6)])
    assert run(attrs, 4, start=6) == rates[6:10]           # the counter is all the state


def test_bad_schedules():
    scope = mg.Scope()
    step, lr = scope.new_var("step"), scope.new_var("lr")
    step.set(np.array(0, np.int64))
    with pytest.raises(mg.OpError, match="'warmup_steps' \\(5\\) must be smaller than 'total_steps'"):
        mg.Operator("lr_schedule", step=step, step_out=step, learning_rate=lr, kind="cosine",
                    total_steps=5, warmup_steps=5)
    with pytest.raises(mg.OpError, match="attribute 'kind' must be one of"):
        mg.Operator("lr_schedule", step=step, step_out=step, learning_rate=lr, kind="linear")
    step.set(np.array(0, np.int32))
    with pytest.raises(mg.OpError, match="lr_schedule: input 'step' must be an int64 scalar"):
        mg.Operator("lr_schedule", step=step, step_out=step, learning_rate=lr)
