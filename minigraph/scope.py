"""Scopes and variables: where every value of a net lives.

A Scope is a node in a tree; `find_var` walks up to the parents, so a
branch's child scope sees the persistables held by the root.
"""
from __future__ import annotations

import numpy as np


class Variable:
    """A named slot holding one array (numpy on the CPU, a GPUArray on a GPU).

    `shape` and `dtype` come from the value once it is set, or from a
    declaration (a `data` layer, shape inference) before that; a declared
    shape may hold -1 for a dimension not known until a feed arrives.
    """

    __slots__ = ("name", "persistable", "trainable", "value", "decl_shape",
                 "decl_dtype", "is_data", "scope", "param_attr", "part", "value_rule")

    def __init__(self, name, persistable=False, trainable=False, scope=None):
        self.name = name
        self.persistable = persistable
        self.trainable = trainable
        self.value = None
        self.decl_shape = None
        self.decl_dtype = None
        self.is_data = False
        self.scope = scope
        self.param_attr = None          # the ParamAttr a layer made this parameter with
                                        # (its initializer: the one it was made with)
        # which part of a checkpoint a persistable belongs to ("parameters", "estimates",
        # "optimizer"; None: by its trainable flag, see minigraph.checkpoint_values.part_of)
        self.part = None
        # what its values must satisfy beyond the persistables' common rules (a function
        # (name, array) -> complaint or None; minigraph.checkpoint_values)
        self.value_rule = None

    def set(self, value):
        """Store a copy of `value` as the new value.

        Host values (numpy arrays and scalars, Python numbers and lists) are
        copied into a new C-contiguous numpy array, as Paddle's tensor.set
        copies: ops that later write the variable in place (a training step
        updating a parameter) never change the caller's array. Device arrays
        (a GPUArray of this variable's place) are stored as they are.

        A persistable takes an array (numpy or device) or a numpy scalar of the
        shape and dtype it holds (its value's, else its declaration's, where
        known): None, a list or another shape or dtype is an error, and the
        value stays as it was. A host value must also pass the checks a
        checkpoint's values pass (minigraph.checkpoint_values: finite floats,
        counters >= 0, variance estimates >= 0, a learning rate >= 0, ...); a
        device array is stored as it is.
        """
        if self.persistable:
            _check_persistable_value(self, value)
        if _is_host_value(value):
            value = np.array(value, order="C", copy=True)
            if self.persistable:
                from minigraph.io import checkpoint_values

                complaint = checkpoint_values.check(self, value)
                if complaint is not None:
                    raise ValueError(f"Variable.set: {complaint}; the value stays as it was")
        self.value = value

    def get(self):
        """A copy of the value as a numpy array (a host copy for device arrays): the
        caller's to keep and to write; later steps never change it and writing it
        never changes the variable."""
        v = self.value
        if v is None:
            raise ValueError(f"variable {self.name!r} has no value yet")
        if isinstance(v, np.ndarray):
            return v.copy()
        return host_array(self)

    @property
    def shape(self):
        """The shape of the value, else the declared shape, else None."""
        return tuple(self.value.shape) if self.value is not None else self.decl_shape

    @property
    def dtype(self):
        """The dtype of the value, else the declared dtype, else None."""
        return np.dtype(self.value.dtype) if self.value is not None else self.decl_dtype

    def declare(self, shape, dtype):
        """Record the shape and dtype this variable is expected to hold."""
        self.decl_shape = None if shape is None else tuple(int(d) for d in shape)
        self.decl_dtype = None if dtype is None else np.dtype(dtype)

    def __repr__(self):
        kind = "persistable " if self.persistable else ""
        return f"<Variable {kind}{self.name} shape={self.shape} dtype={self.dtype}>"


def _is_host_value(value):
    return isinstance(value, (np.ndarray, np.generic, int, float, complex, bool, list, tuple))


def host_array(var):
    """`var`'s value as a numpy array without a copy where it already is one (for the
    runtime's own reads, e.g. a save; Variable.get gives callers a copy)."""
    v = var.value
    if v is None:
        raise ValueError(f"variable {var.name!r} has no value yet")
    if isinstance(v, np.ndarray):
        return v
    if hasattr(v, "get"):            # a device array: copied out in its device's context
        from minigraph import device

        return device.to_host(v)
    return np.asarray(v)


def _check_persistable_value(var, value):
    """A TypeError or ValueError naming `var` unless `value` can be its value."""
    where = f"Variable.set: persistable {var.name!r}"
    if value is None or isinstance(value, (list, tuple, str, bytes, dict)):
        raise TypeError(f"{where} takes an array, got {type(value).__name__} {value!r:.60}; "
                        "pass a numpy array (np.asarray(...)) of its shape and dtype")
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        if isinstance(value, (int, float, bool, complex)):
            value = np.asarray(value)
        else:
            raise TypeError(f"{where} takes an array, got {type(value).__name__}")
    shape, dtype = var.shape, var.dtype
    if shape is not None and (len(value.shape) != len(shape) or any(
            d >= 0 and d != s for d, s in zip(shape, value.shape))):
        raise ValueError(f"{where} holds shape {tuple(shape)}, got shape {tuple(value.shape)}")
    if dtype is not None and np.dtype(value.dtype) != dtype:
        raise TypeError(f"{where} holds {dtype}, got {np.dtype(value.dtype)} (convert with "
                        f".astype({str(dtype)!r}))")


MAX_NAME_LENGTH = 255
GRAD_MARK = "@GRAD"          # backward names d(loss)/d(x) `x@GRAD` (`x@GRAD@1`, ...)


def check_reserved_name(name, scope=None):
    """Raise ValueError unless `name` may be given to a variable of a net that is not
    a gradient (a layer's output or parameter, a ParamAttr's name, a data input;
    Net makes them through this check): it must not hold GRAD_MARK (the names of
    gradients, which backward makes), must not be a `__dunder__` (the checkpoint
    files' own entries, `__format__`, `__manifest__`), and must not lie in a
    namespace `scope`'s tree reserved (`adam_0.`, the state of a net's optimizer;
    see Scope.reserve, which Scope.new_var checks for every name). The error
    gives the reason."""
    why = None
    if GRAD_MARK in name:
        why = (f"{GRAD_MARK!r} marks the gradients backward makes (d(loss)/d(x) is "
               f"'x{GRAD_MARK}'), so a variable of that name would receive one")
    elif name.startswith("__") and name.endswith("__"):
        why = ("names of the form '__name__' are the checkpoint files' own entries "
               "('__format__', '__manifest__'), so it could not be saved")
    elif scope is not None:
        why = _reserved_prefix(name, scope)
    if why is not None:
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise ValueError(f"variable name {shown!r} is reserved: {why}; pick another name")


def _reserved_prefix(name, scope):
    for prefix, owner in _root(scope).reserved.items():
        if name.startswith(prefix + "."):
            return (f"the names under '{prefix}.' are the state of {owner}, named after "
                    "it so that checkpoints never mix it up with other state")
    return None


def _root(scope):
    while scope.parent is not None:
        scope = scope.parent
    return scope


def check_var_name(name):
    """Raise ValueError unless `name` is a valid variable name: a non-empty str
    of at most MAX_NAME_LENGTH printable characters, with no path separator
    ('/' or '\\'), no NUL and not '.' or '..'. So no name can smuggle a path
    into a checkpoint entry or a model file."""
    if not isinstance(name, str):
        raise TypeError(f"variable name {name!r}: must be a str, got {type(name).__name__}")
    rule = None
    if not name:
        rule = "must not be empty"
    elif len(name) > MAX_NAME_LENGTH:
        rule = f"must be at most {MAX_NAME_LENGTH} characters long, got {len(name)}"
    elif "/" in name or "\\" in name:
        rule = "must not contain a path separator ('/' or '\\')"
    elif "\0" in name:
        rule = "must not contain NUL"
    elif not name.isprintable():
        rule = "must hold printable characters only (no control characters or line breaks)"
    elif name in (".", ".."):
        rule = "must not be '.' or '..'"
    if rule is not None:
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise ValueError(f"variable name {shown!r}: {rule}")


class Scope:
    """A tree of name → Variable tables; lookups fall back to the parent."""

    def __init__(self, parent=None):
        self.parent = parent
        self.vars = {}
        self.kids = []
        self.reserved = {}              # prefix -> who owns the names under `prefix.`

    def new_var(self, name, persistable=False, trainable=False):
        """Create `name` here; creating a name twice in one scope is an error, and
        so is a name that check_var_name rejects or that lies in a namespace this
        tree reserved (Scope.reserve); the error names the rule."""
        check_var_name(name)
        why = _reserved_prefix(name, self) if _root(self).reserved else None
        if why is not None:
            raise ValueError(f"variable name {name!r} is reserved: {why}; pick another name")
        if name in self.vars:
            raise ValueError(f"variable {name!r} already exists in this scope")
        var = Variable(name, persistable=persistable, trainable=trainable, scope=self)
        self.vars[name] = var
        return var

    def reserve(self, prefix, owner):
        """Reserve the names under `prefix.` in this scope tree for `owner` (a phrase:
        "the Adam optimizer 'adam_0'"): new_var refuses them from now on."""
        _root(self).reserved[prefix] = owner

    def find_local_var(self, name):
        """The variable named `name` in this scope only, or None."""
        return self.vars.get(name)

    def find_var(self, name):
        """The variable named `name` here or in the nearest ancestor, or None."""
        scope = self
        while scope is not None:
            var = scope.vars.get(name)
            if var is not None:
                return var
            scope = scope.parent
        return None

    def new_scope(self):
        """A new child scope whose lookups fall back to this one."""
        kid = Scope(parent=self)
        self.kids.append(kid)
        return kid

    def drop_kids(self):
        """Forget every child scope (and the variables they hold)."""
        self.kids.clear()

    def __contains__(self, name):
        return self.find_var(name) is not None

    def __repr__(self):
        return f"<Scope {len(self.vars)} vars, {len(self.kids)} kids>"
