"""GradientMerge: k micro-batch steps train exactly like one step on their union (the
mean loss), the inner schedule advances once per update, nothing moves between
updates, a checkpoint taken mid-accumulation resumes bit for bit, a failed step
changes nothing, and bad arguments are named."""
import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)
X = rng.standard_normal((12, 4))
Y = rng.integers(0, 3, 12)


def build(opt, seed=0, parameters=None):
    net = mg.Net(seed=seed)
    x = L.data(net, "x", (-1, 4), "float64")
    y = L.data(net, "y", (-1,), "int64")
    h = L.tanh(net, L.fc(net, x, 6, name="fc1"))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, h, 3, name="fc2"), y))
    opt.minimize(net, loss, parameters=parameters(net) if parameters else None)
    return net, loss


def params(net):
    return {p.name: p.get().copy() for p in net.parameters()}


def feeds(rows, k):
    """k micro-batches that split each batch of `rows`."""
    out = []
    for start in range(0, len(X), rows):
        xs, ys = X[start:start + rows], Y[start:start + rows]
        out += [{"x": a, "y": b} for a, b in zip(np.array_split(xs, k), np.array_split(ys, k))]
    return out


@pytest.mark.parametrize("make", [
    lambda: mg.optimizer.SGD(0.3, weight_decay=0.01),
    lambda: mg.optimizer.Momentum(0.1, 0.9, nesterov=True),
    lambda: mg.optimizer.AdamW(mg.optimizer.lr.OneCycleLR(0.05, 4), weight_decay=0.1,
                               grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.5)),
], ids=["sgd", "momentum", "adamw-onecycle-clip"])
@pytest.mark.parametrize("k", [2, 3])
def test_k_micro_batches_train_like_one_big_batch(make, k):
    whole, _ = build(make())
    merged, _ = build(mg.optimizer.GradientMerge(make(), k))
    for feed in feeds(6, 1):
        whole.train(feed=feed)
    for feed in feeds(6, k):
        merged.train(feed=feed)
    for name, value in params(whole).items():
        np.testing.assert_allclose(merged.var(name).get(), value, rtol=1e-12, atol=1e-14,
                                   err_msg=name)
    assert merged.optimizer.inner.learning_rate == whole.optimizer.learning_rate


def test_nothing_moves_between_updates_and_the_sums_restart_from_zero():
    opt = mg.optimizer.GradientMerge(mg.optimizer.SGD(mg.optimizer.lr.StepDecay(0.5, 1, 0.5)), 3)
    net, loss = build(opt)
    start = params(net)
    micro = feeds(6, 3)
    for i, feed in enumerate(micro[:2]):
        net.train(feed=feed)
        for name, value in start.items():
            np.testing.assert_array_equal(net.var(name).get(), value)
        assert int(opt.counter.get()) == i + 1
        assert int(opt.inner.step_var.get()) == 0           # the schedule waits
    assert np.any(net.var("gradient_merge_0.fc1.w.merged_grad").get() != 0)
    net.train(feed=micro[2])
    assert int(opt.inner.step_var.get()) == 1 and opt.learning_rate == 0.5
    for name in start:
        np.testing.assert_array_equal(net.var(f"gradient_merge_0.{name}.merged_grad").get(), 0)
        assert not np.array_equal(net.var(name).get(), start[name])


def test_avg_false_sums_the_gradients():
    summed, _ = build(mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 2, avg=False))
    twice, _ = build(mg.optimizer.SGD(0.2))
    for feed in feeds(6, 2):
        summed.train(feed=feed)
    for feed in feeds(6, 1):
        twice.train(feed=feed)
    for name, value in params(twice).items():
        np.testing.assert_allclose(summed.var(name).get(), value, rtol=1e-12, err_msg=name)


def test_groups_work_under_gradient_merge():
    def groups(net):
        return [{"params": [net.var("fc1.w"), net.var("fc1.b")], "learning_rate": 0.0},
                {"params": [net.var("fc2.w"), net.var("fc2.b")]}]
    net, _ = build(mg.optimizer.GradientMerge(mg.optimizer.Adam(0.1), 2), parameters=groups)
    start = params(net)
    for feed in feeds(6, 2):
        net.train(feed=feed)
    np.testing.assert_array_equal(net.var("fc1.w").get(), start["fc1.w"])
    assert not np.array_equal(net.var("fc2.w").get(), start["fc2.w"])


def test_a_checkpoint_mid_accumulation_resumes_bitwise(tmp_path):
    def make():
        return mg.optimizer.GradientMerge(
            mg.optimizer.Adam(mg.optimizer.lr.ExponentialDecay(0.05, 0.9)), 3)
    micro = feeds(6, 3)
    full, _ = build(make())
    for feed in micro:
        full.train(feed=feed)
    first, _ = build(make())
    for feed in micro[:4]:
        first.train(feed=feed)
    mg.io.save(first, tmp_path / "m.npz")
    resumed, _ = build(make())
    mg.io.load(resumed, tmp_path / "m.npz")
    assert int(resumed.optimizer.counter.get()) == 4
    for feed in micro[4:]:
        resumed.train(feed=feed)
    for p in full.persistables():
        np.testing.assert_array_equal(resumed.var(p.name).get(), p.get(), err_msg=p.name)


def test_a_failed_step_changes_nothing():
    opt = mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 2)
    net, _ = build(opt)
    net.train(feed=feeds(6, 2)[0])
    before = {p.name: p.get().copy() for p in net.persistables()}
    bad = {"x": X[:3], "y": np.array([0, 7, 1])}
    with pytest.raises(mg.OpError, match="label"):
        net.train(feed=bad)
    for name, value in before.items():
        np.testing.assert_array_equal(net.var(name).get(), value, err_msg=name)


def test_the_update_section_and_its_order():
    net, _ = build(mg.optimizer.GradientMerge(mg.optimizer.SGD(
        mg.optimizer.lr.StepDecay(0.1, 2)), 2))
    backward = [op.type for op in net.section("backward")]
    assert backward[-4:] == ["add_inplace"] * 4
    assert [op.type for op in net.section("update")] == \
        ["scale"] * 4 + ["lr_schedule"] + ["sgd"] * 4 + ["fill_inplace"] * 4


@pytest.mark.parametrize("args, error, message", [
    ((0.1, 2), TypeError, "GradientMerge: inner must be an optimizer"),
    ((None, 0), ValueError, "GradientMerge: k_steps must be an int >= 1, got 0"),
    ((None, 2.0), ValueError, "k_steps must be an int >= 1, got 2.0"),
])
def test_bad_arguments(args, error, message):
    inner = mg.optimizer.SGD(0.1) if args[0] is None else args[0]
    with pytest.raises(error, match=message):
        mg.optimizer.GradientMerge(inner, args[1])
    with pytest.raises(TypeError, match="avg must be True or False"):
        mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 2, avg=1)


def test_one_gradient_merge_per_net():
    opt = mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 2)
    build(opt)
    with pytest.raises(ValueError, match="GradientMerge.minimize: this optimizer already "
                                         "minimises a net"):
        build(opt)
