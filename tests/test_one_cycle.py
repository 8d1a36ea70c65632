"""OneCycleLR with PyTorch's options: div_factor / final_div_factor, three phases, linear
annealing, and momentum cycling for Momentum's momentum and Adam/AdamW's beta1; step for
step against a transcription of torch's OneCycleLR.get_lr (its phase table) and of
torch.optim.SGD / Adam's update loops in numpy; the cycled momentum on the device and in
checkpoints; today's arguments unchanged; bad arguments."""
import math

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers
from minigraph.optimizer import lr as sched

rng = np.random.default_rng(4)
X = rng.standard_normal((6, 4))


def torch_phases(max_lr, total, div=25.0, final_div=1e4, pct=0.3, three_phase=False,
                 base_m=0.85, max_m=0.95):
    """OneCycleLR's _schedule_phases: (end_step, start lr, end lr, start m, end m)."""
    initial = max_lr / div
    low = initial / final_div
    if three_phase:
        return [(float(pct * total) - 1, initial, max_lr, max_m, base_m),
                (float(2 * pct * total) - 2, max_lr, initial, base_m, max_m),
                (total - 1, initial, low, max_m, max_m)]
    return [(float(pct * total) - 1, initial, max_lr, max_m, base_m),
            (total - 1, max_lr, low, base_m, max_m)]


def torch_one_cycle(total, anneal="cos", **kw):
    """[(lr, momentum)] of last_epoch = 0 .. total - 1, as torch's get_lr computes them."""
    def annealed(a, b, p):
        if anneal == "cos":
            return b + (a - b) / 2.0 * (math.cos(math.pi * p) + 1)
        return (b - a) * p + a

    phases = torch_phases(total=total, **kw)
    out = []
    for step in range(total):
        start = 0.0
        for i, (end, lr0, lr1, m0, m1) in enumerate(phases):
            if step <= end or i == len(phases) - 1:
                p = (step - start) / (end - start)
                out.append((annealed(lr0, lr1, p), annealed(m0, m1, p)))
                break
            start = end
    return out


@pytest.mark.parametrize("total, pct, three_phase, anneal", [
    (20, 0.3, False, "cos"), (20, 0.3, True, "linear"), (37, 0.25, True, "cos"),
    (11, 0.45, False, "linear")])
def test_rates_and_momenta_are_torchs(total, pct, three_phase, anneal):
    s = sched.OneCycleLR.with_torch_defaults(0.4, total, pct_start=pct, three_phase=three_phase,
                                             anneal_strategy=anneal)
    want = torch_one_cycle(total, anneal, max_lr=0.4, pct=pct, three_phase=three_phase)
    for t, (lr, m) in enumerate(want):
        assert s.value(t) == pytest.approx(lr, rel=1e-15, abs=1e-18)
        assert s.momentum(t) == pytest.approx(m, rel=1e-15)


def test_div_and_final_div_factor_are_pytorchs_names():
    a = sched.OneCycleLR(0.1, 10, div_factor=5.0, final_div_factor=100.0)
    assert a.divide_factor == 5.0 and a.end_learning_rate == pytest.approx(0.1 / 5 / 100)
    b = sched.OneCycleLR(0.1, 10, 5.0, 0.1 / 5 / 100)
    assert [a.value(t) for t in range(10)] == [b.value(t) for t in range(10)]
    today = sched.OneCycleLR(0.1, 10)           # today's arguments and defaults stand
    assert today.end_learning_rate == 1e-4 and not today.cycle_momentum
    assert today.divide_factor == 25.0 and not today.three_phase


def train(opt, steps, seed=0):
    """A 4 -> 3 fc net trained `steps` steps on X with loss mean(y * y); returns the
    net, and the (learning rate, cycled momentum) of each step."""
    net = mg.Net(seed=seed)
    x = layers.data(net, "x", shape=(-1, 4), dtype="float64")
    y = layers.fc(net, x, 3, name="fc")
    loss = layers.mean(net, layers.multiply(net, y, y))
    opt.minimize(net, loss)
    start = {v: net.var(v).get().copy() for v in ("fc.w", "fc.b")}
    seen = []
    for _ in range(steps):
        net.train(feed={"x": X})
        seen.append((opt.learning_rate, opt.cycled_momentum))
    return net, start, seen


def grads(w, b):
    y = X @ w + b
    dy = 2 * y / y.size
    return X.T @ dy, dy.sum(axis=0)


def torch_sgd(start, hyper, nesterov):
    """torch.optim.SGD's loop (momentum buffer initialised to the first gradient)."""
    params = [start["fc.w"].copy(), start["fc.b"].copy()]
    bufs = [None, None]
    for lr, mu in hyper:
        for i, g in enumerate(grads(*params)):
            bufs[i] = g.copy() if bufs[i] is None else mu * bufs[i] + g
            params[i] = params[i] - lr * (g + mu * bufs[i] if nesterov else bufs[i])
    return params


def torch_adam(start, hyper, wd=0.0, decoupled=False, beta2=0.999, eps=1e-8):
    """torch.optim.Adam / AdamW's single-tensor loop with the current beta1 each step."""
    params = [start["fc.w"].copy(), start["fc.b"].copy()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for step, (lr, beta1) in enumerate(hyper, 1):
        for i, g in enumerate(grads(*params)):
            if decoupled:
                params[i] = params[i] * (1 - lr * wd)
            elif wd:
                g = g + wd * params[i]
            m[i] = m[i] + (1 - beta1) * (g - m[i])
            v[i] = v[i] * beta2 + (1 - beta2) * g * g
            denom = np.sqrt(v[i]) / math.sqrt(1 - beta2 ** step) + eps
            params[i] = params[i] - lr / (1 - beta1 ** step) * m[i] / denom
    return params


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_follows_the_cycle_as_torch_sgd(nesterov):
    total = 12
    s = sched.OneCycleLR.with_torch_defaults(0.2, total, three_phase=nesterov)
    net, start, seen = train(mg.optimizer.Momentum(s, momentum=0.5, nesterov=nesterov), total)
    want = torch_one_cycle(total, max_lr=0.2, three_phase=nesterov)
    np.testing.assert_allclose(seen, want, rtol=1e-15)
    w, b = torch_sgd(start, want, nesterov)
    np.testing.assert_allclose(net.var("fc.w").get(), w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(net.var("fc.b").get(), b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_beta1_follows_the_cycle_with_torchs_bias_correction(kind):
    total = 10
    s = sched.OneCycleLR(0.05, total, final_div_factor=1e4, cycle_momentum=True,
                         base_momentum=0.8, max_momentum=0.9, anneal_strategy="linear")
    opt = getattr(mg.optimizer, kind)(s, beta1=0.3, weight_decay=0.05)
    net, start, seen = train(opt, total)
    want = torch_one_cycle(total, "linear", max_lr=0.05, base_m=0.8, max_m=0.9)
    np.testing.assert_allclose(seen, want, rtol=1e-15)
    w, b = torch_adam(start, want, wd=0.05, decoupled=kind == "AdamW")
    np.testing.assert_allclose(net.var("fc.w").get(), w, rtol=1e-11, atol=1e-14)
    np.testing.assert_allclose(net.var("fc.b").get(), b, rtol=1e-11, atol=1e-14)


def test_the_cycled_momentum_is_a_persistable_that_checkpoints_resume(tmp_path):
    def opt():
        return mg.optimizer.Adam(sched.OneCycleLR.with_torch_defaults(0.05, 8))

    net, _, seen = train(opt(), 8)
    assert "adam_0.learning_rate.momentum" in [v.name for v in net.persistables()]
    half, _, _ = train(opt(), 4)
    mg.io.save(half, tmp_path / "half.npz")
    resumed_opt = opt()
    resumed, _, _ = train(resumed_opt, 0)
    mg.io.load(resumed, tmp_path / "half.npz")
    assert resumed_opt.cycled_momentum == seen[3][1]
    for _ in range(4):
        resumed.train(feed={"x": X})
    np.testing.assert_array_equal(resumed.var("fc.w").get(), net.var("fc.w").get())


def test_without_cycling_the_optimizer_keeps_its_momentum():
    opt = mg.optimizer.Momentum(sched.OneCycleLR(0.1, 10), momentum=0.6)
    net, _, seen = train(opt, 3)
    assert opt.cycled_momentum is None and opt.momentum_var is None
    assert all(m is None for _, m in seen)


@pytest.mark.parametrize("make, error, message", [
    (lambda: mg.optimizer.SGD(sched.OneCycleLR(0.1, 10, cycle_momentum=True)), ValueError,
     r"SGD: OneCycleLR\(cycle_momentum=True\) needs an optimizer with a momentum"),
    (lambda: sched.LinearWarmup(sched.OneCycleLR(0.1, 10, cycle_momentum=True), 2, 0, 0.1),
     ValueError, "LinearWarmup: a OneCycleLR that cycles the momentum cannot follow"),
    (lambda: sched.OneCycleLR(0.1, 10, 5.0, div_factor=4.0), ValueError,
     "divide_factor .* and div_factor .* are one setting"),
    (lambda: sched.OneCycleLR(0.1, 10, end_learning_rate=1e-5, final_div_factor=10.0),
     ValueError, "end_learning_rate and final_div_factor both set the end rate"),
    (lambda: sched.OneCycleLR(0.1, 10, final_div_factor=0.0), ValueError,
     "OneCycleLR: final_div_factor"),
    (lambda: sched.OneCycleLR(0.1, 10, anneal_strategy="cosine"), ValueError,
     "anneal_strategy must be 'cos' or 'linear'"),
    (lambda: sched.OneCycleLR(0.1, 10, three_phase=1), TypeError,
     "three_phase must be True or False"),
    (lambda: sched.OneCycleLR(0.1, 10, cycle_momentum=True, max_momentum=1.0), ValueError,
     "OneCycleLR: max_momentum"),
    (lambda: sched.OneCycleLR(0.1, 10, phase_pct=0.55, three_phase=True), ValueError,
     "the three phases have a step"),
])
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make()
