"""Initialisers: each turns a parameter Variable into the op that fills it.

`init.op(var, seed, fan_in, fan_out) -> OpDesc`; Xavier and Kaiming derive
their range from the fans (fc: (in, out); conv: in·kh·kw, out·kh·kw).

The defaults of layers.fc and layers.conv2d are PyTorch's (nn.Linear, nn.Conv2d):
weights KaimingUniform(a=sqrt(5)), which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
and biases FanInUniform(), the same range with the weight's fan_in. Pick another
with `param_attr=mg.ParamAttr(initializer=...)` (or `bias_attr=`).
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
    """N(mean, std²); zero_row: an index on the first axis whose row is then set to 0
    (an embedding's padding row), or None."""

    mean: float = 0.0
    std: float = 1.0
    zero_row: int | None = None

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        return _fill("gaussian_random", var, mean=float(self.mean), std=float(self.std),
                     seed=seed, zero_row=-1 if self.zero_row is None else int(self.zero_row))


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


@dataclass(frozen=True)
class KaimingUniform:
    """torch.nn.init.kaiming_uniform_(a=a, mode="fan_in", nonlinearity="leaky_relu"):
    U(-b, b) with b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)).
    a = sqrt(5) gives U(+-1/sqrt(fan_in)), PyTorch's Linear and Conv weights'."""

    a: float = 0.0

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, _ = _fans(var, fan_in, fan_out)
        bound = math.sqrt(2.0 / (1.0 + self.a ** 2)) * math.sqrt(3.0 / fi)
        return Uniform(-bound, bound).op(var, seed)


@dataclass(frozen=True)
class FanInUniform:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's Linear and Conv biases (the layer
    passes its weight's fan_in)."""

    def op(self, var, seed=0, fan_in=None, fan_out=None):
        fi, _ = _fans(var, fan_in, fan_out)
        bound = 1.0 / math.sqrt(fi) if fi > 0 else 0.0
        return Uniform(-bound, bound).op(var, seed)
