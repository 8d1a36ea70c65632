"""Optimisers on a net, step for step against float64 numpy implementations of the
published (PyTorch) update rules: SGD and Momentum with weight decay, Adam, AdamW,
global-norm clipping and the schedules."""
import math

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers
from minigraph.optimizer import lr as sched

rng = np.random.default_rng(0)
X = rng.standard_normal((6, 4))
Y = rng.integers(0, 3, 6)


def _net(opt=None, seed=0):
    """x (N, 4) float64 -> fc 5 -> relu -> fc 3 -> mean softmax cross entropy."""
    net = mg.Net(seed=seed)
    x = layers.data(net, "x", shape=(-1, 4), dtype="float64")
    y = layers.data(net, "y", shape=(-1,), dtype="int64")
    h = layers.relu(net, layers.fc(net, x, size=5, name="fc1"))
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, layers.fc(net, h, 3,
                                                                             name="fc2"), y))
    if opt is not None:
        opt.minimize(net, loss)
    else:
        mg.append_backward(net, loss)
    return net, loss


def trajectory(opt, reference, steps=6, xs=None):
    """Train `opt` for `steps`; alongside, a twin net without updates gives the raw
    gradients at the reference's parameters, and `reference(params, grads, t)` updates
    them. Returns the largest relative difference over all steps and parameters."""
    net, _ = _net(opt)
    twin, _ = _net()
    params = {p.name: p.get().copy() for p in net.parameters()}
    worst = 0.0
    for t in range(steps):
        feed = {"x": X if xs is None else xs[t], "y": Y}
        for name, value in params.items():
            twin.var(name).set(value)
        grads = dict(zip(params, twin.train(feed=feed, fetch=[twin.grad(n) for n in params])))
        net.train(feed=feed)
        params = reference(params, grads, t)
        for name, value in params.items():
            got = net.var(name).get()
            worst = max(worst, float(np.max(np.abs(got - value) / (np.abs(value) + 1e-12))))
    return worst


def sgd_rule(lr, wd=0.0, momentum=0.0, nesterov=False, clip=None, lr_of=None):
    bufs = {}

    def step(params, grads, t):
        rate = lr_of(t) if lr_of else lr
        grads = clipped(grads, clip)
        out = {}
        for n, p in params.items():
            d = grads[n] + wd * p
            if momentum:
                bufs[n] = d if n not in bufs else momentum * bufs[n] + d
                d = d + momentum * bufs[n] if nesterov else bufs[n]
            out[n] = p - rate * d
        return out
    return step


def adam_rule(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False, clip=None):
    m, v = {}, {}

    def step(params, grads, t):
        grads = clipped(grads, clip)
        out = {}
        for n, p in params.items():
            g = grads[n]
            if decoupled:
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
            m[n] = b1 * m.get(n, 0) + (1 - b1) * g
            v[n] = b2 * v.get(n, 0) + (1 - b2) * g * g
            bc1, bc2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)
            out[n] = p - lr / bc1 * m[n] / (np.sqrt(v[n]) / math.sqrt(bc2) + eps)
        return out
    return step


def clipped(grads, max_norm):
    if max_norm is None:
        return grads
    total = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return {n: g * coef for n, g in grads.items()}


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_sgd(wd):
    assert trajectory(mg.optimizer.SGD(0.5, weight_decay=wd), sgd_rule(0.5, wd)) < 1e-12


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum(nesterov):
    opt = mg.optimizer.Momentum(0.1, 0.9, nesterov=nesterov, weight_decay=0.01)
    assert trajectory(opt, sgd_rule(0.1, 0.01, 0.9, nesterov)) < 1e-12


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam(wd):
    opt = mg.optimizer.Adam(0.01, beta1=0.8, beta2=0.99, weight_decay=wd)
    assert trajectory(opt, adam_rule(0.01, 0.8, 0.99, wd=wd), steps=8) < 1e-10


def test_adamw_decouples_weight_decay():
    opt = mg.optimizer.AdamW(0.01, weight_decay=0.1)
    assert trajectory(opt, adam_rule(0.01, wd=0.1, decoupled=True), steps=8) < 1e-10
    assert mg.optimizer.AdamW().weight_decay == 0.01 and mg.optimizer.Adam().weight_decay == 0


def test_clipping_scales_raw_gradients_before_weight_decay():
    clip = mg.optimizer.ClipGradByGlobalNorm(0.05)
    opt = mg.optimizer.Momentum(0.1, 0.9, weight_decay=0.2, grad_clip=clip)
    assert trajectory(opt, sgd_rule(0.1, 0.2, 0.9, clip=0.05)) < 1e-12
    opt = mg.optimizer.AdamW(0.01, weight_decay=0.1, grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.05))
    assert trajectory(opt, adam_rule(0.01, wd=0.1, decoupled=True, clip=0.05)) < 1e-10


def test_schedules_advance_once_per_step():
    step_lr = sched.StepDecay(0.5, step_size=2, gamma=0.5)
    assert trajectory(mg.optimizer.SGD(step_lr), sgd_rule(
        0, lr_of=lambda t: 0.5 * 0.5 ** (t // 2)), steps=7) < 1e-12
    cos = sched.CosineDecay(0.3, total_steps=5, end_lr=0.01, warmup_steps=2)

    def cos_lr(t):
        return 0.3 * (t + 1) / 2 if t < 2 else 0.01 + 0.29 * (1 + math.cos(math.pi * (t - 2) / 3)) / 2
    assert trajectory(mg.optimizer.Momentum(cos, 0.5), sgd_rule(0, momentum=0.5, lr_of=cos_lr),
                      steps=7) < 1e-12


def test_a_checkpoint_resumes_the_schedule_and_the_state(tmp_path):
    def build():
        return _net(mg.optimizer.AdamW(sched.CosineDecay(0.05, total_steps=10, warmup_steps=3)))

    full, _ = build()
    for _ in range(6):
        full.train(feed={"x": X, "y": Y})
    first, _ = build()
    for _ in range(3):
        first.train(feed={"x": X, "y": Y})
    mg.io.save(first, tmp_path / "ckpt.npz")
    resumed, _ = build()
    mg.io.load(resumed, tmp_path / "ckpt.npz")
    assert int(resumed.optimizer.step_var.get()) == 3
    for _ in range(3):
        resumed.train(feed={"x": X, "y": Y})
    for p in full.persistables():
        np.testing.assert_array_equal(resumed.var(p.name).get(), p.get(), err_msg=p.name)
    assert resumed.optimizer.learning_rate == full.optimizer.learning_rate


def test_learning_rate_reads_the_current_value():
    opt = mg.optimizer.SGD(sched.StepDecay(1.0, step_size=1, gamma=0.5))
    assert opt.learning_rate == 1.0
    net, _ = _net(opt)
    net.train(feed={"x": X, "y": Y})
    net.train(feed={"x": X, "y": Y})
    assert opt.learning_rate == 0.5                     # the rate the last step used
    with pytest.raises(ValueError, match="follows a schedule"):
        opt.set_learning_rate(0.1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5, -1e-9, "0.1", None, True,
                                 np.array([0.1, 0.2])])
def test_bad_learning_rates_are_value_errors_everywhere(bad):
    for make in (mg.optimizer.SGD, mg.optimizer.Momentum, mg.optimizer.Adam, mg.optimizer.AdamW,
                 lambda v: sched.StepDecay(v, 2), lambda v: sched.CosineDecay(v, 10)):
        with pytest.raises(ValueError, match="learning_rate must be"):
            make(bad)
    opt = mg.optimizer.SGD(0.5)
    net, _ = _net(opt)
    w = net.var("fc1.w").get().copy()
    with pytest.raises(ValueError, match="set_learning_rate: learning_rate must be"):
        opt.set_learning_rate(bad)
    assert opt.learning_rate == 0.5
    net.train(feed={"x": X, "y": Y})
    assert np.isfinite(net.var("fc1.w").get()).all() and not np.array_equal(
        net.var("fc1.w").get(), w)


def test_zero_learning_rate_is_allowed_and_changes_nothing():
    opt = mg.optimizer.SGD(learning_rate=0)
    net, _ = _net(opt)
    before = {p.name: p.get().copy() for p in net.parameters()}
    net.train(feed={"x": X, "y": Y})
    for name, value in before.items():
        np.testing.assert_array_equal(net.var(name).get(), value)
    opt.set_learning_rate(0.25)
    assert opt.learning_rate == 0.25
    with pytest.raises(ValueError, match="call minimize"):
        mg.optimizer.SGD(0.1).set_learning_rate(0.1)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match=r"Momentum: momentum must be a finite number in \[0, 1\]"):
        mg.optimizer.Momentum(0.1, momentum=1.5)
    with pytest.raises(ValueError, match="weight_decay must be"):
        mg.optimizer.SGD(0.1, weight_decay=-1)
    with pytest.raises(ValueError, match=r"beta2 must be a finite number in \[0, 1\)"):
        mg.optimizer.Adam(beta2=1.0)
    with pytest.raises(ValueError, match="epsilon must be"):
        mg.optimizer.Adam(epsilon=0)
    with pytest.raises(ValueError, match="max_norm must be"):
        mg.optimizer.ClipGradByGlobalNorm(0)
    with pytest.raises(TypeError, match="grad_clip must be a ClipGradByGlobalNorm"):
        mg.optimizer.SGD(0.1, grad_clip=1.0)
    with pytest.raises(ValueError, match="step_size must be an int >= 1"):
        sched.StepDecay(0.1, 0)
    with pytest.raises(ValueError, match="warmup_steps \\(10\\) must be smaller than total_steps"):
        sched.CosineDecay(0.1, 10, warmup_steps=10)
    opt = mg.optimizer.SGD(0.1)
    _net(opt)
    with pytest.raises(ValueError, match="already minimises a net"):
        _net(opt)


def test_update_section_order():
    clip = mg.optimizer.ClipGradByGlobalNorm(1.0)
    net, _ = _net(mg.optimizer.Adam(sched.StepDecay(0.1, 5), grad_clip=clip))
    types = [op.type for op in net.section("update")]
    assert types == ["lr_schedule", "clip_by_global_norm"] + ["adam"] * 4
    names = {v.name for v in net.persistables()}
    assert {"adam_0.fc1.w.moment1", "adam_0.fc1.w.moment2", "adam_0.fc1.w.beta1_pow",
            "adam_0.learning_rate", "adam_0.learning_rate.step"} <= names


# ---- arguments that used to be misread -------------------------------------------------

@pytest.mark.parametrize("nesterov", ["no", 0, 1, None, "False"])
def test_nesterov_must_be_a_bool(nesterov):
    """Momentum(nesterov='no') turned Nesterov on."""
    with pytest.raises(TypeError, match="Momentum: nesterov must be True or False"):
        mg.optimizer.Momentum(0.1, nesterov=nesterov)


def _unminimised(seed=0):
    net = mg.Net(seed=seed)
    x = layers.data(net, "x", shape=(-1, 4), dtype="float64")
    y = layers.data(net, "y", shape=(-1,), dtype="int64")
    logits = layers.fc(net, x, size=3, name="fc1")
    return net, layers.mean(net, layers.softmax_with_cross_entropy(net, logits, y))


def test_minimize_checks_the_net_and_the_loss():
    """minimize(net, 3.0) and minimize("net", loss) raised AttributeErrors."""
    net, loss = _unminimised()
    other, other_loss = _unminimised()
    for opt in (mg.optimizer.SGD(0.1), mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 2)):
        with pytest.raises(TypeError, match=r"minimize: loss must be a Variable .* got float"):
            opt.minimize(net, 3.0)
        with pytest.raises(TypeError, match="minimize: net must be a minigraph Net, got str"):
            opt.minimize("net", loss)
        with pytest.raises(ValueError, match="minimize: the loss 'mean.* belongs to another net"):
            opt.minimize(net, other_loss)
    assert net.optimizer is None and net.loss is None
    mg.optimizer.SGD(0.1).minimize(net, loss)                  # and it still works


def test_an_infer_only_net_cannot_be_minimised():
    net, loss = _unminimised()
    folded = mg.passes.fold_batch_norm(net, fetches=[loss])     # one that computes a loss
    with pytest.raises(ValueError, match="infer-only"):
        mg.optimizer.SGD(0.1).minimize(folded, folded.var(loss.name))
