"""Initialisers: each turns a parameter Variable into the op that fills it.

`init.op(var, seed, fan_in, fan_out) -> OpDesc`; Xavier and Kaiming derive
their range from the fans (fc: (in, out); conv: in·kh·kw, out·kh·kw).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from minigraph.schema import OpDesc


def _fill(op_type, var, **attrs):
    return OpDesc(op_type, dict(out=var, shape=tuple(var.shape), dtype=str(var.dtype), **attrs))


@dataclass(frozen=True)
class Constant:
    """Every element = value."""

    value: float = 0.0

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        return _fill("fill_constant", var, value=float(self.value))


@dataclass(frozen=True)
class Uniform:
    """U(low, high)."""

    low: float = -1.0
    high: float = 1.0

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        return _fill("uniform_random", var, min=float(self.low), max=float(self.high), seed=seed)


@dataclass(frozen=True)
class Normal:
    """N(mean, std²)."""

    mean: float = 0.0
    std: float = 1.0

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        return _fill("gaussian_random", var, mean=float(self.mean), std=float(self.std),
                     seed=seed)


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

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, fo = _fans(var, fan_in, fan_out)
        std = self.gain * math.sqrt(2.0 / (fi + fo))
        if self.uniform:
            a = math.sqrt(3.0) * std
            return Uniform(-a, a).op(var, seed)
        return Normal(0.0, std).op(var, seed)


@dataclass(frozen=True)
class Kaiming:
    """He: variance gain² / fan_in with gain √2 (for ReLU), uniform or normal."""

    uniform: bool = False
    gain: float = math.sqrt(2.0)

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, _ = _fans(var, fan_in, fan_out)
        std = self.gain / math.sqrt(fi)
        if self.uniform:
            a = math.sqrt(3.0) * std
            return Uniform(-a, a).op(var, seed)
        return Normal(0.0, std).op(var, seed)
