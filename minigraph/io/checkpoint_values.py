"""The values a checkpoint may hold: what `minigraph.io.load` checks once names,
shapes and dtypes fit, before it assigns anything, and what `Variable.set` checks
on a persistable (`check`); and the part of a checkpoint each persistable
belongs to (`part_of`).

  * every floating-point value is finite (weights, estimates, optimizer state):
    a NaN estimate made every later step fail with a misleading error about
    its input, and an inf weight trains nothing;
  * every integer scalar is a counter and is >= 0: batch-norm counters (-1
    with momentum=None divided by zero), schedule steps (`<lr>.step` = -100
    with StepDecay(0.01, 2) gave a rate of about 1e48), GradientMerge steps,
    dropout steps;
  * batch-norm variance estimates (ops with the "batch_norm" role) are >= 0;
  * the learning rate is a finite number >= 0;
  * a ReduceOnPlateau state (`<lr>.plateau`: whether a best exists, the best,
    bad steps, cooldown left, steps taken) is one its step() can reach: a flag
    of 0 or 1, a best that is not NaN (an infinite metric makes an infinite
    best), whole numbers >= 0, and cooldown left at most the schedule's
    cooldown.

The rules beyond "finite" and "counter" are the Variable's `value_rule`, set by
whoever makes it (`variance`, `learning_rate`, `plateau(cooldown)`); `problems`
also finds the variance estimates of a net's batch-norm ops by their role.
"""
from __future__ import annotations

import numpy as np

SECTIONS = ("init", "trunk", "train", "infer", "backward", "update")
PARTS = ("parameters", "estimates", "optimizer")


def part_of(var):
    """The part of a checkpoint the persistable `var` belongs to: its `part` when
    its maker set one (layers' parameters: "parameters"; optimizers' state:
    "optimizer"), else "parameters" when it is trainable or was made from a
    ParamAttr, else "estimates" (running estimates, counters, dropout's step)."""
    if var.part is not None:
        return var.part
    return "parameters" if var.trainable or var.param_attr is not None else "estimates"


def check(var, value):
    """The complaint (str naming `var`) about `value` (a numpy array) as the value of
    the persistable `var`, or None: its value_rule, else the rule of its dtype."""
    rule = var.value_rule or _by_dtype(value)
    return rule(var.name, value) if rule is not None else None


def mark_rules(op):
    """Give the variance estimate an op with the "batch_norm" role updates the
    variance rule, so Variable.set checks it as a load does (Net calls it for
    every op it takes)."""
    if op.schema.has_role("batch_norm"):
        var = op.inputs.get("estimated_var")
        if var is not None and var.value_rule is None:
            var.value_rule = variance


def _by_dtype(value):
    if value.dtype.kind in "fc":
        return _finite
    if value.dtype.kind in "iu" and value.shape == ():
        return _counter
    return None


def learning_rate_var(net):
    """The learning-rate Variable of `net`'s optimizer (through GradientMerge), or None."""
    opt = getattr(net, "optimizer", None)
    return getattr(getattr(opt, "inner", opt), "lr_var", None)


def problems(net, values):
    """The complaints ([str], each naming the variable) about `values` ({name: numpy
    array}, a checkpoint's arrays for `net`'s persistables)."""
    special = {v.name: v.value_rule for v in net.persistables() if v.value_rule is not None}
    lr_var = learning_rate_var(net)
    if lr_var is not None:
        special.setdefault(lr_var.name, learning_rate)
    for section in SECTIONS:
        for op in net.section(section):
            if op.schema.has_role("batch_norm") and op.inputs.get("estimated_var"):
                special.setdefault(op.inputs["estimated_var"].name, variance)
    found = []
    for name, value in values.items():
        rule = special.get(name) or _by_dtype(value)
        complaint = rule(name, value) if rule is not None else None
        if complaint:
            found.append(complaint)
    return found


def _finite(name, value):
    bad = ~np.isfinite(value)
    if not bad.any():
        return None
    nans = int(np.isnan(value).sum())
    return (f"{name!r} holds non-finite values ({nans} NaN, {int(bad.sum()) - nans} inf, "
            f"the first at index {_first(bad)}); a checkpoint's values must be finite")


def variance(name, value):
    """The rule of a variance estimate: finite and >= 0."""
    complaint = _finite(name, value)
    if complaint is None and (value < 0).any():
        at = _first(value < 0)
        complaint = (f"variance estimate {name!r} holds {float(value[at])!r} at index {at}; a "
                     "variance must be >= 0")
    return complaint


def _counter(name, value):
    if int(value) < 0:
        return (f"counter {name!r} holds {int(value)}; a counter (of batches or steps) must "
                "be >= 0")
    return None


def learning_rate(name, value):
    """The rule of a learning rate: a finite number >= 0."""
    bad = [float(v) for v in np.ravel(value) if not (np.isfinite(v) and v >= 0)]
    if bad:
        return (f"learning rate {name!r} holds {bad[0]!r}; a learning rate must be a finite "
                "number >= 0")
    return None


def plateau(cooldown):
    """The rule of a ReduceOnPlateau state whose schedule has `cooldown`."""
    return lambda name, value: _plateau(name, value, cooldown)


def _plateau(name, value, cooldown):
    v = np.ravel(value).astype(np.float64)
    if v.size != 5:
        return f"ReduceOnPlateau state {name!r} holds {v.size} values, not 5"
    counts = np.delete(v, 1)
    if np.isnan(v[1]) or not np.isfinite(counts).all():
        return f"ReduceOnPlateau state {name!r} holds non-finite values ({v.tolist()}); " \
               "every value must be finite but the best, which may be infinite, never NaN"
    has_best, _, bad, cooling, steps = v.tolist()
    why = None
    if has_best not in (0.0, 1.0):
        why = f"its first value (whether a best exists) is {has_best!r}, not 0 or 1"
    else:
        for what, x, high in (("bad steps", bad, None), ("cooldown left", cooling, cooldown),
                              ("steps taken", steps, None)):
            if x < 0 or x != int(x):
                why = f"its {what} ({x!r}) must be a whole number >= 0"
            elif high is not None and x > high:
                why = f"its {what} ({x!r}) exceeds the schedule's cooldown ({high})"
            if why:
                break
    return None if why is None else f"ReduceOnPlateau state {name!r}: {why}"


def _first(mask):
    at = np.argwhere(mask)[0]
    return tuple(int(i) for i in at) if len(at) != 1 else int(at[0])
