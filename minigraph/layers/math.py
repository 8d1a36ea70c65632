"""Tensor math: subtract, divide, exp, log, sqrt, square, abs, pow, clip, scale,
reduce_sum / reduce_mean / reduce_max and batched matmul. None has parameters."""
from __future__ import annotations

import math
import numbers

from minigraph.layers.base import float_arg, known_rank, layer, tensor
from minigraph.validators import is_int


def _binary(net, kind, x, y, name):
    tensor(net, kind, "x", x, float_only=True)
    tensor(net, kind, "y", y, float_only=True)
    return net.append(kind, {"x": x, "y": y}, {"out": f"{name}.out"})["out"]


def _unary(net, kind, x, name, attrs=None):
    tensor(net, kind, "x", x, float_only=True)
    return net.append(kind, {"x": x}, {"out": f"{name}.out"}, attrs)["out"]


@layer("subtract")
def subtract(net, x, y, name=None):
    """x - y with numpy broadcasting both ways."""
    return _binary(net, "subtract", x, y, name)


@layer("divide")
def divide(net, x, y, name=None):
    """x / y with numpy broadcasting both ways."""
    return _binary(net, "divide", x, y, name)


@layer("exp")
def exp(net, x, name=None):
    """e ** x."""
    return _unary(net, "exp", x, name)


@layer("log")
def log(net, x, name=None):
    """The natural logarithm (nan below 0, -inf at 0)."""
    return _unary(net, "log", x, name)


@layer("sqrt")
def sqrt(net, x, name=None):
    """The square root (nan below 0)."""
    return _unary(net, "sqrt", x, name)


@layer("square")
def square(net, x, name=None):
    """x * x."""
    return _unary(net, "square", x, name)


@layer("abs")
def abs(net, x, name=None):  # noqa: A001  (the layer API's name, like torch.abs)
    """|x| (the gradient is 0 at 0, as torch's)."""
    return _unary(net, "abs", x, name)


@layer("pow")
def pow(net, x, factor, name=None):  # noqa: A001
    """x ** factor (a number)."""
    return _unary(net, "pow", x, name, {"factor": float_arg("pow", "factor", factor)})


def _bound(arg, value):
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isinf(value):
        return float(value)
    return float_arg("clip", arg, value)


@layer("clip")
def clip(net, x, min=-math.inf, max=math.inf, name=None):  # noqa: A002
    """min(max(x, min), max) (torch.clamp: the gradient passes where min <= x <= max)."""
    lo, hi = _bound("min", min), _bound("max", max)
    if lo > hi:
        raise ValueError(f"clip: argument 'min' ({min}) must be <= argument 'max' ({max})")
    return _unary(net, "clip", x, name, {"min": lo, "max": hi})


@layer("scale")
def scale(net, x, scale=1.0, bias=0.0, name=None):
    """x * scale + bias (numbers)."""
    return _unary(net, "scale", x, name, {"scale": float_arg("scale", "scale", scale),
                                          "bias": float_arg("scale", "bias", bias)})


def _axes(kind, x, axis):
    rank = len(known_rank(kind, x))
    if axis is None:
        return None
    items = (axis,) if is_int(axis) else tuple(axis) if hasattr(axis, "__iter__") else None
    if not items or not all(is_int(a) and -rank <= a < rank for a in items) or \
            len({a % rank for a in items}) != len(items):
        raise ValueError(f"{kind}: argument 'axis' must be None, an int or one or more "
                         f"distinct ints in [{-rank}, {rank}) for a rank-{rank} input, got "
                         f"{axis!r}")
    return tuple(int(a) for a in items)


def _reduce(net, kind, x, axis, keepdim, name):
    tensor(net, kind, "x", x, float_only=True)
    return net.append(kind, {"x": x}, {"out": f"{name}.out"},
                      {"axis": _axes(kind, x, axis), "keepdim": bool(keepdim)})["out"]


@layer("reduce_sum")
def reduce_sum(net, x, axis=None, keepdim=False, name=None):
    """The sum over `axis` (an int, ints, or None for every axis; torch.sum)."""
    return _reduce(net, "reduce_sum", x, axis, keepdim, name)


@layer("reduce_mean")
def reduce_mean(net, x, axis=None, keepdim=False, name=None):
    """The mean over `axis` (torch.mean)."""
    return _reduce(net, "reduce_mean", x, axis, keepdim, name)


@layer("reduce_max")
def reduce_max(net, x, axis=None, keepdim=False, name=None):
    """The largest value over `axis` (torch.amax: ties share the gradient)."""
    return _reduce(net, "reduce_max", x, axis, keepdim, name)


@layer("matmul")
def matmul(net, x, y, transpose_x=False, transpose_y=False, name=None):
    """x @ y with np.matmul's broadcasting of the batch axes (each of rank >= 2);
    transpose_x / transpose_y swap that operand's last two axes first."""
    tensor(net, "matmul", "x", x, float_only=True)
    tensor(net, "matmul", "y", y, float_only=True)
    for arg, v in (("x", x), ("y", y)):
        if len(known_rank("matmul", v)) < 2:
            raise ValueError(f"matmul: argument '{arg}' ({v.name!r}) must have rank >= 2, got "
                             f"shape {v.shape}")
    return net.append("matmul", {"x": x, "y": y}, {"out": f"{name}.out"},
                      {"transpose_x": bool(transpose_x),
                       "transpose_y": bool(transpose_y)})["out"]
