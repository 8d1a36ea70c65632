"""Rank script: training with no shared filesystem (each rank in its own directory).

Launched MPMD, each rank with its own working directory and its own
MINIGRAPH_CACHE (the native kernels each rank builds), holding its own copy of
the data: tiny MNIST files in data/ (IDX, raw or .gz). Every rank reads its
copy with data.datasets.mnist("data"), trains a small conv net (sync batch
norm, data_parallel) for 2 epochs from the sharded DataLoader (global batch
8 of 20 rows), then mg.distributed.save writes ckpt.npz: on rank 0 only, in
rank 0's directory. Every rank prints "cwd rank r: DIR", "digest rank r: HEX"
(a hash of its persistables' names and bytes) and "OK rank r".
"""
from __future__ import annotations

import hashlib
import os
import sys

import minigraph as mg
from minigraph import data, layers

BATCH, EPOCHS = 8, 2


def build(sync):
    """(net, loss): conv 4 3x3 stride 2 -> batch norm -> relu -> max pool 2 -> fc 10."""
    net = mg.Net(seed=1)
    image = layers.data(net, "image", shape=(-1, 1, 28, 28))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, image, num_filters=4, filter_size=3, stride=2, padding=1, name="c1")
    h = layers.relu(net, layers.batch_norm(net, h, name="bn1", sync=sync))
    logits = layers.fc(net, layers.pool2d(net, h, 2), size=10, name="fc1")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Momentum(0.1).minimize(net, loss)
    return net, loss


def digest(net):
    """A hash of every persistable's name and bytes, in the net's order."""
    h = hashlib.sha256()
    for var in net.persistables():
        h.update(var.name.encode())
        h.update(var.get().tobytes())
    return h.hexdigest()


def main():
    comm = mg.distributed.init()
    net, loss = build(sync=True)
    mg.distributed.data_parallel(net, batch_size_from="label")
    loader = data.DataLoader(data.datasets.mnist("data"), BATCH, shuffle=True, seed=2)
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for feed in loader:
            net.train(feed=feed, fetch=[loss])
    mg.distributed.save(net, "ckpt.npz")
    say(f"cwd rank {comm.rank}: {os.getcwd()}")
    say(f"digest rank {comm.rank}: {digest(net)}")
    say(f"OK rank {comm.rank}")


def say(line):
    """One line in one write, so the launcher never interleaves it with another rank's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
