"""Executor: runs a list of ops on a place, with feeds in and fetches out."""
from __future__ import annotations

import numpy as np

from minigraph.place import CPUPlace
from minigraph.schema import OpError
from minigraph.scope import Variable


class Executor:
    """Runs ops with the kernels registered for `place.kind`."""

    def __init__(self, place=None):
        self.place = place if place is not None else CPUPlace()

    def run(self, ops, scope, feed=None, fetch=None):
        """Feed, run `ops` in order, fetch.

        feed: {name: array}, each checked against the variable's declared
        dtype and shape (-1 matches any size) and copied to the place once.
        fetch: Variables or names looked up in `scope`; returned as numpy
        arrays in the same order (see `fetch_all` for device errors).
        """
        with self.place.activate():         # a GPU's context, once for the whole run
            for name, value in (feed or {}).items():
                self.feed(scope, name, value)
            for op in ops:
                self.run_op(op)
            return self.fetch_all(scope, fetch or [])

    def feed(self, scope, name, value):
        """Check `value` against the declaration of `name` and store it on the place."""
        var = scope.find_var(name)
        if var is None:
            raise KeyError(f"feed {name!r}: no such variable in the scope")
        value = check_feed(var, value)
        var.set(self.place.to_device(value))

    def fetch(self, scope, target):
        """The value of `target` (a Variable or a name) as a numpy array."""
        return self.fetch_all(scope, [target])[0]

    def fetch_all(self, scope, targets, check_errors=True):
        """The values of `targets` (Variables or names) as numpy arrays, copied
        out once each. When there is anything to fetch (and `check_errors`), the
        place first raises any error its kernels flagged on the device since the
        last check (`place.check_errors()`: GPU kernels cannot raise inside a step)."""
        found = []
        for target in targets:
            var = target if isinstance(target, Variable) else scope.find_var(target)
            if var is None:
                raise KeyError(f"fetch {target!r}: no such variable in the scope")
            if var.value is None:
                raise ValueError(f"fetch {var.name!r}: the variable has no value "
                                 "(no op that ran produced it)")
            found.append(var)
        if found and check_errors:
            self.place.check_errors()
        return [self.place.to_host(var.value) for var in found]

    def run_op(self, op):
        """Run one op: gather inputs, check them, call the kernel, store outputs."""
        fn = op.schema.kernels.get(self.place.kind)
        if fn is None:
            raise OpError(f"{op.type}: no kernel for {self.place!r}")
        ins = {}
        for slot, var in op.inputs.items():
            if var is None:
                ins[slot] = None
            elif isinstance(var, list):
                ins[slot] = [_value(op, slot, v) for v in var]
            else:
                ins[slot] = _value(op, slot, var)
        op.check_inputs(ins, self.place.kind)
        outs = fn(op, ins)
        for slot, value in outs.items():
            var = op.outputs.get(slot)
            if var is None:
                continue
            if isinstance(var, list):
                for v, x in zip(var, value):
                    v.value = x
            else:
                var.value = value


def check_feed(var, value):
    """`value` as an array matching `var`'s declared dtype and shape, or a clear error."""
    value = np.asarray(value)
    if var.decl_dtype is not None and value.dtype != var.decl_dtype:
        raise TypeError(f"feed {var.name!r}: expected dtype {var.decl_dtype}, got {value.dtype} "
                        f"(convert with .astype({str(var.decl_dtype)!r}))")
    shape = var.decl_shape
    if shape is not None and (len(shape) != value.ndim or
                              any(d >= 0 and d != s for d, s in zip(shape, value.shape))):
        want = "(" + ", ".join("N" if d < 0 else str(d) for d in shape) + ")"
        raise ValueError(f"feed {var.name!r}: expected shape {want}, got {value.shape}")
    return value


def _value(op, slot, var):
    v = var.value
    if v is None:
        raise OpError(f"{op.type}: input {slot!r} (variable {var.name!r}) has no value; "
                      "feed it or initialise it first")
    return v
