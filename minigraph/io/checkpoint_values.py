"""The values a checkpoint may hold: what `minigraph.io.load` checks once names,
shapes and dtypes fit, before it assigns anything.

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
    of 0 or 1, whole numbers >= 0, and cooldown left at most the schedule's
    cooldown.
"""
from __future__ import annotations

import numpy as np

SECTIONS = ("init", "trunk", "train", "infer", "backward", "update")


def learning_rate_var(net):
    """The learning-rate Variable of `net`'s optimizer (through GradientMerge), or None."""
    opt = getattr(net, "optimizer", None)
    return getattr(getattr(opt, "inner", opt), "lr_var", None)


def problems(net, values):
    """The complaints ([str], each naming the variable) about `values` ({name: numpy
    array}, a checkpoint's arrays for `net`'s persistables)."""
    special = {}
    lr_var = learning_rate_var(net)
    if lr_var is not None:
        special[lr_var.name] = _learning_rate
    opt = getattr(net, "optimizer", None)
    schedule = getattr(getattr(opt, "inner", opt), "schedule", None)
    state_var = getattr(schedule, "state_var", None)
    if state_var is not None:
        special[state_var.name] = lambda name, v: _plateau(name, v, schedule.cooldown)
    variances = {op.inputs["estimated_var"].name for section in SECTIONS
                 for op in net.section(section)
                 if op.schema.has_role("batch_norm") and op.inputs.get("estimated_var")}
    found = []
    for name, value in values.items():
        check = special.get(name)
        if check is None:
            if value.dtype.kind in "fc":
                check = _variance if name in variances else _finite
            elif value.dtype.kind in "iu" and value.shape == ():
                check = _counter
        complaint = check(name, value) if check is not None else None
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


def _variance(name, value):
    complaint = _finite(name, value)
    if complaint is None and (value < 0).any():
        at = _first(value < 0)
        complaint = (f"variance estimate {name!r} holds {value[at]!r} at index {at}; a "
                     "variance must be >= 0")
    return complaint


def _counter(name, value):
    if int(value) < 0:
        return (f"counter {name!r} holds {int(value)}; a counter (of batches or steps) must "
                "be >= 0")
    return None


def _learning_rate(name, value):
    bad = [float(v) for v in np.ravel(value) if not (np.isfinite(v) and v >= 0)]
    if bad:
        return (f"learning rate {name!r} holds {bad[0]!r}; a learning rate must be a finite "
                "number >= 0")
    return None


def _plateau(name, value, cooldown):
    v = np.ravel(value).astype(np.float64)
    if v.size != 5:
        return f"ReduceOnPlateau state {name!r} holds {v.size} values, not 5"
    if not np.isfinite(v).all():
        return f"ReduceOnPlateau state {name!r} holds non-finite values ({v.tolist()}); " \
               "every value must be finite"
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
