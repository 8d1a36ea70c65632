"""Activations: relu, sigmoid, tanh, gelu, silu, leaky_relu, softmax (no parameters)."""
from __future__ import annotations

from minigraph.layers.base import axis_arg, float_arg, known_rank, layer, tensor


def _unary(net, kind, x, name, attrs=None):
    tensor(net, kind, "x", x, float_only=True)
    return net.append(kind, {"x": x}, {"out": f"{name}.out"}, attrs)["out"]


@layer("relu")
def relu(net, x, name=None):
    """max(x, 0)."""
    return _unary(net, "relu", x, name)


@layer("sigmoid")
def sigmoid(net, x, name=None):
    """1 / (1 + exp(-x))."""
    return _unary(net, "sigmoid", x, name)


@layer("tanh")
def tanh(net, x, name=None):
    """tanh(x)."""
    return _unary(net, "tanh", x, name)


@layer("gelu")
def gelu(net, x, name=None):
    """0.5 x (1 + erf(x / sqrt(2))): the exact form, PyTorch's default."""
    return _unary(net, "gelu", x, name)


@layer("silu")
def silu(net, x, name=None):
    """x * sigmoid(x) (torch.nn.SiLU)."""
    return _unary(net, "silu", x, name)


@layer("leaky_relu")
def leaky_relu(net, x, alpha=0.01, name=None):
    """x where x > 0, else alpha * x."""
    return _unary(net, "leaky_relu", x, name, {"alpha": float_arg("leaky_relu", "alpha", alpha)})


@layer("softmax")
def softmax(net, x, axis=-1, name=None):
    """exp(x) / sum(exp(x)) along `axis`."""
    tensor(net, "softmax", "x", x, float_only=True)
    axis_arg("softmax", "axis", axis, len(known_rank("softmax", x)))
    return _unary(net, "softmax", x, name, {"axis": axis})
