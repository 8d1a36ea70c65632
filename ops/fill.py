"""fill_constant, uniform_random, gaussian_random: ops with no inputs that make a tensor.

The random ops draw from `np.random.default_rng(seed)` afresh on every run, so
one seed always gives the same values. None of them has a gradient.
GPU: fill_constant fills on the device (one launch, also inside a step). The
random ops draw on the host with the same generator and copy the values in
once, so a seed initialises a net identically on every place; they are
initialisers and do not run inside a step. (minigraph.kernels.fill has a
device-side Philox generator, but its stream is not numpy's.)
"""
from __future__ import annotations

import numbers

import numpy as np

from minigraph.kernels import fill as gpu
from minigraph.kernels import loader
from minigraph.schema import Attr, Meta, OpError, OpSchema, Slot, kernel, register
from minigraph.validators import float_attr, int_attr, non_negative


def check_shape_attr(v):
    """A complaint unless `v` is a tuple of ints >= 0."""
    if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in v):
        return "must be a tuple of ints >= 0"
    return None


def check_dtype_attr(kinds):
    """A checker: the attribute must name a numpy dtype of one of `kinds` ('f', 'i', ...)."""
    def check(v):
        try:
            dt = np.dtype(v)
        except TypeError:
            return "must name a numpy dtype"
        if dt.kind not in kinds:
            return "must be a float dtype" if kinds == "f" else "must be a numeric dtype"
        return None
    return check


def resolve(attrs):
    """Stored form: the shape as a tuple of Python ints, the dtype by its canonical name."""
    return {**attrs, "shape": tuple(int(d) for d in attrs["shape"]),
            "dtype": np.dtype(attrs["dtype"]).name}


def infer_fill(ins, attrs):
    return {"out": Meta(attrs["shape"], np.dtype(attrs["dtype"]))}


def fill_schema(op_type, dtype_kinds, extra_attrs, validate=None, roles=()):
    return OpSchema(
        type=op_type, inputs=(), outputs=(Slot("out"),),
        attrs=(Attr("shape", (tuple, list), (), check_shape_attr, required=True),
               Attr("dtype", (str,), "float32", check_dtype_attr(dtype_kinds)))
        + extra_attrs,
        infer=infer_fill, resolve_attrs=resolve, validate=validate, roles=roles, doc=__doc__)


def validate_uniform(op):
    if not op.attrs["min"] <= op.attrs["max"]:
        raise OpError(f"{op.type}: attribute 'min' ({op.attrs['min']}) must be <= "
                      f"attribute 'max' ({op.attrs['max']})")


register(fill_schema("fill_constant", "biuf", (float_attr("value", 0.0),), roles=("fill",)))
register(fill_schema("uniform_random", "f", (float_attr("min", -1.0), float_attr("max", 1.0),
                                             int_attr("seed", 0, non_negative)),
                     validate_uniform))
register(fill_schema("gaussian_random", "f", (float_attr("mean", 0.0),
                                              float_attr("std", 1.0, non_negative),
                                              int_attr("seed", 0, non_negative))))


@kernel("fill_constant", "cpu")
def fill_constant_cpu(op, ins, ctx):
    """out = an array of `shape` and `dtype` holding `value` everywhere."""
    a = op.attrs
    return {"out": np.full(a["shape"], a["value"], dtype=a["dtype"])}


@kernel("uniform_random", "cpu")
def uniform_random_cpu(op, ins, ctx):
    """out ~ U[min, max), drawn by default_rng(seed) in float64, cast to `dtype`."""
    a = op.attrs
    rng = np.random.default_rng(a["seed"])
    return {"out": rng.uniform(a["min"], a["max"], size=a["shape"]).astype(a["dtype"])}


@kernel("gaussian_random", "cpu")
def gaussian_random_cpu(op, ins, ctx):
    """out ~ N(mean, std^2), drawn by default_rng(seed) in float64, cast to `dtype`."""
    a = op.attrs
    rng = np.random.default_rng(a["seed"])
    return {"out": rng.normal(a["mean"], a["std"], size=a["shape"]).astype(a["dtype"])}


@kernel("fill_constant", "gpu")
def fill_constant_gpu(op, ins, ctx):
    """out = a device array of `shape` and `dtype` holding `value`, filled on the device."""
    a = op.attrs
    return {"out": gpu.full(a["shape"], a["value"], a["dtype"])}


def upload(values):
    """A device array holding a copy of host array `values` (one host-to-device copy,
    into the pool, with the device's context current)."""
    return loader.to_device(values)


@kernel("uniform_random", "gpu")
def uniform_random_gpu(op, ins, ctx):
    """The CPU kernel's values (same seed, same numbers), copied to the device once."""
    return {"out": upload(uniform_random_cpu(op, ins, ctx)["out"])}


@kernel("gaussian_random", "gpu")
def gaussian_random_gpu(op, ins, ctx):
    """The CPU kernel's values (same seed, same numbers), copied to the device once."""
    return {"out": upload(gaussian_random_cpu(op, ins, ctx)["out"])}
