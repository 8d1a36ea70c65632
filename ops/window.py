"""Helpers shared by the windowed ops (conv2d, pool2d): pair attributes and
the strided slices of a padded NCHW array that one window offset touches.
Not an op module: it registers nothing.
"""
from __future__ import annotations

import numbers

import numpy as np

from minigraph.schema import Attr


def is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


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


def pad_hw(x, paddings, value=0.0):
    """x (N, C, H, W) padded by paddings=(ph, pw) on both sides of H and W."""
    ph, pw = paddings
    if ph == 0 and pw == 0:
        return x
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def offset_slices(i, j, out_hw, strides, dilations=(1, 1)):
    """Index of the padded array holding tap (i, j) of every window: an
    (N, C, Ho, Wo) strided view."""
    (ho, wo), (sh, sw), (dh, dw) = out_hw, strides, dilations
    return (slice(None), slice(None),
            slice(i * dh, i * dh + sh * (ho - 1) + 1, sh),
            slice(j * dw, j * dw + sw * (wo - 1) + 1, sw))
