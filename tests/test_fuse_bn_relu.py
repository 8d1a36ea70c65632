"""mg.passes.fuse_batch_norm_relu: which pairs it fuses (in both branches, before and
after minimize, sync ones into the sync form), which it leaves, and that a fused net
trains, infers, checkpoints, folds and converts exactly like the unfused one."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers

rng = np.random.default_rng(3)
X = rng.standard_normal((6, 3, 8, 8)).astype(np.float32)
Y = rng.integers(0, 4, 6)


def build(fuse=None, sync=False, place=None):
    """A net with three batch norms: bn1 -> relu (fused), bn2 -> add -> relu (left), and
    fc -> bn3 -> relu (fused); fuse: None, "before" or "after" minimize."""
    net = mg.Net(place=place, seed=0)
    img = layers.data(net, "image", shape=(-1, 3, 8, 8))
    lbl = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, img, num_filters=4, filter_size=3, padding=1, name="c1")
    h = layers.relu(net, layers.batch_norm(net, h, name="bn1", sync=sync))
    h2 = layers.batch_norm(net, layers.conv2d(net, h, 4, 3, padding=1, name="c2"), name="bn2",
                           sync=sync)
    h = layers.relu(net, layers.add(net, h, h2))
    h = layers.relu(net, layers.batch_norm(net, layers.fc(net, h, 8, name="fc1"), name="bn3",
                                           sync=sync))
    logits = layers.fc(net, h, 4, name="fc2")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, lbl))
    notes = mg.passes.fuse_batch_norm_relu(net) if fuse == "before" else None
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    if fuse == "after":
        notes = mg.passes.fuse_batch_norm_relu(net)
    return net, loss, logits, notes


def run(net, loss, logits, steps=3):
    losses = [float(net.train(feed={"image": X, "label": Y}, fetch=[loss])[0])
              for _ in range(steps)]
    (out,) = net.infer(feed={"image": X}, fetch=[logits])
    return losses, out, {v.name: v.get().copy() for v in net.persistables()}


def types(net, section):
    return [op.type for op in net.section(section)]


@pytest.mark.parametrize("when", ["before", "after"])
def test_pairs_fuse_in_both_branches_and_train_the_same(when):
    net, loss, logits, notes = build(when)
    assert [(n.section, n.batch_norm_y, n.out, n.into, n.backward) for n in notes] == [
        ("train", "bn1.y", "relu_0.out", "batch_norm_relu", when == "after"),
        ("train", "bn3.y", "relu_2.out", "batch_norm_relu", when == "after"),
        ("infer", "bn1.y", "relu_0.out", "batch_norm_relu", False),
        ("infer", "bn3.y", "relu_2.out", "batch_norm_relu", False)]
    assert net.reports["fuse_batch_norm_relu"] == notes
    for section in ("train", "infer"):
        kinds = types(net, section)
        assert kinds.count("batch_norm_relu") == 2 and kinds.count("batch_norm") == 1
        assert kinds.count("relu") == 1                      # after the residual add
    backward = types(net, "backward")
    assert backward.count("batch_norm_relu_grad") == 2 and backward.count("relu_grad") == 1
    assert "bn1.y" not in net.grads and "relu_0.out" in net.grads
    reference = run(*build(None)[:3])
    got = run(net, loss, logits)
    assert got[0] == reference[0]
    np.testing.assert_array_equal(got[1], reference[1])
    assert got[2].keys() == reference[2].keys()           # the same persistables, same names
    for name, value in reference[2].items():
        np.testing.assert_array_equal(got[2][name], value, err_msg=name)


def test_what_is_left_and_why():
    """A batch norm whose y another op reads, one fetched by default, and a relu
    that reads something else are left alone; a second call is an error."""
    net = mg.Net(seed=0)
    img = layers.data(net, "image", shape=(-1, 3, 4, 4))
    a = layers.batch_norm(net, img, name="a")
    both = layers.add(net, layers.relu(net, a), a)            # a.y read twice
    b = layers.batch_norm(net, both, name="b")
    out = layers.relu(net, b)
    net.default_fetches = (b,)                                # b.y is fetched
    assert mg.passes.fuse_batch_norm_relu(net) == []
    assert types(net, "train") == ["batch_norm", "relu", "add", "batch_norm", "relu"]
    with pytest.raises(ValueError, match="already applied"):
        mg.passes.fuse_batch_norm_relu(net)
    assert out is not None


def test_sync_batch_norms_become_the_sync_form_and_convert_after(one_rank):
    net, loss, logits, _ = build("before", sync=True)
    assert types(net, "train").count("sync_batch_norm_relu") == 2
    assert types(net, "backward").count("sync_batch_norm_relu_grad") == 2
    plain, _, plain_logits, _ = build("before")
    assert mg.distributed.convert_sync_batchnorm(plain) > 0
    assert types(plain, "train") == types(net, "train")
    assert types(plain, "backward") == types(net, "backward")
    mg.distributed.data_parallel(plain)
    grads = [op for op in plain.section("backward") if op.schema.presummed]
    assert grads and all(op.attrs["average_ranks"] for op in grads)
    assert "c_avg_presummed" not in types(plain, "backward")
    reference = run(*build(None, sync=True)[:3])
    got = run(plain, plain.loss, plain_logits)
    assert got[0] == pytest.approx(reference[0], rel=1e-6)


def test_checkpoints_load_either_way(tmp_path):
    fused, loss, logits, _ = build("before")
    run(fused, loss, logits, steps=2)
    path = mg.io.save(fused, tmp_path / "ckpt.npz")
    plain, *_ = build(None)
    mg.io.load(plain, path)                                    # strict: every name matches
    for v in plain.persistables():
        np.testing.assert_array_equal(v.get(), fused.var(v.name).get(), err_msg=v.name)


def test_folding_a_fused_net_leaves_relus_after_the_folded_layers():
    net, loss, logits, _ = build("before")
    run(net, loss, logits, steps=2)
    (want,) = net.infer(feed={"image": X}, fetch=[logits])
    folded = mg.passes.fold_batch_norm(net)
    notes = {n.batch_norm: n for n in folded.reports["fold_batch_norm"]}
    assert notes["bn1"].folded and "a relu after it" in notes["bn1"].into
    assert notes["bn3"].folded and "a relu after it" in notes["bn3"].into
    assert "batch_norm_relu" not in types(folded, "trunk")
    (got,) = folded.infer(feed={"image": X}, fetch=[logits.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    fast = mg.passes.optimize_for_inference(net)
    assert types(fast, "trunk")[:2] == ["fused_conv2d", "fused_conv2d"]
    (got,) = fast.infer(feed={"image": X}, fetch=[logits.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_gpu_net_fuses_and_trains_like_the_cpu():
    pytest.importorskip("kernel_emulator")
    import kernel_emulator

    with kernel_emulator.emulated_gpu() as place:
        got = run(*build("before", place=place)[:3], steps=2)
    want = run(*build("before")[:3], steps=2)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-3, atol=1e-4)
