"""Operator: an op type with its slots bound to Variables and frozen attributes."""
from __future__ import annotations

from collections.abc import Mapping

from minigraph.schema import Meta, OpDesc, OpError, get_schema, meta_of
from minigraph.scope import Variable


class FrozenAttrs(Mapping):
    """A read-only mapping of attribute values: assigning to it raises."""

    __slots__ = ("_op_type", "_values")

    def __init__(self, op_type, values):
        object.__setattr__(self, "_op_type", op_type)
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __setitem__(self, key, value):
        raise TypeError(f"{self._op_type}: attributes are immutable (tried to set {key!r}); "
                        "build a new Operator with the value you want")

    def __delitem__(self, key):
        self[key] = None

    def __setattr__(self, key, value):
        raise TypeError(f"{self._op_type}: attributes are immutable")

    def __repr__(self):
        return repr(self._values)


class Operator:
    """An op type bound to Variables, validated when it is built.

    `Operator("batch_norm", x=x, ..., y=y, epsilon=1e-5)`: keyword names are
    the schema's slots and attributes. Unknown or missing names, a slot bound
    to something other than a Variable (a list of them for duplicable slots),
    a bad attribute type or value, and an in-place pair bound to two
    different Variables are errors. When the inputs' shapes are known, the
    outputs get their declared shape and dtype from the schema's inference.

    `layer` names the layer that built the op (set by the layer API, kept by
    the Net's rewrites and by the inference passes, saved in an inference
    model); None for an op no layer built.
    """

    def __init__(self, type, **kwargs):
        schema = get_schema(type)
        self.type = type
        self.schema = schema
        self.layer = None
        self.inputs = {}
        self.outputs = {}
        attrs = {}
        valid = [s.name for s in schema.inputs + schema.outputs] + [a.name for a in schema.attrs]
        for name in kwargs:
            if schema.slot(name) is None and schema.attr(name) is None:
                raise OpError(f"{type}: unknown slot or attribute {name!r}; "
                              f"valid names: {', '.join(valid)}")
        for slots, bound in ((schema.inputs, self.inputs), (schema.outputs, self.outputs)):
            for slot in slots:
                bound[slot.name] = _bind(type, slot, kwargs.get(slot.name), valid)
        for attr in schema.attrs:
            attrs[attr.name] = _attr_value(type, attr, kwargs)
        for out_slot, in_slot in schema.inplace.items():
            out, src = self.outputs[out_slot], self.inputs[in_slot]
            if not _same_vars(out, src):
                raise OpError(f"{type}: output {out_slot!r} must be the same Variable as "
                              f"input {in_slot!r} (they are an in-place pair); got "
                              f"{_name(out)} and {_name(src)}")
        if schema.resolve_attrs is not None:
            attrs = schema.resolve_attrs(attrs)
        self._attrs = FrozenAttrs(type, attrs)
        if schema.validate is not None:
            schema.validate(self)
        self._declare_outputs()

    @property
    def attrs(self):
        """The attributes, read-only."""
        return self._attrs

    def wants(self, slot):
        """True when output `slot` is bound (kernels skip unbound optional outputs)."""
        return self.outputs.get(slot) is not None

    def input_vars(self):
        """Every bound input Variable, in slot order."""
        return _flatten(self.inputs)

    def output_vars(self):
        """Every bound output Variable, in slot order."""
        return _flatten(self.outputs)

    def in_place_outputs(self):
        """The bound Variables of the in-place output slots (each list flattened)."""
        return _flatten({slot: self.outputs.get(slot) for slot in self.schema.inplace})

    def infer(self, metas):
        """Run the schema's shape/dtype inference on input metas; returns output metas."""
        if self.schema.infer is None:
            return {}
        return self.schema.infer(metas, self._attrs)

    def check_inputs(self, arrays):
        """Validate concrete input arrays ({slot: array, list or None}) with the
        schema's shape and dtype inference (the runner calls this once per input
        signature of a plan)."""
        self.infer({slot: _meta(a) for slot, a in arrays.items()})

    def _declare_outputs(self):
        metas = {}
        for slot, var in self.inputs.items():
            if var is None:
                metas[slot] = None
                continue
            vs = var if isinstance(var, list) else [var]
            ms = [Meta(v.shape, v.dtype) for v in vs]
            if any(m.shape is None or m.dtype is None for m in ms):
                return                                   # not enough known yet
            metas[slot] = ms if isinstance(var, list) else ms[0]
        for slot, meta in self.infer(metas).items():
            var = self.outputs.get(slot)
            if var is None or slot in self.schema.inplace:
                continue
            for v, m in zip(var, meta) if isinstance(var, list) else [(var, meta)]:
                if v.value is None:
                    v.declare(m.shape, m.dtype)

    def __repr__(self):
        def show(d):
            return ", ".join(f"{k}={_name(v)}" for k, v in d.items() if v is not None)
        return (f"<Operator {self.type}({show(self.inputs)}) -> ({show(self.outputs)}) "
                f"{dict(self._attrs)}>")


def as_operator(op):
    """`op` when it is an Operator, an Operator built from it when it is an OpDesc; a
    TypeError otherwise."""
    if isinstance(op, OpDesc):
        return Operator(op.type, **op.kwargs)
    if not isinstance(op, Operator):
        raise TypeError(f"expected an Operator or an OpDesc, got {type(op).__name__}")
    return op


def _same_vars(a, b):
    """True when `a` and `b` bind the same Variable, or lists of the same Variables."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    return a is b


def _bind(op_type, slot, value, valid):
    if value is None:
        if not slot.optional:
            raise OpError(f"{op_type}: missing slot {slot.name!r}; valid names: {', '.join(valid)}")
        return None
    if slot.duplicable:
        if isinstance(value, Variable):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, Variable) for v in value):
            raise OpError(f"{op_type}: slot {slot.name!r} takes a list of Variables, got {value!r}")
        return list(value)
    if not isinstance(value, Variable):
        raise OpError(f"{op_type}: slot {slot.name!r} takes a Variable, got {type(value).__name__}")
    return value


def _attr_value(op_type, attr, kwargs):
    if attr.name not in kwargs:
        if attr.required:
            raise OpError(f"{op_type}: missing attribute {attr.name!r}")
        return attr.default
    value = kwargs[attr.name]
    if value is None and attr.nullable:
        return None
    if isinstance(value, bool) and bool not in attr.types:
        ok = False                                     # True is not a number here
    else:
        ok = isinstance(value, attr.types)
    if not ok:
        want = " or ".join(_type_names(attr.types) + (["None"] if attr.nullable else []))
        raise OpError(f"{op_type}: attribute {attr.name!r} must be {want}, "
                      f"got {type(value).__name__} {value!r}")
    if float in attr.types:
        value = float(value)
    elif int in attr.types and not isinstance(value, (int, bool)):
        value = int(value)
    if isinstance(value, list):
        value = tuple(value)
    if attr.check is not None:
        complaint = attr.check(value)
        if complaint:
            raise OpError(f"{op_type}: attribute {attr.name!r} {complaint}, got {value!r}")
    return value


def _type_names(types):
    names = []
    for t in types:
        name = {"Integral": "int", "Real": "float"}.get(t.__name__, t.__name__)
        if t.__module__ in ("builtins", "numbers") and name not in names:
            names.append(name)
    return names


def _flatten(bound):
    out = []
    for v in bound.values():
        if isinstance(v, list):
            out.extend(v)
        elif v is not None:
            out.append(v)
    return out


def _name(v):
    if isinstance(v, list):
        return "[" + ", ".join(x.name for x in v) + "]"
    return v.name if v is not None else "None"


def _meta(a):
    if a is None:
        return None
    if isinstance(a, list):
        return [meta_of(x) for x in a]
    return meta_of(a)
