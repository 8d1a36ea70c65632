"""fill_constant, uniform_random, gaussian_random: ops with no inputs that make a tensor.

The random ops draw from `np.random.default_rng(seed)` afresh on every run, so
one seed always gives the same values. None of them has a gradient.
GPU: fill_constant fills on the device (one launch, also inside a step). The
random ops draw on the host with the same generator and copy the values in
once, so a seed initialises a net identically on every place; they are
initialisers and do not run inside a step. (minigraph.kernels.cuda.fill has a
device-side Philox generator, but its stream is not numpy's.) Kernels:
kernels/cpu/fill.py, kernels/cuda/fill.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import fill as cpu
from minigraph.kernels.cuda import fill as cuda
from minigraph.schema import Attr, Meta, OpError, OpSchema, Slot, examples, kernel, register
from minigraph.validators import float_attr, int_attr, is_int, non_negative


def check_shape_attr(v):
    """A complaint unless `v` is a tuple of ints >= 0."""
    if not all(is_int(d) and d >= 0 for d in v):
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


def export_fill_constant(ctx, op):
    """A Constant node holding the filled tensor."""
    a, out = op.attrs, op.outputs["out"]
    value = np.full(tuple(a["shape"]), a["value"]).astype(a["dtype"])
    helper = ctx.onnx.helper
    tensor = helper.make_tensor(out.name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                value.shape, value.flatten().tolist())
    return [ctx.node("Constant", [], [ctx.output(out)], value=tensor)]


def fill_schema(op_type, dtype_kinds, extra_attrs, validate=None, **fields):
    return OpSchema(
        type=op_type, inputs=(), outputs=(Slot("out"),),
        attrs=(Attr("shape", (tuple, list), (), check_shape_attr, required=True),
               Attr("dtype", (str,), "float32", check_dtype_attr(dtype_kinds)))
        + extra_attrs,
        infer=infer_fill, resolve_attrs=resolve, validate=validate, doc=__doc__, **fields)


INITIALIZER = "an initializer: it runs before any step; the values it made are exported"


def validate_uniform(op):
    if not op.attrs["min"] <= op.attrs["max"]:
        raise OpError(f"{op.type}: attribute 'min' ({op.attrs['min']}) must be <= "
                      f"attribute 'max' ({op.attrs['max']})")


register(fill_schema("fill_constant", "biuf", (float_attr("value", 0.0),), roles=("fill",),
                     export=export_fill_constant))
register(fill_schema("uniform_random", "f", (float_attr("min", -1.0), float_attr("max", 1.0),
                                             int_attr("seed", 0, non_negative)),
                     validate_uniform, no_export=INITIALIZER))
def validate_zero_row(op):
    row, shape = op.attrs["zero_row"], op.attrs["shape"]
    if row != -1 and not (shape and 0 <= row < shape[0]):
        raise OpError(f"{op.type}: attribute 'zero_row' ({row}) must be -1 (none) or a row "
                      f"index in [0, {shape[0] if shape else 0}) of shape {tuple(shape)}")


register(fill_schema("gaussian_random", "f", (float_attr("mean", 0.0),
                                              float_attr("std", 1.0, non_negative),
                                              int_attr("seed", 0, non_negative),
                                              int_attr("zero_row", -1)),
                     validate_zero_row, no_export=INITIALIZER))

kernel("fill_constant", "cpu", cpu.fill_constant_cpu)
kernel("uniform_random", "cpu", cpu.uniform_random_cpu)
kernel("gaussian_random", "cpu", cpu.gaussian_random_cpu)
kernel("fill_constant", "gpu", cuda.fill_constant_gpu)
kernel("uniform_random", "gpu", cuda.uniform_random_gpu)
kernel("gaussian_random", "gpu", cuda.gaussian_random_gpu)


# ---- examples ---------------------------------------------------------------------

def fill_constant_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {}, dict(shape=(3, 4), value=2.5), ()),
        ("int64", {}, dict(shape=(5,), dtype="int64", value=7.9), ()),
        ("bool", {}, dict(shape=(2, 2), dtype="bool", value=1.0), ()),
        ("f16", {}, dict(shape=(3,), dtype="float16", value=0.1), ()),
        ("scalar-f64", {}, dict(shape=(), dtype="float64", value=-1.25), ()),
    ]


def uniform_random_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {}, dict(shape=(4, 5), min=-2.0, max=3.0, seed=3), ()),
        ("f64", {}, dict(shape=(7,), dtype="float64", seed=4), ()),
    ]


def gaussian_random_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f64", {}, dict(shape=(2, 3), dtype="float64", mean=1.0, std=2.0, seed=5), ()),
    ]


examples("fill_constant", fill_constant_examples)
examples("uniform_random", uniform_random_examples)
examples("gaussian_random", gaussian_random_examples)
