"""What every layer shares: naming, all-or-nothing building, a record for
net.summary(), and the argument checks whose errors name the layer and the argument.

A layer is a function `layer(net, inputs..., name=None, ...)` decorated with
`@layer("kind")` (`@layer("kind", role="loss")` for a loss, "metric" for a
metric: the inference passes leave those out): the decorator checks the net
and the name (an unnamed
layer gets `kind_k`, skipping names already used), builds inside
`net.building()` (a layer that raises leaves no op, variable, parameter or
name behind, so a retry with the same name works), and records what the
layer built (`net.layers`), and names the layer on each op it built
(`Operator.layer`). Write a new layer with `net.append(op_type,
inputs, outputs, attrs)` and `net.create_parameter(...)` inside such a
function (see docs/adding_an_op.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from minigraph.param_attr import as_param_attr
from minigraph.scope import Variable
from minigraph.validators import check_number, is_int


@dataclass(frozen=True)
class LayerRecord:
    """What one layer call built: its name and kind, the types of the ops it
    appended (train path), its output's shape, the persistables it created and
    its role ("loss", "metric" or None);
    `trainable` / `non_trainable` count their values by their current flags (a
    parameter frozen after the build counts as non-trainable)."""

    name: str
    kind: str
    op_types: tuple
    output_shape: tuple | None
    made: tuple
    role: str | None = None

    @property
    def trainable(self):
        return sum(_size(v) for v in self.made if v.trainable)

    @property
    def non_trainable(self):
        return sum(_size(v) for v in self.made if not v.trainable)


LAYER_ROLES = (None, "loss", "metric")


def layer(kind, role=None):
    """Decorator for layer functions (see the module doc); role: one of LAYER_ROLES."""
    if role not in LAYER_ROLES:
        raise ValueError(f"layer {kind!r}: role must be one of {LAYER_ROLES}, got {role!r}")

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(net, *args, name=None, **kwargs):
            from minigraph.net import Net

            if not isinstance(net, Net):
                raise TypeError(f"{kind}: the first argument must be the Net to build in, got "
                                f"{type(net).__name__}")
            with net.building():
                name = _layer_name(net, kind, name)
                before = {s: len(net.section(s)) for s in ("trunk", "train", "infer")}
                vars_before = set(net.scope.vars)
                out = fn(net, *args, name=name, **kwargs)
                built = {s: net.section(s)[n:] for s, n in before.items()}
                for op in built["trunk"] + built["train"] + built["infer"]:
                    if op.layer is None:        # a layer called inside this one named its own
                        op.layer = name
                ops = built["trunk"] + built["train"]
                made = [v for n, v in net.scope.vars.items()
                        if n not in vars_before and v.persistable]
                net.layers.append(LayerRecord(
                    name, kind, tuple(op.type for op in ops),
                    tuple(out.shape) if isinstance(out, Variable) and out.shape is not None
                    else None, tuple(made), role))
            return out
        return wrapper
    return deco


def _layer_name(net, kind, name):
    if name is None:
        return net.unique_name(kind)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind}: name must be a non-empty str, got {name!r}")
    if net.name_taken(name):
        raise ValueError(f"{kind}: the name {name!r} is already used in this net; pick "
                         "another (or leave name=None for a fresh one)")
    return name


def _size(var):
    return math.prod(var.shape) if var.shape is not None else 0


# ---- argument checks ------------------------------------------------------------------

def tensor(net, kind, arg, x, float_only=False):
    """`x` checked as a Variable of `net` (a float one with float_only)."""
    if not isinstance(x, Variable):
        raise TypeError(f"{kind}: argument '{arg}' must be a Variable of the net, got "
                        f"{type(x).__name__}")
    if not net.owns(x):
        raise ValueError(f"{kind}: argument '{arg}' ({x.name!r}) is a Variable of another net")
    if float_only and x.dtype is not None and np.dtype(x.dtype).kind != "f":
        raise TypeError(f"{kind}: argument '{arg}' must be a float tensor, got {x.name!r} of "
                        f"dtype {x.dtype}")
    return x


def known_dims(kind, arg, x, axes):
    """x's shape, with the sizes on `axes` known (an error naming them otherwise)."""
    shape = x.shape
    if shape is None or any(shape[d] < 0 for d in axes):
        raise ValueError(f"{kind}: argument '{arg}' ({x.name!r}) needs known sizes on axes "
                         f"{tuple(axes)}, got shape {shape}")
    return shape


def known_rank(kind, x):
    """x's shape (its rank must be known when a layer is built)."""
    if x.shape is None:
        raise ValueError(f"{kind}: the shape of {x.name!r} is unknown; declare it (data) or "
                         "compute it from inputs whose shapes are known")
    return x.shape


def int_arg(kind, arg, value, minimum=1):
    """`value` as an int >= minimum, else an error naming the argument."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{kind}: argument '{arg}' must be an int >= {minimum}, got {value!r}")
    return int(value)


def pair_arg(kind, arg, value, minimum=1):
    """An int or a pair of ints, each >= minimum, as a tuple of two ints."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2 or not all(is_int(v) and v >= minimum for v in items):
        raise ValueError(f"{kind}: argument '{arg}' must be an int or a pair of ints >= "
                         f"{minimum}, got {value!r}")
    return (int(items[0]), int(items[1]))


def float_arg(kind, arg, value, low=-math.inf, high=math.inf, high_open=False):
    """`value` as a finite float in [low, high] (or [low, high)), else an error naming
    the layer and the argument."""
    return check_number(value, f"{kind}: argument '{arg}'", low, high, high_open)


def axis_arg(kind, arg, value, rank):
    """An int axis in [-rank, rank), as a non-negative int."""
    if not is_int(value) or not -rank <= value < rank:
        raise ValueError(f"{kind}: argument '{arg}' must be an int in [{-rank}, {rank}) for a "
                         f"rank-{rank} input, got {value!r}")
    return int(value) % rank


def parameter(net, kind, arg, attr, default_name, shape, dtype, default_init, fan_in=None,
              fan_out=None):
    """The parameter a layer's `arg` (a ParamAttr, its name, or None) asks for: a new
    persistable made with the attr's initializer (else `default_init`), or, when the
    attr names one this net already has, that one - shared, after checking its shape,
    dtype, settings and initializer agree (an error naming the layer and the argument
    otherwise; a later use that gives no initializer takes the first one's)."""
    attr = as_param_attr(kind, arg, attr)
    name = attr.name or default_name
    shape, dtype = tuple(shape), np.dtype(dtype)
    existing = net.scope.find_local_var(name) if attr.name is not None else None
    if existing is not None:
        if not existing.persistable or existing.param_attr is None:
            raise ValueError(f"{kind}: argument '{arg}' names {name!r}, which is not a "
                             "parameter made by a layer")
        if tuple(existing.shape) != shape or np.dtype(existing.dtype) != dtype:
            raise ValueError(f"{kind}: argument '{arg}' names the shared parameter {name!r} of "
                             f"shape {tuple(existing.shape)} and dtype {existing.dtype}; this "
                             f"layer needs shape {shape} and dtype {dtype}")
        ours = (attr.learning_rate, attr.weight_decay, attr.trainable)
        theirs = (existing.param_attr.learning_rate, existing.param_attr.weight_decay,
                  existing.param_attr.trainable)
        if ours != theirs:
            raise ValueError(f"{kind}: argument '{arg}' shares {name!r} with other settings "
                             f"(learning_rate, weight_decay, trainable) = {ours} than its first "
                             f"use's {theirs}")
        first = existing.param_attr.initializer
        if attr.initializer is not None and attr.initializer != first:
            raise ValueError(f"{kind}: argument '{arg}' shares {name!r} with the initializer "
                             f"{attr.initializer!r}, but its first use initialised it with "
                             f"{first!r}; a shared parameter has one initializer (give the "
                             "same one, or none, to share it)")
        return existing
    init = attr.initializer or default_init
    var = net.create_parameter(name, shape, dtype, init, trainable=attr.trainable,
                               fan_in=fan_in, fan_out=fan_out)
    var.param_attr = dataclasses.replace(attr, initializer=init)     # the one it was made with
    return var
