"""The schedules of minigraph.optimizer.lr, step for step against references written the
way PyTorch's schedulers compute (their recursive, chainable forms and their phase
tables, not our closed forms), through a real training net; checkpoints resume them
bit for bit; ReduceOnPlateau against a transcription of ReduceLROnPlateau.step."""
import math

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers
from minigraph.optimizer import lr as sched

rng = np.random.default_rng(0)
X = rng.standard_normal((6, 4))
Y = rng.integers(0, 3, 6)
FEED = {"x": X, "y": Y}


def build(rate, seed=0):
    net = mg.Net(seed=seed)
    x = layers.data(net, "x", shape=(-1, 4), dtype="float64")
    y = layers.data(net, "y", shape=(-1,), dtype="int64")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, layers.fc(net, x, 3), y))
    opt = mg.optimizer.SGD(rate)
    opt.minimize(net, loss)
    return net, opt


def rates(schedule, steps):
    """The learning rate each of `steps` training steps used."""
    net, opt = build(schedule)
    out = []
    for _ in range(steps):
        net.train(feed=FEED)
        out.append(opt.learning_rate)
    return out


def chained(first, factor_of, steps):
    """lr_0 = first, lr_t = lr_{t-1} * factor_of(t): torch's chainable get_lr."""
    out, lr = [], first
    for t in range(steps):
        if t:
            lr = lr * factor_of(t)
        out.append(lr)
    return out


def torch_one_cycle(max_lr, total, div, final_div, pct):
    """OneCycleLR's get_lr (cos, two phases) for last_epoch = 0 .. total - 1."""
    initial, low = max_lr / div, max_lr / div / final_div
    phases = [(float(pct * total) - 1, initial, max_lr), (total - 1, max_lr, low)]
    out = []
    for step in range(total):
        start = 0.0
        for i, (end, a, b) in enumerate(phases):
            if step <= end or i == len(phases) - 1:
                p = (step - start) / (end - start)
                out.append(b + (a - b) / 2.0 * (math.cos(math.pi * p) + 1))
                break
            start = end
    return out


def close(got, want, rel=1e-12):
    np.testing.assert_allclose(got, want, rtol=rel, atol=1e-300)


def test_exponential_decay_is_exponential_lr():
    close(rates(sched.ExponentialDecay(0.3, 0.9), 30), chained(0.3, lambda t: 0.9, 30))


def test_multistep_decay_is_multistep_lr():
    miles = (3, 7, 8)
    want = chained(0.5, lambda t: 0.1 ** miles.count(t), 12)
    close(rates(sched.MultiStepDecay(0.5, list(miles), gamma=0.1), 12), want)


@pytest.mark.parametrize("total, pct", [(20, 0.3), (37, 0.25), (10, 0.5)])
def test_one_cycle_is_one_cycle_lr(total, pct):
    schedule = sched.OneCycleLR(0.1, total, divide_factor=25.0, end_learning_rate=1e-4,
                                phase_pct=pct)
    want = torch_one_cycle(0.1, total, 25.0, 0.1 / 25.0 / 1e-4, pct)
    got = rates(schedule, total + 3)
    close(got[:total], want)
    assert got[total:] == [1e-4] * 3                  # then it holds the end rate


def test_linear_warmup_of_a_number_and_of_a_schedule():
    got = rates(sched.LinearWarmup(0.2, 4, 0.0, 0.2), 7)
    close(got, [0.0, 0.05, 0.1, 0.15, 0.2, 0.2, 0.2])
    inner = sched.StepDecay(0.4, step_size=2, gamma=0.5)
    got = rates(sched.LinearWarmup(inner, 3, 0.01, 0.4), 9)
    warm = [0.01 + (0.4 - 0.01) * t / 3 for t in range(3)]
    close(got, warm + [0.4 * 0.5 ** (t // 2) for t in range(6)])


def test_schedule_value_matches_the_op():
    for schedule in (sched.ExponentialDecay(0.3, 0.9), sched.OneCycleLR(0.1, 20),
                     sched.LinearWarmup(sched.MultiStepDecay(0.5, [2]), 3, 0.0, 0.5)):
        close(rates(schedule, 8), [schedule.value(t) for t in range(8)], rel=0)


@pytest.mark.parametrize("schedule", [
    sched.OneCycleLR(0.1, 12), sched.ExponentialDecay(0.3, 0.8),
    sched.LinearWarmup(sched.CosineDecay(0.2, 6), 3, 0.0, 0.2),
    sched.MultiStepDecay(0.5, [1, 4])], ids=lambda s: type(s).__name__)
def test_a_checkpoint_resumes_every_schedule_bitwise(tmp_path, schedule):
    full, opt = build(schedule)
    want = []
    for _ in range(8):
        full.train(feed=FEED)
        want.append(opt.learning_rate)
    first, _ = build(schedule)
    for _ in range(3):
        first.train(feed=FEED)
    mg.io.save(first, tmp_path / "c.npz")
    resumed, opt2 = build(schedule)
    mg.io.load(resumed, tmp_path / "c.npz")
    got = want[:3]
    for _ in range(5):
        resumed.train(feed=FEED)
        got.append(opt2.learning_rate)
    assert got == want
    for p in full.persistables():
        np.testing.assert_array_equal(resumed.var(p.name).get(), p.get(), err_msg=p.name)


def torch_plateau(metrics, lr, mode="min", factor=0.1, patience=10, threshold=1e-4,
                  threshold_mode="rel", cooldown=0, min_lr=0.0, eps=1e-8):
    """ReduceLROnPlateau.step, transcribed: the rate after each metric."""
    best = math.inf if mode == "min" else -math.inf
    bad = cooling = 0
    out = []
    for m in metrics:
        if mode == "min" and threshold_mode == "rel":
            better = m < best * (1 - threshold)
        elif mode == "min":
            better = m < best - threshold
        elif threshold_mode == "rel":
            better = m > best * (threshold + 1)
        else:
            better = m > best + threshold
        if better:
            best, bad = m, 0
        else:
            bad += 1
        if cooling > 0:
            cooling -= 1
            bad = 0
        if bad > patience:
            new = max(lr * factor, min_lr)
            if lr - new > eps:
                lr = new
            cooling, bad = cooldown, 0
        out.append(lr)
    return out


PLATEAU_METRICS = [1.0, 0.9, 0.95, 0.95, 0.9, 0.97, 0.8, 0.85, 0.85, 0.9, 0.91, 0.92,
                   float("nan"), 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]


@pytest.mark.parametrize("kwargs", [
    dict(patience=2), dict(patience=1, cooldown=2, factor=0.5),
    dict(mode="max", patience=1, threshold_mode="abs", threshold=0.01),
    dict(patience=0, factor=0.5, min_lr=0.02), dict(patience=0, threshold=0.1)])
def test_reduce_on_plateau_is_reduce_lr_on_plateau(kwargs):
    plateau = sched.ReduceOnPlateau(0.1, **kwargs)
    net, opt = build(plateau)
    got = []
    for m in PLATEAU_METRICS:
        net.train(feed=FEED)
        assert opt.learning_rate == (got[-1] if got else 0.1)     # the step used the rate
        got.append(plateau.step(m))
        assert opt.learning_rate == got[-1]
    want = torch_plateau(PLATEAU_METRICS, 0.1, **{k: v for k, v in kwargs.items()})
    assert got == want
    assert min(got) < 0.1                         # every case lowers it at least once


def test_reduce_on_plateau_resumes_from_a_checkpoint(tmp_path):
    def run(metrics, path_in=None, path_out=None):
        plateau = sched.ReduceOnPlateau(0.1, patience=1, cooldown=1, factor=0.5)
        net, _ = build(plateau)
        if path_in:
            mg.io.load(net, path_in)
        out = [plateau.step(m) for m in metrics]
        if path_out:
            mg.io.save(net, path_out)
        return out

    whole = run(PLATEAU_METRICS)
    first = run(PLATEAU_METRICS[:7], path_out=tmp_path / "p.npz")
    assert first + run(PLATEAU_METRICS[7:], path_in=tmp_path / "p.npz") == whole


def test_reduce_on_plateau_checks():
    plateau = sched.ReduceOnPlateau(0.1)
    with pytest.raises(ValueError, match="ReduceOnPlateau.step: the optimizer has not been "
                                         "minimised yet"):
        plateau.step(1.0)
    build(plateau)
    for bad in ("0.5", [1.0, 2.0], None):
        with pytest.raises(TypeError, match="ReduceOnPlateau.step: metric must be a real "
                                            "number"):
            plateau.step(bad)
    assert plateau.step(np.float32(0.5)) == 0.1
    with pytest.raises(ValueError, match="already drives an optimizer"):
        build(plateau)
    with pytest.raises(ValueError, match="ReduceOnPlateau: mode must be 'min' or 'max'"):
        sched.ReduceOnPlateau(0.1, mode="lowest")
    with pytest.raises(ValueError, match="ReduceOnPlateau: factor must be a finite number in "
                                         "\\[0, 1\\)"):
        sched.ReduceOnPlateau(0.1, factor=1.0)
    with pytest.raises(ValueError, match="patience must be an int >= 0"):
        sched.ReduceOnPlateau(0.1, patience=-1)


def test_a_schedule_refuses_set_learning_rate():
    _, opt = build(sched.ReduceOnPlateau(0.1))
    with pytest.raises(ValueError, match="follows a schedule \\(ReduceOnPlateau\\).*"
                                         "ReduceOnPlateau lowers it from a metric"):
        opt.set_learning_rate(0.5)


@pytest.mark.parametrize("make, message", [
    (lambda: sched.ExponentialDecay(0.1, -0.5), "ExponentialDecay: gamma must be"),
    (lambda: sched.MultiStepDecay(0.1, [3, 3]), "MultiStepDecay: milestones must be a "
                                                "non-empty, strictly increasing"),
    (lambda: sched.MultiStepDecay(0.1, []), "milestones must be a non-empty"),
    (lambda: sched.MultiStepDecay(0.1, 5), "milestones must be"),
    (lambda: sched.OneCycleLR(0.1, 3, phase_pct=0.3), "OneCycleLR: phase_pct \\* total_steps "
                                                      "- 1 must lie in"),
    (lambda: sched.OneCycleLR(0.1, 10, divide_factor=0), "OneCycleLR: divide_factor must be"),
    (lambda: sched.LinearWarmup(0.1, 0, 0.0, 0.1), "LinearWarmup: warmup_steps must be an "
                                                   "int >= 1"),
    (lambda: sched.LinearWarmup(sched.LinearWarmup(0.1, 2, 0, 0.1), 2, 0.0, 0.1),
     "LinearWarmup: learning_rate must be a number or"),
    (lambda: sched.LinearWarmup(sched.ReduceOnPlateau(0.1), 2, 0.0, 0.1),
     "LinearWarmup: learning_rate must be a number or"),
])
def test_bad_schedule_arguments(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()
