"""Rank script: the ranks build different nets; every rank must end with an
error naming the variable (and each rank's shape), never a raw MPI stack or a
silently truncated collective.

argv[1]:
  channels - a sync batch norm over 3 channels on rank 0 and 4 on the others,
             no data_parallel: the order check names the collective's op and
             variable and each rank's size;
  image    - images of 4x4 on rank 0 and 5x5 on the others, so fc1.w differs:
             data_parallel names fc1.w and each rank's shape;
  layers   - the last rank has one more layer (fc2): data_parallel names fc2.w.
The error reaches the excepthook (the job ends non-zero); "OK rank r" is never printed.
"""
from __future__ import annotations

import sys

import numpy as np

import minigraph as mg
from minigraph import layers


def build(channels, size, extra):
    net = mg.Net(seed=0)
    img = layers.data(net, "image", shape=(-1, channels, size, size))
    lbl = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, img, num_filters=channels, filter_size=3, padding=1, name="c1")
    h = layers.relu(net, layers.batch_norm(net, h, name="bn1", sync=True))
    logits = layers.fc(net, h, size=4, name="fc1")
    if extra:
        logits = layers.fc(net, logits, size=4, name="fc2")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, lbl))
    return net, loss


def main(mode):
    comm = mg.distributed.init()
    first = comm.rank == 0
    channels = 3 if mode != "channels" or first else 4
    size = 4 if mode != "image" or first else 5
    net, loss = build(channels, size, extra=mode == "layers" and comm.rank == comm.size - 1)
    feed = {"image": np.random.default_rng(comm.rank).standard_normal(
        (4, channels, size, size)).astype(np.float32), "label": np.arange(4) % 4}
    if mode != "channels":
        mg.optimizer.SGD(0.1).minimize(net, loss)
        mg.distributed.data_parallel(net, batch_size_from="label")
    net.train(feed=feed, fetch=[loss])
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
