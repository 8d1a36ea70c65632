"""Op schemas and the registry: what an op is, before anything runs it.

An `OpSchema` declares an op's input and output slots, its typed attributes
(with defaults and checkers), in-place pairs, shape/dtype inference, its
kernels per place kind and its grad maker. Op modules in `minigraph.ops`
register schemas and kernels here; the runtime finds ops only through here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class OpError(ValueError):
    """A bad op: the message starts with the op type and names the slot or attribute."""


class Meta(NamedTuple):
    """What shape inference knows of a value: a shape (-1 for unknown dims) and a dtype."""

    shape: tuple
    dtype: np.dtype


@dataclass(frozen=True)
class Slot:
    """One input or output of an op. A duplicable slot takes a list of Variables."""

    name: str
    optional: bool = False
    duplicable: bool = False


@dataclass(frozen=True)
class Attr:
    """A typed attribute. `check(value)` returns a complaint string, or None when fine."""

    name: str
    types: tuple
    default: object = None
    check: Callable | None = None
    nullable: bool = False
    required: bool = False


@dataclass(frozen=True)
class OpDesc:
    """An op to be built later (what grad makers return): a type and its keyword args."""

    type: str
    kwargs: dict


@dataclass
class OpSchema:
    """Everything the runtime needs to know about one op type.

    infer(ins, attrs) -> {out_slot: Meta}: `ins` maps input slots to Meta
      (a list for duplicable slots, None when an optional one is unbound);
      it raises OpError for bad shapes or dtypes.
    grad(op, dout, make_grad) -> [OpDesc]: `dout` maps output slots to the
      Variable holding d(loss)/d(output) (None where nothing flows back);
      `make_grad(var)` gives the Variable to write d(loss)/d(var) into, or
      None when `var` needs no gradient.
    validate(op) raises OpError for rules that span slots and attributes.
    resolve_attrs(attrs) -> attrs turns checked attribute values into their
      stored form (an int into a pair, a None stride into the window size).
    kernels[kind](op, ins) -> {out_slot: array}: `ins` maps input slots to
      arrays; outputs the op leaves unbound may be skipped.
    """

    type: str
    inputs: tuple
    outputs: tuple
    attrs: tuple = ()
    inplace: dict = field(default_factory=dict)     # output slot -> input slot
    infer: Callable | None = None
    grad: Callable | None = None
    validate: Callable | None = None                # validate(op): cross-slot rules at build
    resolve_attrs: Callable | None = None           # resolve_attrs(dict) -> dict: canonical
                                                    # forms, defaults that depend on other attrs
    kernels: dict = field(default_factory=dict)
    kernel_dtypes: dict = field(default_factory=dict)   # kind -> float dtypes its kernel takes
    doc: str = ""

    def slot(self, name):
        for s in self.inputs + self.outputs:
            if s.name == name:
                return s
        return None

    def attr(self, name):
        for a in self.attrs:
            if a.name == name:
                return a
        return None

    def has_attr(self, name):
        return self.attr(name) is not None


_SCHEMAS: dict = {}


def register(schema):
    """Add `schema` to the registry; registering a type twice is an error."""
    if schema.type in _SCHEMAS:
        raise ValueError(f"op {schema.type!r} is already registered")
    _SCHEMAS[schema.type] = schema
    return schema


def kernel(op_type, kind, dtypes=None):
    """Decorator: register `fn(op, ins) -> outs` as `op_type`'s kernel on `kind` places.

    dtypes: the float dtypes the kernel is written for (None: any). The
    executor checks every float input against them once per input signature,
    so the kernel itself holds only arithmetic.
    """
    def deco(fn):
        schema = get_schema(op_type)
        schema.kernels[kind] = fn
        if dtypes is not None:
            schema.kernel_dtypes[kind] = tuple(np.dtype(d) for d in dtypes)
        return fn
    return deco


def get_schema(op_type):
    """The schema of `op_type`; an unknown type is an error listing the known ones."""
    try:
        return _SCHEMAS[op_type]
    except KeyError:
        raise OpError(f"unknown op type {op_type!r}; registered: "
                      f"{', '.join(sorted(_SCHEMAS))}") from None


def registered_ops():
    """Names of every registered op type, sorted."""
    return sorted(_SCHEMAS)


# ---- attribute checkers -------------------------------------------------------

def positive(v):
    return None if v > 0 else "must be > 0"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def in_range(lo, hi):
    def check(v):
        return None if lo <= v <= hi else f"must be in [{lo}, {hi}]"
    return check


def one_of(*choices):
    def check(v):
        return None if v in choices else f"must be one of {', '.join(map(repr, choices))}"
    return check


def float_attr(name, default, check=None, nullable=False):
    return Attr(name, (float, int, np.floating, np.integer), default, check, nullable)


def int_attr(name, default, check=None):
    return Attr(name, (int, np.integer), default, check)


def bool_attr(name, default):
    return Attr(name, (bool,), default)


def str_attr(name, default, check=None):
    return Attr(name, (str,), default, check)


def ints_attr(name, default, check=None):
    return Attr(name, (tuple, list), default, check)


# ---- shape and dtype helpers for infer functions ------------------------------

FLOATS = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))


def fail(op_type, slot, msg):
    """Raise the op error for input `slot`: "<op>: input 'x' <msg>"."""
    raise OpError(f"{op_type}: input {slot!r} {msg}")


def dims_equal(a, b):
    """Two dims agree when equal or when either is unknown (-1)."""
    return a == b or a < 0 or b < 0


def shapes_equal(a, b):
    return len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def check_float(op_type, slot, meta):
    if meta.dtype not in FLOATS:
        fail(op_type, slot, f"must be a float tensor (float16/32/64), got dtype {meta.dtype}")


def check_same_dtype(op_type, slot, meta, ref_slot, ref):
    if meta.dtype != ref.dtype:
        fail(op_type, slot, f"has dtype {meta.dtype} but input {ref_slot!r} has {ref.dtype}; "
                            "they must match")


def check_rank(op_type, slot, meta, ranks):
    if len(meta.shape) not in ranks:
        want = (f"{min(ranks)} to {max(ranks)}" if len(ranks) > 1 else str(ranks[0]))
        fail(op_type, slot, f"must have rank {want}, got rank {len(meta.shape)} "
                            f"(shape {meta.shape})")


def check_shape(op_type, slot, meta, shape, why=""):
    if not shapes_equal(meta.shape, shape):
        fail(op_type, slot, f"must have shape {tuple(shape)}{why}, got {meta.shape}")


def meta_of(value):
    """Meta of a concrete array."""
    return Meta(tuple(value.shape), np.dtype(value.dtype))
