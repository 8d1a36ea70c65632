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
    """One input or output of an op. A duplicable slot takes a list of Variables.
    shape_only: the kernels read only the input's shape and dtype, never its values
    (a training step may then drop the values early; see minigraph.run)."""

    name: str
    optional: bool = False
    duplicable: bool = False
    shape_only: bool = False


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
      `grad_maker(...)` builds the usual one from a declaration.
    validate(op) raises OpError for rules that span slots and attributes.
    resolve_attrs(attrs) -> attrs turns checked attribute values into their
      stored form (an int into a pair, a None stride into the window size).
    kernels[kind](op, ins) -> {out_slot: array}: `ins` maps input slots to
      arrays; outputs the op leaves unbound may be skipped.

    What graph rewrites may ask of an op (declared here, never matched by
    its type name outside ops/):
    mode_attr: the bool attribute that says "inference" (batch_norm's and
      dropout's `is_infer`); a Net forks at the first op that declares one.
    roles: the jobs other modules look this op up for (`op_for_role`):
      "accumulate" (sums a list of gradients), "fill" (a constant tensor).
    presummed(op) -> output slots whose values are already sums over every
      rank and identical on each (sync_batch_norm_grad's dscale and dbias).
    replication: "always" when the outputs are identical on every rank (an
      op that averages presummed values), "inputs" when they are whenever
      every input is (a sum), None otherwise.
    reuse: output slot -> input slots whose array the CPU kernel may write
      that output into (Paddle's inplace inferer): when a training step hands
      one over (the input's value dies at this op and nothing else refers to
      its memory; see minigraph.run), the kernel is called as
      kernels["cpu"](op, ins, donated=(input slots,)) and may overwrite those
      inputs; otherwise kernels never write their inputs.
    work_room: the CPU kernel's speed grows with its work arrays, and a training
      step, once it has measured its memory op by op (minigraph.work_room),
      calls it as kernels["cpu"](op, ins, room=bytes): the memory its work may
      take at this op without raising the step's peak. Called without `room`,
      it keeps its work lean.
    """

    type: str
    inputs: tuple
    outputs: tuple
    attrs: tuple = ()
    inplace: dict = field(default_factory=dict)     # output slot -> input slot
    reuse: dict = field(default_factory=dict)       # output slot -> input slots (tuple)
    work_room: bool = False                         # the CPU kernel takes room=bytes
    infer: Callable | None = None
    grad: Callable | None = None
    validate: Callable | None = None                # validate(op): cross-slot rules at build
    resolve_attrs: Callable | None = None           # resolve_attrs(dict) -> dict: canonical
                                                    # forms, defaults that depend on other attrs
    kernels: dict = field(default_factory=dict)
    kernel_dtypes: dict = field(default_factory=dict)   # kind -> float dtypes its kernel takes
    mode_attr: str | None = None
    roles: tuple = ()
    presummed: Callable | None = None
    replication: str | None = None
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
_ROLES: dict = {}


def register(schema):
    """Add `schema` to the registry; registering a type twice, or a second op
    for the same role, is an error."""
    if schema.type in _SCHEMAS:
        raise ValueError(f"op {schema.type!r} is already registered")
    if schema.mode_attr is not None and bool not in getattr(schema.attr(schema.mode_attr),
                                                            "types", ()):
        raise ValueError(f"op {schema.type!r}: mode_attr {schema.mode_attr!r} must name one of "
                         "its bool attributes")
    for role in schema.roles:
        if role in _ROLES:
            raise ValueError(f"op {schema.type!r}: role {role!r} is already taken by "
                             f"{_ROLES[role]!r}")
    _SCHEMAS[schema.type] = schema
    _ROLES.update(dict.fromkeys(schema.roles, schema.type))
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


def op_for_role(role):
    """The op type registered for `role` (see OpSchema.roles); an error naming the
    roles there are when none is."""
    try:
        return _ROLES[role]
    except KeyError:
        raise OpError(f"no op registered for the role {role!r}; roles: "
                      f"{', '.join(sorted(_ROLES)) or '(none)'}") from None


def registered_ops():
    """Names of every registered op type, sorted."""
    return sorted(_SCHEMAS)


def grad_maker(grad_type, keep=("x",), dout=None, wrt=("x",), attrs=True):
    """The usual grad maker, declared in one line (Paddle's DefaultGradOpMaker).

    The maker builds one `grad_type` op whose slots are: each name in `keep`
    bound to the forward op's input or output of that name; the incoming
    gradients, `dout` mapping forward output slots to grad input slots
    (default {"out": "dout"}); and `d<slot>` for each input slot in `wrt`,
    bound to make_grad(that input). attrs=True copies every attribute, a
    tuple copies those named, False none. It builds nothing when no incoming
    gradient is bound or no input in `wrt` needs a gradient.
    """
    dout = {"out": "dout"} if dout is None else dict(dout)

    def make(op, douts, make_grad):
        incoming = {g: douts.get(f) for f, g in dout.items()}
        if all(d is None for d in incoming.values()):
            return []
        grads = {f"d{slot}": make_grad(op.inputs[slot]) for slot in wrt}
        if all(g is None for g in grads.values()):
            return []
        kwargs = {s: op.inputs[s] if s in op.inputs else op.outputs[s] for s in keep}
        kwargs.update(incoming)
        kwargs.update(grads)
        if attrs:
            kwargs.update({k: v for k, v in op.attrs.items() if attrs is True or k in attrs})
        return [OpDesc(grad_type, kwargs)]

    make.grad_type = grad_type
    return make


def grad_schema(forward, inputs, outputs, infer=None, **fields):
    """The schema of `forward`'s grad op, `<type>_grad`: the given slots, and
    the forward's attributes (with their checks and canonical forms)."""
    return OpSchema(type=forward.type + "_grad", inputs=tuple(inputs), outputs=tuple(outputs),
                    attrs=forward.attrs, resolve_attrs=forward.resolve_attrs, infer=infer,
                    **fields)


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
