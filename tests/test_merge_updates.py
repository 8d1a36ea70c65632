"""passes.merge_updates: a net whose momentum updates are merged trains as the net with
one momentum op per parameter does (groups, schedules, a cycled momentum, clipping,
GradientMerge), fails all or nothing, freezes, and saves and loads the same state."""
import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L
from minigraph.examples.train_digits import build_net
from minigraph.schema import Meta, OpSchema, Slot, kernel, register
from minigraph.validators import bool_attr

rng = np.random.default_rng(11)
FEEDS = [{"image": rng.standard_normal((16, 1, 8, 8)).astype(np.float32),
          "label": rng.integers(0, 10, 16)} for _ in range(3)]

register(OpSchema(type="test_merge_fail_if", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  attrs=(bool_attr("armed", False),),
                  infer=lambda ins, attrs: {"out": Meta(ins["x"].shape, ins["x"].dtype)}))
ARMED = {"on": False}


@kernel("test_merge_fail_if", "cpu")
def _fail_if(op, ins, ctx):
    if ARMED["on"]:
        raise RuntimeError("test_merge_fail_if: armed")
    return {"out": ins["x"]}


def values(net):
    return {v.name: v.get().copy() for v in net.persistables()}


def train(net, steps=4):
    return [float(net.train(feed=FEEDS[k % len(FEEDS)], fetch=[net.loss])[0])
            for k in range(steps)]


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=rtol, atol=atol, err_msg=name)


def update_types(net):
    return [op.type for op in net.section("update")]


def test_the_digits_net_trains_as_with_one_op_per_parameter():
    plain, _ = build_net(seed=3)
    merged, _ = build_net(seed=3)
    notes = mg.passes.merge_updates(merged)
    assert update_types(merged) == ["merged_momentum"]
    assert update_types(plain) == ["momentum"] * 10
    (note,) = notes
    assert note.params == tuple(op.inputs["param"].name for op in plain.section("update"))
    assert str(note).startswith("10 momentum ops -> merged_momentum (conv1.w, conv1.b")
    assert merged.reports["merge_updates"] == notes
    np.testing.assert_allclose(train(merged), train(plain), rtol=1e-6)
    assert_close(values(merged), values(plain))
    with pytest.raises(ValueError, match="merge_updates: already applied"):
        mg.passes.merge_updates(merged)


def group_net(optimizer, groups=True, seed=0):
    net = mg.Net(seed=seed)
    x = L.data(net, "image", shape=(-1, 1, 8, 8))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.relu(net, L.batch_norm(net, L.conv2d(net, x, 4, 3, padding=1, name="c1"), name="bn"))
    h = L.relu(net, L.fc(net, h, 12, name="f1"))
    logits = L.fc(net, h, 10, name="f2")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    params = net.parameters()
    if groups:
        params = [{"params": [p for p in params if len(p.shape) >= 2]},
                  {"params": [p for p in params if len(p.shape) < 2], "weight_decay": 0.0,
                   "learning_rate": 0.5}]
    optimizer.minimize(net, loss, parameters=params)
    return net


OPTIMIZERS = {
    "groups": lambda: mg.optimizer.Momentum(0.1, 0.9, nesterov=True, weight_decay=0.01),
    "schedule-clip": lambda: mg.optimizer.Momentum(
        mg.optimizer.lr.StepDecay(0.2, 2, 0.5), 0.8,
        grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.5)),
    "cycled-momentum": lambda: mg.optimizer.Momentum(
        mg.optimizer.lr.OneCycleLR(0.3, 10, cycle_momentum=True)),
    "gradient-merge": lambda: mg.optimizer.GradientMerge(
        mg.optimizer.Momentum(0.1, weight_decay=0.01), 2),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_every_kind_of_update_section_trains_the_same_merged(make):
    plain, merged = group_net(make()), group_net(make())
    notes = mg.passes.merge_updates(merged)
    # two parameter groups (another weight decay, another rate): two merged ops
    assert [len(n.params) for n in notes] == [3, 5]
    assert update_types(merged).count("merged_momentum") == 2
    assert "momentum" not in update_types(merged)
    assert [t for t in update_types(merged) if t != "merged_momentum"] == \
        [t for t in update_types(plain) if t != "momentum"]        # the rest in order
    np.testing.assert_allclose(train(merged, 6), train(plain, 6), rtol=1e-5)
    assert_close(values(merged), values(plain))


def test_updates_move_up_only_past_ops_that_do_not_touch_them():
    net = group_net(mg.optimizer.Momentum(0.1), groups=False)
    updates = net.section("update")
    grad = updates[2].inputs["grad"]
    net.insert_op("update", 2, mg.Operator("scale", x=grad, out=grad, scale=2.0))
    notes = mg.passes.merge_updates(net)
    # the third update reads what the scale writes: it starts a second group there
    assert [len(n.params) for n in notes] == [2, 6]
    assert update_types(net) == ["merged_momentum", "scale", "merged_momentum"]


def test_a_failing_op_after_the_merged_update_puts_every_value_back():
    net = group_net(mg.optimizer.Momentum(0.1, 0.9))
    mg.passes.merge_updates(net)
    first = next(op for op in net.section("update") if op.type == "merged_momentum")
    grad = first.inputs["grad"][0]
    net.append_op(mg.Operator("test_merge_fail_if", x=grad, out=grad, armed=True), "update")
    train(net, 2)
    before = values(net)
    arrays = {v.name: v.value for v in net.persistables()}
    ARMED["on"] = True
    try:
        with pytest.raises(RuntimeError, match="armed"):
            net.train(feed=FEEDS[2])
    finally:
        ARMED["on"] = False
    after = values(net)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert all(v.value is arrays[v.name] for v in net.persistables())
    train(net, 1)                                   # and it trains on
    assert not np.array_equal(net.var("f1.w").get(), before["f1.w"])


def test_a_frozen_parameter_leaves_the_merged_update_and_keeps_its_velocity():
    plain, merged = (group_net(mg.optimizer.Momentum(0.1, 0.9)) for _ in range(2))
    mg.passes.merge_updates(merged)
    for net in (plain, merged):
        train(net, 2)
        net.var("f1.w").trainable = False
        net.var("bn.scale").trainable = False
    before = values(merged)
    np.testing.assert_allclose(train(merged, 3), train(plain, 3), rtol=1e-5)
    after = values(merged)
    for name in ("f1.w", "bn.scale", "momentum_0.f1.w.velocity", "momentum_0.bn.scale.velocity"):
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert not np.array_equal(after["f2.w"], before["f2.w"])
    assert_close(after, values(plain))
    merged.var("f1.w").trainable = True
    train(merged, 1)
    assert not np.array_equal(merged.var("f1.w").get(), before["f1.w"])
    assert update_types(merged).count("merged_momentum") == 2   # the net itself unchanged


def test_a_checkpoint_moves_between_merged_and_per_parameter_nets(tmp_path):
    merged = group_net(mg.optimizer.Momentum(0.1, 0.9), seed=1)
    mg.passes.merge_updates(merged)
    train(merged, 3)
    path = mg.io.save(merged, tmp_path / "ck.npz")
    plain = group_net(mg.optimizer.Momentum(0.1, 0.9), seed=2)
    mg.io.load(plain, path)
    assert_close(values(plain), values(merged), rtol=0, atol=0)
    np.testing.assert_allclose(train(plain, 2), train(merged, 2), rtol=1e-5)


def test_nets_without_mergeable_updates_and_nets_not_minimised():
    net = group_net(mg.optimizer.Adam(0.01))
    assert mg.passes.merge_updates(net) == []
    assert "merged_momentum" not in update_types(net)
    bare = mg.Net()
    L.fc(bare, L.data(bare, "x", shape=(-1, 3)), size=2)
    with pytest.raises(ValueError, match="merge_updates: .*minimize"):
        mg.passes.merge_updates(bare)
    with pytest.raises(TypeError, match="merge_updates: net must be a minigraph Net"):
        mg.passes.merge_updates("net")
