"""`var.trainable = False` after minimize() (minigraph.net_freeze): the parameter stops
changing (no update, no weight decay, no momentum), its optimizer state stays, its
gradient leaves global-norm clipping; True brings it back; a parameter frozen at
minimize() cannot be thawed."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)
FEED = {"x": rng.standard_normal((8, 5)).astype(np.float32), "y": rng.integers(0, 3, 8)}


def build(opt, seed=0, frozen_head=False):
    """x (8, 5) -> fc body (6) -> relu -> fc head (3) -> cross entropy, minimised by opt."""
    net = mg.Net(seed=seed)
    x = L.data(net, "x", shape=(-1, 5))
    y = L.data(net, "y", shape=(-1,), dtype="int64")
    h = L.relu(net, L.fc(net, x, 6, name="body"))
    head = mg.ParamAttr(trainable=False) if frozen_head else None
    logits = L.fc(net, h, 3, name="head", param_attr=head)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, y))
    opt.minimize(net, loss)
    return net, loss


def values(net):
    return {v.name: v.get() for v in net.persistables()}


@pytest.mark.parametrize("make", [
    lambda: mg.optimizer.SGD(0.1, weight_decay=0.1),
    lambda: mg.optimizer.Momentum(0.1, momentum=0.9, weight_decay=0.1),
    lambda: mg.optimizer.Adam(0.01, weight_decay=0.1),
    lambda: mg.optimizer.AdamW(0.01, weight_decay=0.5),
    lambda: mg.optimizer.GradientMerge(mg.optimizer.Momentum(0.1, weight_decay=0.1), 2),
], ids=["sgd", "momentum", "adam", "adamw", "gradient-merge"])
def test_a_parameter_frozen_after_minimize_stops_changing(make):
    net, loss = build(make())
    for _ in range(2):
        net.train(feed=FEED)            # momentum and moments are non-zero now
    w = net.var("head.w")
    w.trainable = False
    before = values(net)
    state = [n for n in before if n.endswith("head.w.velocity") or "head.w.moment" in n]
    for _ in range(4):
        net.train(feed=FEED)
    after = values(net)
    assert np.array_equal(after["head.w"], before["head.w"])
    for name in state:                  # its optimizer state stays as it was
        assert np.array_equal(after[name], before[name]), name
    for name in ("head.b", "body.w", "body.b"):
        assert not np.array_equal(after[name], before[name]), name
    assert w not in net.parameters() and "head.w" not in [p.name for p in net.parameters()]
    assert net.grad(w).get().shape == (6, 3)    # the gradient is still computed
    w.trainable = True                          # and it trains again
    net.train(feed=FEED)
    net.train(feed=FEED)
    assert not np.array_equal(net.var("head.w").get(), before["head.w"])


def test_summary_and_parameters_agree_with_the_flag():
    net, _ = build(mg.optimizer.SGD(0.1))
    total = sum(p.get().size for p in net.parameters())
    net.var("body.w").trainable = False
    assert f"trainable parameters:     {total - 30:,}" in net.summary()
    assert net.var("body.w") not in net.parameters()


def test_clipping_leaves_a_frozen_gradient_out_as_a_net_built_frozen_does():
    """clip_grad_norm_ skips a parameter without .grad: the other updates are those of
    a net whose head was frozen when it was built."""
    def opt():
        return mg.optimizer.Momentum(0.5, grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.01))

    later, _ = build(opt())
    built, _ = build(opt(), frozen_head=True)       # head.w frozen when built
    later.var("head.w").trainable = False
    for _ in range(3):
        later.train(feed=FEED)
        built.train(feed=FEED)
    for name in ("body.w", "body.b", "head.b"):
        assert later.var(name).get().tobytes() == built.var(name).get().tobytes(), name
    (clip,) = [op for op in later.plan("train", [], True, (id(later.var("head.w")),)).ops
               if op.type == "clip_by_global_norm"]
    assert [v.name for v in clip.inputs["x"]] == ["body.w@GRAD", "body.b@GRAD", "head.b@GRAD"]
    assert len(later.section("update")[0].inputs["x"]) == 4     # the net itself is unchanged


def test_freezing_every_parameter_drops_the_clip_and_changes_nothing():
    net, _ = build(mg.optimizer.SGD(0.5, grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.1)))
    for p in net.parameters():
        p.trainable = False
    before = values(net)
    net.train(feed=FEED)
    after = values(net)
    assert all(np.array_equal(after[n], before[n]) for n in before if n != "sgd_0.learning_rate")


def test_thawing_a_parameter_frozen_at_minimize_is_refused_at_the_next_step():
    net, _ = build(mg.optimizer.SGD(0.1), frozen_head=True)
    net.train(feed=FEED)
    net.var("head.w").trainable = True
    before = values(net)
    with pytest.raises(ValueError, match="'head.w' was made trainable after minimize\\(\\), "
                                         "which built no gradient or update for it"):
        net.train(feed=FEED)
    after = values(net)
    assert all(np.array_equal(after[n], before[n]) for n in before)
    net.var("head.w").trainable = False
    net.train(feed=FEED)
