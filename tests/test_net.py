import hashlib

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers


def _digits_like(seed=0, n=32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 1, 8, 8)).astype(np.float32),
            rng.integers(0, 10, n).astype(np.int64))


def _design_doc_net(seed=0):
    net = mg.Net(place=mg.CPUPlace(), seed=seed)
    img = layers.data(net, "image", shape=(-1, 1, 8, 8))
    lbl = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, img, num_filters=16, filter_size=3, padding=1)
    h = layers.batch_norm(net, h)
    h = layers.relu(net, h)
    logits = layers.fc(net, layers.pool2d(net, h, 2), size=10)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.SGD(learning_rate=0.1).minimize(net, loss)
    return net, logits, loss


def _hash_persistables(net):
    h = hashlib.sha256()
    for v in net.persistables():
        h.update(v.name.encode())
        h.update(np.ascontiguousarray(v.get()).tobytes())
    return h.hexdigest()


def test_fork_happens_at_batch_norm_and_branches_share_persistables():
    net, logits, loss = _design_doc_net()
    assert net.forked
    assert [op.type for op in net.section("trunk")] == ["conv2d", "elementwise_add"]
    train_bn, infer_bn = net.section("train")[0], net.section("infer")[0]
    assert train_bn.type == infer_bn.type == "batch_norm"
    assert train_bn.attrs["is_infer"] is False and infer_bn.attrs["is_infer"] is True
    for slot in ("x", "scale", "bias", "estimated_mean", "estimated_var", "num_batches"):
        assert train_bn.inputs[slot] is infer_bn.inputs[slot], slot   # the same Variable objects
    assert train_bn.outputs["saved_mean"] is train_bn.inputs["estimated_mean"]
    assert train_bn.outputs["y"] is not infer_bn.outputs["y"]
    assert train_bn.outputs["y"].scope is net.scopes["train"]
    assert infer_bn.outputs["y"].scope is net.scopes["infer"]
    assert net.var("batch_norm_0.estimated_mean").scope is net.scope
    train_fc = [op for op in net.section("train") if op.type == "mul"][0]
    infer_fc = [op for op in net.section("infer") if op.type == "mul"][0]
    assert train_fc.inputs["y"] is infer_fc.inputs["y"] is net.var("fc_0.w")
    assert not any(op.type.endswith("_grad") or op.type == "sgd" for op in net.section("infer"))
    assert all(op.type == "sgd" for op in net.section("update"))


def test_infer_never_changes_a_persistable_and_train_does():
    net, logits, loss = _design_doc_net()
    xb, yb = _digits_like()
    net.train(feed={"image": xb, "label": yb}, fetch=[loss])
    before = _hash_persistables(net)
    (p,) = net.infer(feed={"image": xb[:5]}, fetch=[logits])
    assert p.shape == (5, 10)
    assert _hash_persistables(net) == before
    net.train(feed={"image": xb, "label": yb}, fetch=[loss])
    assert _hash_persistables(net) != before


def test_design_doc_loop_trains_and_infers_in_any_order():
    net, logits, loss = _design_doc_net()
    xb, yb = _digits_like(n=64)
    yb = (xb.mean(axis=(1, 2, 3)) > 0).astype(np.int64)     # a learnable rule
    (p0,) = net.infer(feed={"image": xb}, fetch=[logits])   # infer before any training
    losses = []
    for pass_id in range(201):
        (l,) = net.train(feed={"image": xb, "label": yb}, fetch=[loss])
        losses.append(float(l))
        if pass_id % 100 == 0:
            (p,) = net.infer(feed={"image": xb}, fetch=[logits])
            assert p.shape == (64, 10) and np.all(np.isfinite(p))
    assert losses[-1] < 0.5 * losses[0]
    assert (p.argmax(axis=1) == yb).mean() > 0.9
    assert int(net.var("batch_norm_0.num_batches").get()) == 201


def test_infer_uses_the_estimates_and_train_the_batch_statistics():
    net, logits, loss = _design_doc_net()
    xb, yb = _digits_like()
    net.train(feed={"image": xb, "label": yb})
    est_mean = net.var("batch_norm_0.estimated_mean").get()
    est_var = net.var("batch_norm_0.estimated_var").get()
    (y_inf,) = net.infer(feed={"image": xb}, fetch=["batch_norm_0.y"])
    bn_in = net.var("conv2d_0.out").get().copy()   # the trunk output infer just computed
    s = net.var("batch_norm_0.scale").get()[:, None, None].copy()
    b = net.var("batch_norm_0.bias").get()[:, None, None].copy()
    ref = (bn_in - est_mean[:, None, None]) / np.sqrt(est_var[:, None, None] + 1e-5)
    np.testing.assert_allclose(y_inf, ref * s + b, atol=1e-4)
    (y_train,) = net.train(feed={"image": xb, "label": yb}, fetch=["batch_norm_0.y"])
    mu, var = bn_in.mean(axis=(0, 2, 3)), bn_in.var(axis=(0, 2, 3))
    ref = (bn_in - mu[:, None, None]) / np.sqrt(var[:, None, None] + 1e-5)
    np.testing.assert_allclose(y_train, ref * s + b, atol=1e-4)


def test_net_without_batch_norm_never_forks():
    net = mg.Net(seed=1)
    x = layers.data(net, "x", shape=(-1, 4))
    out = layers.relu(net, layers.fc(net, x, size=3))
    assert not net.forked and net.section("train") == () and net.section("infer") == ()
    xb = np.ones((2, 4), np.float32)
    (a,) = net.train(feed={"x": xb}, fetch=[out])
    (b,) = net.infer(feed={"x": xb}, fetch=[out])
    np.testing.assert_array_equal(a, b)
    assert net.ops("train") == net.ops("infer")


def test_missing_feed_and_unknown_feed_are_clear_errors():
    net, logits, loss = _design_doc_net()
    xb, yb = _digits_like()
    with pytest.raises(KeyError, match="train: missing feed 'label'"):
        net.train(feed={"image": xb}, fetch=[loss])
    with pytest.raises(KeyError, match="feed 'lable': not a data variable of this net; data: image, label"):
        net.train(feed={"image": xb, "lable": yb})
    with pytest.raises(TypeError, match="feed 'image': expected dtype float32, got float64"):
        net.infer(feed={"image": xb.astype(np.float64)}, fetch=[logits])
    with pytest.raises(ValueError, match=r"feed 'image': expected shape \(N, 1, 8, 8\), got \(32, 8, 8\)"):
        net.infer(feed={"image": xb[:, 0]}, fetch=[logits])


def test_infer_is_pruned_to_the_fetch_targets():
    net, logits, loss = _design_doc_net()
    xb, _ = _digits_like()
    net.infer(feed={"image": xb}, fetch=[logits])             # needs no label
    plan = net.plan("infer", (net.var("fc_0.out", "infer"),))
    assert "softmax_with_cross_entropy" not in [op.type for op in plan.ops]
    assert [v.name for v in plan.needed] == ["image"]


def test_names_parameters_and_persistables():
    net = mg.Net(seed=0)
    x = layers.data(net, "x", shape=(-1, 3, 4, 4))
    h = layers.conv2d(net, x, num_filters=8, filter_size=3, name="c1")
    h = layers.batch_norm(net, h, name="bn1")
    layers.fc(net, h, size=10, name="fc1")
    layers.fc(net, h, size=5)
    names = [v.name for v in net.persistables()]
    assert names == ["c1.w", "c1.b", "bn1.scale", "bn1.bias", "bn1.estimated_mean",
                     "bn1.estimated_var", "bn1.num_batches", "fc1.w", "fc1.b", "fc_0.w", "fc_0.b"]
    assert [v.name for v in net.parameters()] == ["c1.w", "c1.b", "bn1.scale", "bn1.bias",
                                                  "fc1.w", "fc1.b", "fc_0.w", "fc_0.b"]
    assert net.var("c1.w").shape == (8, 3, 3, 3)
    assert net.var("fc1.w").shape == (8 * 2 * 2, 10) and net.var("fc1.b").shape == (10,)
    assert net.var("bn1.num_batches").dtype == np.int64
    with pytest.raises(KeyError, match="no variable named 'nope'"):
        net.var("nope")


def test_seeded_nets_initialise_identically():
    def params(seed):
        net = mg.Net(seed=seed)
        x = layers.data(net, "x", shape=(-1, 6))
        layers.fc(net, layers.fc(net, x, size=5), size=4)
        net.initialize()
        return [p.get() for p in net.parameters()]

    a, b, c = params(3), params(3), params(4)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0][:, :4], a[2][:5])          # each parameter its own stream


def test_append_op_for_hand_built_ops():
    net = mg.Net()
    x = layers.data(net, "x", shape=(-1, 4))
    out = net.scope.new_var("out")
    net.append_op(mg.Operator("relu", x=x, out=out))
    assert net.section("trunk")[-1].type == "relu"
    (r,) = net.infer(feed={"x": -np.ones((2, 4), np.float32)}, fetch=[out])
    assert (r == 0).all()
    with pytest.raises(ValueError, match="section must be one of"):
        net.append_op(mg.Operator("relu", x=x, out=net.scope.new_var("o2")), section="side")
