"""Initialisers: each turns a parameter Variable into the op that fills it.

`init.op(var, seed, fan_in, fan_out) -> OpDesc`; Xavier and Kaiming derive
their range from the fans (fc: (in, out); conv: in·kh·kw, out·kh·kw).

Every initializer checks its arguments when it is made (finite numbers, low <= high,
std and gains >= 0, bools where a bool is meant: a ValueError or TypeError naming the
initializer and the argument), and `op` checks what it would fill against the
parameter: values its dtype cannot hold (Uniform(0, 1e39) for float32) and fans
of 0 (a layer with no inputs) are errors naming the initializer, the argument and
the parameter.

The defaults of layers.fc and layers.conv2d are PyTorch's (nn.Linear, nn.Conv2d):
weights KaimingUniform(a=sqrt(5)), which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
and biases FanInUniform(), the same range with the weight's fan_in. Pick another
with `param_attr=mg.ParamAttr(initializer=...)` (or `bias_attr=`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from minigraph.schema import OpDesc
from minigraph.validators import check_number, is_int

# a normal sample farther than this many std from its mean is not expected in any
# tensor (P < 1e-40 per value): Normal's mean +- NORMAL_REACH std must fit the dtype
NORMAL_REACH = 14.0


def _real(kind, arg, value, low=-math.inf):
    """`value` as a finite float >= low, else a ValueError naming the initializer and
    the argument (NaN, inf, bools and non-numbers included)."""
    return check_number(value, f"{kind}: argument '{arg}'", low)


def _flag(kind, arg, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{kind}: argument '{arg}' must be True or False, got {value!r}")


def _fits(kind, arg, value, var):
    """A ValueError naming the initializer, the argument and the parameter when |value|
    is beyond what var's float dtype holds (it would fill the parameter with inf)."""
    dtype = np.dtype(var.dtype)
    if dtype.kind == "f" and abs(value) > float(np.finfo(dtype).max):
        raise ValueError(f"{kind}: argument '{arg}' gives {value:g}, beyond the range of the "
                         f"{dtype} parameter {var.name!r} (|x| <= {np.finfo(dtype).max:g})")


def _fan(kind, which, fan, var):
    """fan as a float > 0; a ValueError naming the initializer and the parameter for a
    fan of 0 (a layer with no inputs or no outputs has no range to derive)."""
    if not isinstance(fan, numbers.Real) or not fan > 0:
        raise ValueError(f"{kind}: parameter {var.name!r} of shape {tuple(var.shape)} has "
                         f"{which} {fan!r}; its range needs a {which} > 0")
    return float(fan)


def _fill(op_type, var, **attrs):
    return OpDesc(op_type, dict(out=var, shape=tuple(var.shape), dtype=str(var.dtype), **attrs))


@dataclass(frozen=True)
class Constant:
    """Every element = value."""

    value: float = 0.0

    def __post_init__(self):
        _real("Constant", "value", self.value)

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        _fits("Constant", "value", float(self.value), var)
        return _fill("fill_constant", var, value=float(self.value))


@dataclass(frozen=True)
class Uniform:
    """U(low, high)."""

    low: float = -1.0
    high: float = 1.0

    def __post_init__(self):
        low = _real("Uniform", "low", self.low)
        high = _real("Uniform", "high", self.high)
        if high < low:
            raise ValueError(f"Uniform: argument 'high' ({self.high!r}) must be >= 'low' "
                             f"({self.low!r})")
        if not math.isfinite(high - low):
            raise ValueError(f"Uniform: the range high - low ({self.high!r} - {self.low!r}) "
                             "overflows")

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        return _uniform("Uniform", "high" if abs(self.high) >= abs(self.low) else "low",
                        self.low, self.high, var, seed)


def _uniform(kind, arg, low, high, var, seed):
    _fits(kind, arg, max(abs(low), abs(high)), var)
    return _fill("uniform_random", var, min=float(low), max=float(high), seed=seed)


def _normal(kind, arg, mean, std, var, seed, zero_row=None):
    _fits(kind, arg, abs(mean) + NORMAL_REACH * std, var)
    return _fill("gaussian_random", var, mean=float(mean), std=float(std), seed=seed,
                 zero_row=-1 if zero_row is None else int(zero_row))


@dataclass(frozen=True)
class Normal:
    """N(mean, std²); zero_row: an index on the first axis whose row is then set to 0
    (an embedding's padding row), or None."""

    mean: float = 0.0
    std: float = 1.0
    zero_row: int | None = None

    def __post_init__(self):
        _real("Normal", "mean", self.mean)
        _real("Normal", "std", self.std, 0.0)
        if self.zero_row is not None and not is_int(self.zero_row):
            raise TypeError(f"Normal: argument 'zero_row' must be an int or None, got "
                            f"{self.zero_row!r}")

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        return _normal("Normal", "std", self.mean, self.std, var, seed, self.zero_row)


def _fans(var, fan_in, fan_out):
    shape = tuple(var.shape)
    if fan_in is None or fan_out is None:
        receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
        if len(shape) == 2:
            guess = (shape[0], shape[1])                 # fc weight: (in, out)
        elif len(shape) > 2:
            guess = (shape[1] * receptive, shape[0] * receptive)  # conv: (out, in, kh, kw)
        else:
            guess = (shape[0] if shape else 1,) * 2
        fan_in = fan_in if fan_in is not None else guess[0]
        fan_out = fan_out if fan_out is not None else guess[1]
    return fan_in, fan_out


@dataclass(frozen=True)
class Xavier:
    """Glorot: variance 2·gain² / (fan_in + fan_out), uniform or normal."""

    uniform: bool = True
    gain: float = 1.0

    def __post_init__(self):
        _flag("Xavier", "uniform", self.uniform)
        _real("Xavier", "gain", self.gain, 0.0)

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, fo = _fans(var, fan_in, fan_out)
        std = self.gain * math.sqrt(2.0 / _fan("Xavier", "fan_in + fan_out", fi + fo, var))
        return _spread("Xavier", self.uniform, std, var, seed)


def _spread(kind, uniform, std, var, seed):
    """U(+-sqrt(3) std) or N(0, std^2) of a fan-derived std; its range checked against
    var's dtype naming `kind`'s gain."""
    if uniform:
        a = math.sqrt(3.0) * std
        return _uniform(kind, "gain", -a, a, var, seed)
    return _normal(kind, "gain", 0.0, std, var, seed)


@dataclass(frozen=True)
class Kaiming:
    """He: variance gain² / fan_in with gain √2 (for ReLU), uniform or normal."""

    uniform: bool = False
    gain: float = math.sqrt(2.0)

    def __post_init__(self):
        _flag("Kaiming", "uniform", self.uniform)
        _real("Kaiming", "gain", self.gain, 0.0)

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, _ = _fans(var, fan_in, fan_out)
        std = self.gain / math.sqrt(_fan("Kaiming", "fan_in", fi, var))
        return _spread("Kaiming", self.uniform, std, var, seed)


@dataclass(frozen=True)
class KaimingUniform:
    """torch.nn.init.kaiming_uniform_(a=a, mode="fan_in", nonlinearity="leaky_relu"):
    U(-b, b) with b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)).
    a = sqrt(5) gives U(+-1/sqrt(fan_in)), PyTorch's Linear and Conv weights'."""

    a: float = 0.0

    def __post_init__(self):
        _real("KaimingUniform", "a", self.a)

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, _ = _fans(var, fan_in, fan_out)
        fi = _fan("KaimingUniform", "fan_in", fi, var)
        a = float(self.a)
        bound = math.sqrt(2.0 / (1.0 + a * a)) * math.sqrt(3.0 / fi)
        return _uniform("KaimingUniform", "a", -bound, bound, var, seed)


@dataclass(frozen=True)
class FanInUniform:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's Linear and Conv biases (the layer
    passes its weight's fan_in)."""

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, _ = _fans(var, fan_in, fan_out)
        bound = 1.0 / math.sqrt(fi) if fi > 0 else 0.0
        return Uniform(-bound, bound).op(var, seed)
