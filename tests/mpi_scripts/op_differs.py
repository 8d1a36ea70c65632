"""Rank script: the ranks build nets with the same persistables but different ops,
attributes or wiring; data_parallel must refuse them on every rank with an error
naming the first differing op (they used to train and exit 0).

argv[1]:
  activation - relu on rank 0, sigmoid on the others;
  dropout    - dropout p=0.1 on rank 0, p=0.5 on the others;
  wiring     - the residual add reads the fc output on rank 0, the relu on the others;
  seed       - the same net built with a different seed per rank (dropout's seed
               attribute differs): that is the same net, so every rank prints OK.
"""
from __future__ import annotations

import sys

import numpy as np

import minigraph as mg
from minigraph import layers


def build(mode, first):
    net = mg.Net(seed=0 if mode != "seed" else None)
    x = layers.data(net, "x", shape=(-1, 6))
    lbl = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.fc(net, x, 6, name="fc1")
    act = layers.sigmoid if mode == "activation" and not first else layers.relu
    a = act(net, h)
    a = layers.add(net, a, h if mode == "wiring" and first else a)
    p = 0.5 if mode == "dropout" and not first else 0.1
    a = layers.dropout(net, a, p=p)
    logits = layers.fc(net, a, 3, name="fc2")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, lbl))
    return net, loss


def main(mode):
    comm = mg.distributed.init()
    net, loss = build(mode, comm.rank == 0)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    mg.distributed.data_parallel(net, batch_size_from="label")
    rng = np.random.default_rng(comm.rank)
    net.train(feed={"x": rng.standard_normal((4, 6)).astype(np.float32),
                    "label": rng.integers(0, 3, 4)}, fetch=[loss])
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
