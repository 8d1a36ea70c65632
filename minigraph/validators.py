"""Checks shared by op schemas, layers and optimizers: one place for each rule.

Attribute declarations (`float_attr`, `int_attr`, ...) and their checkers
(`positive`, `in_range`, ...) for OpSchema.attrs; shape and dtype checks for
schema inference (`check_float`, `check_rank`, `check_shape`, ...), each
raising an OpError that names the op and the input slot; and the value
checks of the Python API (`is_int`, `check_number`).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from minigraph.schema import Attr, OpError

FLOATS = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))


# ---- plain values ---------------------------------------------------------------

def is_int(v):
    """True for an integer that is not a bool (numpy integers included)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_number(value, what, low=0.0, high=math.inf, high_open=False, low_open=False):
    """`value` as a float when it is a real number in the range, else a ValueError
    naming `what` (NaN, inf, bools and non-numbers included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if not math.isfinite(v) or too_low or too_high:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{what} must be a finite number in {lo}{low:g}, {high:g}{hi}, "
                         f"got {value!r}")
    return v


# ---- attribute checkers: check(value) -> a complaint, or None ----------------------

def positive(v):
    return None if v > 0 else "must be > 0"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def finite(v):
    return None if np.isfinite(v) else "must be a finite number"


def in_range(lo, hi):
    def check(v):
        return None if lo <= v <= hi else f"must be in [{lo}, {hi}]"
    return check


def one_of(*choices):
    def check(v):
        return None if v in choices else f"must be one of {', '.join(map(repr, choices))}"
    return check


# ---- attribute declarations -------------------------------------------------------

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


def pair_attr(name, default, minimum, nullable=False):
    """An attribute given as an int or a pair of ints, each >= `minimum`;
    `as_pair` turns it into the stored (h, w) tuple."""
    def check(v):
        vals = v if isinstance(v, tuple) else (v,)
        if isinstance(v, tuple) and len(v) != 2 or not all(is_int(d) for d in vals):
            return "must be an int or a pair of ints"
        if any(d < minimum for d in vals):
            return f"must be >= {minimum}"
        return None
    return Attr(name, (tuple, list, numbers.Integral), default, check, nullable)


def as_pair(v):
    """An int or a pair as a tuple of two Python ints (None stays None)."""
    if v is None:
        return None
    if is_int(v):
        return (int(v), int(v))
    return (int(v[0]), int(v[1]))


def out_size(size, k, stride, pad, dilation=1):
    """floor((size + 2 pad - dilation (k - 1) - 1) / stride) + 1; -1 when size or k is unknown."""
    if size < 0 or k < 0:
        return -1
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


# ---- shapes and dtypes, for schema inference --------------------------------------

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


def infer_as(op_type, base_type, infer, ins, attrs):
    """infer(ins, attrs) of `base_type`, the op `op_type` extends (a fused op), with its
    errors naming `op_type`."""
    try:
        return infer(ins, attrs)
    except OpError as e:
        raise OpError(str(e).replace(f"{base_type}:", f"{op_type}:", 1)) from None


def check_extra_input(op_type, slot, meta, x, shape, why):
    """An optional input added to an op's result (a fused op's bias or residual): x's
    dtype and `shape`; `why` says what the shape is."""
    if meta is not None:
        check_same_dtype(op_type, slot, meta, "x", x)
        check_shape(op_type, slot, meta, shape, why)


def check_rank(op_type, slot, meta, ranks):
    if len(meta.shape) not in ranks:
        want = (f"{min(ranks)} to {max(ranks)}" if len(ranks) > 1 else str(ranks[0]))
        fail(op_type, slot, f"must have rank {want}, got rank {len(meta.shape)} "
                            f"(shape {meta.shape})")


def check_shape(op_type, slot, meta, shape, why=""):
    if not shapes_equal(meta.shape, shape):
        fail(op_type, slot, f"must have shape {tuple(shape)}{why}, got {meta.shape}")


def normalized_axis(op_type, axis, rank, slot="x", attr="axis"):
    """`axis` as an index in [0, rank); an OpError naming attribute `attr` and input `slot`
    when it is outside [-rank, rank)."""
    if not -rank <= axis < rank:
        raise OpError(f"{op_type}: attribute {attr!r} must be in [{-rank}, {rank}) for input "
                      f"{slot!r} of rank {rank}, got {axis}")
    return axis % rank

