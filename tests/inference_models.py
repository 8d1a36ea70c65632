"""The net the inference-model tests save and load: trained() builds and trains it,
save_trained() writes its inference model; batch() is an input for it."""
from __future__ import annotations

import json

import numpy as np

import minigraph as mg


def trained(steps=3, seed=0, momentum=0.9):
    """conv -> batch_norm -> relu -> max pool -> fc -> batch_norm -> relu -> fc, trained
    a few Momentum steps: (net, handles)."""
    net = mg.Net(seed=seed)
    image = mg.layers.data(net, "image", shape=(-1, 1, 8, 8))
    label = mg.layers.data(net, "label", shape=(-1,), dtype="int64")
    h = mg.layers.conv2d(net, image, num_filters=4, filter_size=3, padding=1, name="c1")
    h = mg.layers.relu(net, mg.layers.batch_norm(net, h, name="bn1", momentum=momentum))
    h = mg.layers.pool2d(net, h, pool_size=2, pool_type="max")
    h = mg.layers.fc(net, h, size=8, name="fc1")
    h = mg.layers.relu(net, mg.layers.batch_norm(net, h, name="bn2"))
    logits = mg.layers.fc(net, h, size=5, name="fc2")
    loss = mg.layers.mean(net, mg.layers.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Momentum(learning_rate=0.1).minimize(net, loss)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        net.train(feed={"image": rng.random((8, 1, 8, 8), dtype=np.float32),
                        "label": rng.integers(0, 5, 8)}, fetch=[loss])
    return net, {"image": image, "label": label, "logits": logits, "loss": loss, "h": h}


def batch(n=6, seed=1):
    """n images for trained()'s net, the same for the same seed."""
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def save_trained(directory):
    """Train trained()'s net and save its inference model (feeds image, fetches the
    logits and fc1.out) in `directory`/model: (net, handles, the model's directory)."""
    net, h = trained()
    d = directory / "model"
    assert mg.io.save_inference(net, d, feeds=["image"], fetches=[h["logits"], "fc1.out"]) == d
    return net, h, d


def params_path(d):
    """The params file the model.json of directory `d` names."""
    return d / json.loads((d / "model.json").read_text())["params"]["file"]
