"""Losses and metrics: softmax_with_cross_entropy (with label smoothing), mse_loss,
l1_loss, huber_loss, binary_cross_entropy_with_logits, mean, argmax, accuracy.

The regression losses are compositions of elementwise ops (subtract, square, abs,
clip, scale), so their gradients are those ops' own. reduction: "mean" (the mean
of every element), "sum" or "none" (elementwise), as in torch.nn.functional."""
from __future__ import annotations

import numpy as np

from minigraph.layers.base import axis_arg, float_arg, known_rank, layer, tensor


def _labels(net, kind, label):
    tensor(net, kind, "label", label)
    if label.dtype is not None and np.dtype(label.dtype) != np.int64:
        raise TypeError(f"{kind}: argument 'label' must be int64 class indices, got "
                        f"{label.name!r} of dtype {label.dtype}")
    return label


@layer("softmax_with_cross_entropy", role="loss")
def softmax_with_cross_entropy(net, logits, label, label_smoothing=0.0, name=None):
    """Per-row cross entropy of softmax(logits) against int64 class labels; shape (N,).
    label_smoothing eps in [0, 1] mixes the target with the uniform one: (1 - eps)
    onehot + eps / K (torch's CrossEntropyLoss(label_smoothing=eps))."""
    tensor(net, "softmax_with_cross_entropy", "logits", logits, float_only=True)
    _labels(net, "softmax_with_cross_entropy", label)
    eps = float_arg("softmax_with_cross_entropy", "label_smoothing", label_smoothing, 0.0, 1.0)
    return net.append("softmax_with_cross_entropy", {"logits": logits, "label": label},
                      {"softmax": f"{name}.softmax", "loss": f"{name}.loss"},
                      {"label_smoothing": eps})["loss"]


REDUCTIONS = ("mean", "sum", "none")


def _reduced(net, kind, elementwise, reduction, name):
    if reduction == "none":
        return elementwise
    op = "mean" if reduction == "mean" else "reduce_sum"
    attrs = {} if op == "mean" else {"axis": None, "keepdim": False}
    return net.append(op, {"x": elementwise}, {"out": f"{name}.out"}, attrs)["out"]


def _pair(net, kind, x, label, reduction):
    tensor(net, kind, "input", x, float_only=True)
    tensor(net, kind, "label", label, float_only=True)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{kind}: argument 'reduction' must be one of "
                         f"{', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    if x.shape is not None and label.shape is not None and \
            tuple(x.shape) != tuple(label.shape):
        raise ValueError(f"{kind}: argument 'label' ({label.name!r}, shape {label.shape}) "
                         f"must have the shape of 'input' ({x.name!r}, shape {x.shape})")


def _difference(net, input, label, name):  # noqa: A002
    """input - label, which must have one shape: checked when the net is built and again
    on every fed shape (a (4, 1) input against a (1, 4) label would broadcast to 4 x 4)."""
    return _op(net, "subtract", {"x": input, "y": label}, name, "diff", {"same_shape": True})


def _op(net, op_type, ins, name, suffix, attrs=None):
    return net.append(op_type, ins, {"out": f"{name}.{suffix}"}, attrs)["out"]


@layer("mse_loss", role="loss")
def mse_loss(net, input, label, reduction="mean", name=None):  # noqa: A002
    """(input - label)^2, reduced (torch's F.mse_loss)."""
    _pair(net, "mse_loss", input, label, reduction)
    d = _difference(net, input, label, name)
    return _reduced(net, "mse_loss", _op(net, "square", {"x": d}, name, "elementwise"),
                    reduction, name)


@layer("l1_loss", role="loss")
def l1_loss(net, input, label, reduction="mean", name=None):  # noqa: A002
    """|input - label|, reduced (torch's F.l1_loss)."""
    _pair(net, "l1_loss", input, label, reduction)
    d = _difference(net, input, label, name)
    return _reduced(net, "l1_loss", _op(net, "abs", {"x": d}, name, "elementwise"),
                    reduction, name)


@layer("huber_loss", role="loss")
def huber_loss(net, input, label, delta=1.0, reduction="mean", name=None):  # noqa: A002
    """0.5 d^2 where |d| <= delta, else delta (|d| - 0.5 delta), d = input - label,
    reduced (torch's F.huber_loss): computed as 0.5 c^2 + delta (|d| - |c|) with
    c = clip(d, -delta, delta)."""
    _pair(net, "huber_loss", input, label, reduction)
    delta = float_arg("huber_loss", "delta", delta, 0.0)
    if delta <= 0:
        raise ValueError(f"huber_loss: argument 'delta' must be > 0, got {delta}")
    d = _difference(net, input, label, name)
    c = _op(net, "clip", {"x": d}, name, "clipped", {"min": -delta, "max": delta})
    quad = _op(net, "scale", {"x": _op(net, "square", {"x": c}, name, "c2")}, name, "quad",
               {"scale": 0.5, "bias": 0.0})
    excess = _op(net, "subtract", {"x": _op(net, "abs", {"x": d}, name, "abs_d"),
                                   "y": _op(net, "abs", {"x": c}, name, "abs_c")}, name, "excess")
    lin = _op(net, "scale", {"x": excess}, name, "linear", {"scale": delta, "bias": 0.0})
    return _reduced(net, "huber_loss", _op(net, "add", {"x": quad, "y": lin}, name,
                                           "elementwise"), reduction, name)


@layer("binary_cross_entropy_with_logits", role="loss")
def binary_cross_entropy_with_logits(net, logit, label, reduction="mean", name=None):
    """Binary cross entropy of sigmoid(logit) against float labels in [0, 1], in its
    stable form, reduced (torch's F.binary_cross_entropy_with_logits)."""
    _pair(net, "binary_cross_entropy_with_logits", logit, label, reduction)
    e = _op(net, "sigmoid_cross_entropy_with_logits", {"x": logit, "label": label}, name,
            "elementwise")
    return _reduced(net, "binary_cross_entropy_with_logits", e, reduction, name)


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


@layer("accuracy", role="metric")
def accuracy(net, logits, label, name=None):
    """The fraction of rows whose argmax(logits) equals the label: a float32 scalar."""
    tensor(net, "accuracy", "logits", logits, float_only=True)
    _labels(net, "accuracy", label)
    return net.append("accuracy", {"logits": logits, "label": label},
                      {"out": f"{name}.out"})["out"]
