"""ParamAttr: how a layer makes one of its parameters (Paddle's ParamAttr).

    mg.ParamAttr(name=None, initializer=None, learning_rate=1.0, weight_decay=None,
                 trainable=True)

name: the parameter's Variable name; a second layer given the same name (and the
  same shape and dtype) uses the same Variable: one parameter, shared, whose
  gradient sums both uses'.
initializer: a minigraph.initializer (None: the layer's default, PyTorch's).
learning_rate: a multiplier of the optimizer's learning rate (schedule included)
  for this parameter.
weight_decay: this parameter's weight decay, replacing the optimizer's (None:
  the optimizer's, or its parameter group's).
trainable: False freezes it (no gradient, no update; summary() counts it as
  non-trainable).
A layer argument taking a ParamAttr also takes a str (the name) or None.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamAttr:
    """See the module doc."""

    name: str | None = None
    initializer: object = None
    learning_rate: float = 1.0
    weight_decay: float | None = None
    trainable: bool = True

    def __post_init__(self):
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise TypeError(f"ParamAttr: name must be a non-empty str or None, got {self.name!r}")
        if self.initializer is not None and not callable(getattr(self.initializer, "op", None)):
            raise TypeError(f"ParamAttr: initializer must be a minigraph.initializer (with an "
                            f"op method) or None, got {type(self.initializer).__name__}")
        for field, value, nullable in (("learning_rate", self.learning_rate, False),
                                       ("weight_decay", self.weight_decay, True)):
            if value is None and nullable:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
                    not math.isfinite(value) or value < 0:
                raise ValueError(f"ParamAttr: {field} must be a finite number >= 0"
                                 f"{' or None' if nullable else ''}, got {value!r}")
        if not isinstance(self.trainable, bool):
            raise TypeError(f"ParamAttr: trainable must be True or False, got "
                            f"{self.trainable!r}")


def as_param_attr(kind, arg, value):
    """`value` (a ParamAttr, a str naming the parameter, or None) as a ParamAttr; a
    TypeError naming the layer and the argument otherwise."""
    if value is None:
        return ParamAttr()
    if isinstance(value, str):
        return ParamAttr(name=value)
    if isinstance(value, ParamAttr):
        return value
    raise TypeError(f"{kind}: argument '{arg}' must be a ParamAttr, a str (the parameter's "
                    f"name) or None, got {type(value).__name__}")
