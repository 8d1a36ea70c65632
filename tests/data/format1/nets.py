"""The nets behind the version 1 files in this folder (checkpoints and an inference
model written by minigraph before checkpoint format 2), and the script that wrote
them: `python nets.py` with that minigraph. Every builder here uses only the API both
versions share, so the tests rebuild the same nets today."""
from __future__ import annotations

import pathlib

import numpy as np

import minigraph as mg
from minigraph import layers as L

HERE = pathlib.Path(__file__).parent


def feed(step, n=8):
    rng = np.random.default_rng(100 + step)
    return {"image": rng.standard_normal((n, 1, 6, 6)).astype(np.float32),
            "label": rng.integers(0, 3, n)}


def body(net):
    image = L.data(net, "image", shape=(-1, 1, 6, 6))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.conv2d(net, image, num_filters=3, filter_size=3, padding=1, name="c1")
    h = L.pool2d(net, L.relu(net, L.batch_norm(net, h, name="bn1")), 2)
    logits = L.fc(net, L.relu(net, L.fc(net, h, 8, name="fc1")), 3, name="head")
    return logits, L.mean(net, L.softmax_with_cross_entropy(net, logits, label))


def momentum_net():
    """Momentum on a StepDecay schedule, with weight decay: (net, logits)."""
    net = mg.Net(seed=11)
    logits, loss = body(net)
    mg.optimizer.Momentum(mg.optimizer.lr.StepDecay(0.1, 2), momentum=0.9,
                          weight_decay=1e-4).minimize(net, loss)
    return net, logits


def merge_net():
    """GradientMerge(k_steps=2) around Adam on ReduceOnPlateau: (net, schedule)."""
    net = mg.Net(seed=12)
    _, loss = body(net)
    plateau = mg.optimizer.lr.ReduceOnPlateau(0.01, patience=0, factor=0.5)
    mg.optimizer.GradientMerge(mg.optimizer.Adam(plateau), k_steps=2).minimize(net, loss)
    return net, plateau


def main():
    net, logits = momentum_net()
    for step in range(3):
        net.train(feed=feed(step))
    mg.io.save(net, HERE / "momentum.npz")
    net.train(feed=feed(3))
    mg.io.save(net, HERE / "momentum_next.npz")
    mg.io.save_inference(net, HERE / "model", feeds=["image"], fetches=[logits])
    (out,) = net.infer(feed={"image": feed(9)["image"]}, fetch=[logits])
    np.save(HERE / "model_out.npy", out)
    net, plateau = merge_net()
    for step in range(3):
        net.train(feed=feed(step))
    plateau.step(0.5)
    plateau.step(0.7)
    mg.io.save(net, HERE / "merge.npz")
    net.train(feed=feed(3))
    mg.io.save(net, HERE / "merge_next.npz")


if __name__ == "__main__":
    main()
