"""Data in: datasets, a loader that shuffles, shards across ranks, transforms and prefetches.

    from minigraph import data
    ds = data.ArrayDataset(image=x, label=y)
    loader = data.DataLoader(ds, batch_size=64, shuffle=True, seed=0,
                             transform=data.transforms.RandomCrop(32, padding=4))
    for epoch in range(E):
        loader.set_epoch(epoch)
        for feed in loader:                  # {name: batch array}
            net.train(feed=feed, fetch=[loss])

`data.datasets` reads MNIST, CIFAR-10 (binary) and scikit-learn's digits from
files the user has; see docs/data.md.
"""
from minigraph.data import datasets, transforms
from minigraph.data.dataset import ArrayDataset
from minigraph.data.loader import DataLoader

__all__ = ["ArrayDataset", "DataLoader", "datasets", "transforms"]
