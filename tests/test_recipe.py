"""The modern recipe end to end on scikit-learn's digits: AdamW with no weight decay on
biases and batch-norm parameters and a 10x learning rate on the head, OneCycleLR,
label smoothing and GradientMerge(k=2); and a single-head attention block built from
embedding, matmul and softmax whose gradients equal a float64 numpy backward pass
written by hand (benchmarks/recipes_torch.py compares the same block with PyTorch)."""
import math

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L
from minigraph.examples.train_digits import load_digits_split


def digits_net(seed=0):
    net = mg.Net(seed=seed)
    image = L.data(net, "image", (-1, 1, 8, 8))
    label = L.data(net, "label", (-1,), "int64")
    h = L.conv2d(net, image, 16, 3, padding=1, name="conv1")
    h = L.relu(net, L.batch_norm(net, h, name="bn1"))
    h = L.pool2d(net, h, 2)
    h = L.relu(net, L.batch_norm(net, L.fc(net, h, 64, name="fc1"), name="bn2"))
    logits = L.fc(net, h, 10, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label, label_smoothing=0.1))
    return net, logits, loss


def test_the_modern_recipe_trains_the_digits():
    train_x, train_y, test_x, test_y = load_digits_split()
    net, logits, loss = digits_net()
    head = [net.var("head.w"), net.var("head.b")]
    body = [p for p in net.parameters() if p not in head]
    decay = [p for p in body if p.name.endswith(".w")]
    no_decay = [p for p in body if not p.name.endswith(".w")]       # biases, bn scale/bias
    assert {p.name for p in no_decay} >= {"bn1.scale", "bn1.bias", "conv1.b", "fc1.b"}
    epochs, micro, k = 5, 32, 2
    steps = epochs * math.ceil(len(train_x) / micro)
    schedule = mg.optimizer.lr.OneCycleLR(0.01, total_steps=steps // k)
    opt = mg.optimizer.GradientMerge(mg.optimizer.AdamW(schedule, weight_decay=0.05), k)
    opt.minimize(net, loss, parameters=[
        {"params": decay}, {"params": no_decay, "weight_decay": 0.0},
        {"params": head[:1], "learning_rate": 10.0},
        {"params": head[1:], "learning_rate": 10.0, "weight_decay": 0.0}])

    updates = {op.inputs["param"].name: op for op in net.section("update") if op.type == "adam"}
    assert updates["conv1.w"].attrs["weight_decay"] == 0.05
    assert updates["bn1.scale"].attrs["weight_decay"] == updates["conv1.b"].attrs[
        "weight_decay"] == updates["head.b"].attrs["weight_decay"] == 0.0
    assert updates["conv1.w"].inputs["learning_rate"] is opt.inner.lr_var
    head_rate = updates["head.w"].inputs["learning_rate"]
    assert head_rate is updates["head.b"].inputs["learning_rate"] is not opt.inner.lr_var

    rng = np.random.default_rng(0)
    losses = []
    for _ in range(epochs):
        order = rng.permutation(len(train_x))
        for start in range(0, len(order), micro):
            idx = order[start:start + micro]
            updating = (int(opt.counter.get()) + 1) % k == 0   # head_rate exists then only
            got = net.train(feed={"image": train_x[idx], "label": train_y[idx]},
                            fetch=[loss, head_rate] if updating else [loss])
            losses.append(float(got[0]))
            if updating:
                np.testing.assert_allclose(float(got[1]), 10 * opt.learning_rate, rtol=1e-15)
    assert int(opt.counter.get()) == steps
    assert int(opt.inner.step_var.get()) == steps // k
    (out,) = net.infer(feed={"image": test_x}, fetch=[logits])
    accuracy = float((out.argmax(axis=1) == test_y).mean())
    print(f"digits recipe: held-out accuracy {accuracy:.4f}")
    assert accuracy >= 0.95, accuracy
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])


# ---- a single-head attention block ---------------------------------------------------

V, T, D, C, B = 11, 5, 6, 3, 4


def attention_net():
    """ids (B, T) -> embedding (V, D) -> q, k, v = e @ Wq, e @ Wk, e @ Wv ->
    softmax(q k^T / sqrt(D)) @ v -> mean over T -> fc(C) -> mean cross entropy."""
    net = mg.Net(seed=3)
    ids = L.data(net, "ids", (-1, T), "int64")
    label = L.data(net, "label", (-1,), "int64")
    e = L.embedding(net, ids, V, D, dtype="float64", name="emb")
    proj = {}
    for part in "qkv":
        w = net.create_parameter(f"w{part}", (D, D), "float64",
                                 mg.initializer.Normal(0.0, 0.5))
        proj[part] = L.matmul(net, e, w, name=part)
    scores = L.scale(net, L.matmul(net, proj["q"], proj["k"], transpose_y=True),
                     scale=1 / math.sqrt(D))
    attn = L.softmax(net, scores, axis=-1)
    pooled = L.reduce_mean(net, L.matmul(net, attn, proj["v"]), axis=1)
    logits = L.fc(net, pooled, C, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.append_backward(net, loss)
    return net, loss


def attention_reference(p, ids, label):
    """Forward and backward by hand in float64: {parameter name: gradient}."""
    e = p["emb.w"][ids]                                         # (B, T, D)
    q, k, v = e @ p["wq"], e @ p["wk"], e @ p["wv"]
    c = 1 / math.sqrt(D)
    s = q @ np.swapaxes(k, 1, 2) * c
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = a @ v
    pooled = o.mean(1)
    z = pooled @ p["head.w"] + p["head.b"]
    sm = np.exp(z - z.max(1, keepdims=True))
    sm /= sm.sum(1, keepdims=True)
    loss = -np.log(sm[np.arange(B), label]).mean()
    dz = (sm - np.eye(C)[label]) / B
    g = {"head.w": pooled.T @ dz, "head.b": dz.sum(0)}
    do = np.repeat((dz @ p["head.w"].T)[:, None, :] / T, T, axis=1)
    da, dv = do @ np.swapaxes(v, 1, 2), np.swapaxes(a, 1, 2) @ do
    ds = a * (da - (da * a).sum(-1, keepdims=True)) * c
    dq, dk = ds @ k, np.swapaxes(ds, 1, 2) @ q
    g.update({f"w{n}": np.einsum("btd,bte->de", e, d) for n, d in (("q", dq), ("k", dk),
                                                                     ("v", dv))})
    de = dq @ p["wq"].T + dk @ p["wk"].T + dv @ p["wv"].T
    g["emb.w"] = np.zeros_like(p["emb.w"])
    np.add.at(g["emb.w"], ids.reshape(-1), de.reshape(-1, D))
    return loss, g


def test_attention_block_gradients_equal_a_hand_written_backward():
    net, loss = attention_net()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, V, (B, T))
    ids[0, :2] = 4                                       # a repeated id sums its rows
    label = rng.integers(0, C, B)
    names = [p.name for p in net.parameters()]
    assert sorted(names) == sorted(["emb.w", "wq", "wk", "wv", "head.w", "head.b"])
    got = net.train(feed={"ids": ids, "label": label}, fetch=[loss] + [net.grad(n) for n in names])
    want_loss, want = attention_reference({n: net.var(n).get() for n in names}, ids, label)
    assert got[0] == pytest.approx(want_loss, rel=1e-13)
    for name, g in zip(names, got[1:]):
        np.testing.assert_allclose(g, want[name], rtol=1e-10, atol=1e-13, err_msg=name)
    assert np.all(got[1 + names.index("emb.w")][[r for r in range(V) if r not in ids]] == 0)
