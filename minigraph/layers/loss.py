"""Losses and metrics: softmax_with_cross_entropy, mean, argmax, accuracy."""
from __future__ import annotations

import numpy as np

from minigraph.layers.base import axis_arg, known_rank, layer, tensor


def _labels(net, kind, label):
    tensor(net, kind, "label", label)
    if label.dtype is not None and np.dtype(label.dtype) != np.int64:
        raise TypeError(f"{kind}: argument 'label' must be int64 class indices, got "
                        f"{label.name!r} of dtype {label.dtype}")
    return label


@layer("softmax_with_cross_entropy")
def softmax_with_cross_entropy(net, logits, label, name=None):
    """Per-row cross entropy of softmax(logits) against int64 class labels; shape (N,)."""
    tensor(net, "softmax_with_cross_entropy", "logits", logits, float_only=True)
    _labels(net, "softmax_with_cross_entropy", label)
    return net.append("softmax_with_cross_entropy", {"logits": logits, "label": label},
                      {"softmax": f"{name}.softmax", "loss": f"{name}.loss"})["loss"]


@layer("mean")
def mean(net, x, name=None):
    """The mean of every element: a scalar of shape ()."""
    tensor(net, "mean", "x", x, float_only=True)
    return net.append("mean", {"x": x}, {"out": f"{name}.out"})["out"]


@layer("argmax")
def argmax(net, x, axis=-1, name=None):
    """The index of the (first) largest value along `axis`, int64; no gradient."""
    tensor(net, "argmax", "x", x, float_only=True)
    axis_arg("argmax", "axis", axis, len(known_rank("argmax", x)))
    return net.append("argmax", {"x": x}, {"out": f"{name}.out"}, {"axis": axis})["out"]


@layer("accuracy")
def accuracy(net, logits, label, name=None):
    """The fraction of rows whose argmax(logits) equals the label: a float32 scalar."""
    tensor(net, "accuracy", "logits", logits, float_only=True)
    _labels(net, "accuracy", label)
    return net.append("accuracy", {"logits": logits, "label": label},
                      {"out": f"{name}.out"})["out"]
