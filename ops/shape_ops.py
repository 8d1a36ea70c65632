"""reshape, flatten, transpose: the same values in a new shape or order (and their grads).

reshape(x; shape):   out = x reshaped to `shape` (ints, each > 0 or -1; at most
                     one -1, inferred from x's size). At build time a -1 in
                     x's shape (the batch axis) leaves the -1 output dim unknown.
flatten(x; start_axis=1, stop_axis=-1): dims start..stop (inclusive, negative
                     from the end) merged into one, as torch.flatten; x of rank >= 1.
transpose(x; perm):  out = x.transpose(perm), perm a permutation of range(rank).
Grads: reshape_grad(x, dout) -> dx = dout reshaped to x's shape (reshape and
flatten share it); transpose_grad(dout; perm) -> dx = dout.transpose(argsort(perm)).
Any dtype. Outputs are new C-contiguous arrays, never views of x.
Kernels: kernels/cpu/shape_ops.py, kernels/cuda/shape_ops.py.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import shape_ops as cpu
from minigraph.kernels.cuda import shape_ops as cuda
from minigraph.schema import (
    Attr,
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import fail, int_attr, is_int, normalized_axis


def check_target_shape(v):
    """reshape's shape: ints, each > 0 or -1, at most one -1."""
    if not all(is_int(d) and (d > 0 or d == -1) for d in v) or list(v).count(-1) > 1:
        return "must be a tuple of ints, each > 0 or -1, with at most one -1"
    return None


def check_perm(v):
    if not all(is_int(p) for p in v) or sorted(v) != list(range(len(v))):
        return f"must be a permutation of range({len(v)})"
    return None


def as_ints(name):
    """resolve_attrs: attribute `name` as a tuple of Python ints."""
    def resolve(attrs):
        return {**attrs, name: tuple(int(d) for d in attrs[name])}
    return resolve


def known(shape):
    return all(d >= 0 for d in shape)


def reshaped(op_type, x_shape, shape):
    """The output shape of reshaping `x_shape` to `shape` (-1 resolved when x's size is
    known); OpError naming both shapes when the sizes cannot agree."""
    def mismatch(why):
        fail(op_type, "x", f"with shape {tuple(x_shape)} cannot be reshaped to attribute "
                           f"'shape' {tuple(shape)}: {why}")
    rest = math.prod(d for d in shape if d != -1)
    if known(x_shape):
        size = math.prod(x_shape)
        if -1 not in shape:
            if rest != size:
                mismatch(f"{size} values vs {rest}")
            return tuple(shape)
        if size % rest:
            mismatch(f"{size} values are not a multiple of {rest}")
        return tuple(size // rest if d == -1 else d for d in shape)
    part = math.prod(d for d in x_shape if d >= 0)
    if -1 not in shape and part and rest % part:
        mismatch(f"{rest} values are not a multiple of the known dims' {part}")
    return tuple(shape)


def infer_reshape(ins, attrs):
    x = ins["x"]
    return {"out": Meta(reshaped("reshape", x.shape, attrs["shape"]), x.dtype)}


def flat_range(op_type, rank, attrs):
    """(start, stop) of flatten, normalized; OpError naming the attribute when out of
    range or when start comes after stop."""
    start = normalized_axis(op_type, attrs["start_axis"], rank, attr="start_axis")
    stop = normalized_axis(op_type, attrs["stop_axis"], rank, attr="stop_axis")
    if start > stop:
        raise OpError(f"{op_type}: attribute 'start_axis' ({attrs['start_axis']}) must not "
                      f"come after attribute 'stop_axis' ({attrs['stop_axis']}) for input "
                      f"'x' of rank {rank}")
    return start, stop


def flattened(shape, start, stop):
    merged = shape[start:stop + 1]
    size = math.prod(merged) if known(merged) else -1
    return tuple(shape[:start]) + (size,) + tuple(shape[stop + 1:])


def infer_flatten(ins, attrs):
    x = ins["x"]
    if len(x.shape) == 0:
        fail("flatten", "x", "must have rank >= 1, got a scalar (shape ())")
    start, stop = flat_range("flatten", len(x.shape), attrs)
    return {"out": Meta(flattened(x.shape, start, stop), x.dtype)}


def infer_reshape_grad(ins, attrs):
    x, d = ins["x"], ins["dout"]
    if known(x.shape) and known(d.shape) and math.prod(x.shape) != math.prod(d.shape):
        fail("reshape_grad", "dout", f"with shape {d.shape} must have as many values as "
                                     f"input 'x' with shape {x.shape}")
    return {"dx": Meta(x.shape, x.dtype)}


def check_perm_rank(op_type, slot, meta, perm):
    if len(perm) != len(meta.shape):
        raise OpError(f"{op_type}: attribute 'perm' {tuple(perm)} must be a permutation of "
                      f"range({len(meta.shape)}) for input {slot!r} of rank "
                      f"{len(meta.shape)} (shape {meta.shape})")


def infer_transpose(ins, attrs):
    x, perm = ins["x"], attrs["perm"]
    check_perm_rank("transpose", "x", x, perm)
    return {"out": Meta(tuple(x.shape[p] for p in perm), x.dtype)}


def infer_transpose_grad(ins, attrs):
    d, perm = ins["dout"], attrs["perm"]
    check_perm_rank("transpose_grad", "dout", d, perm)
    return {"dx": Meta(tuple(d.shape[p] for p in np.argsort(perm)), d.dtype)}


def export_reshape(ctx, op):
    """Reshape to the `shape` attribute (an int64 constant; -1 is inferred, no 0s)."""
    out = op.outputs["out"]
    shape = ctx.const(out, "shape", np.array(op.attrs["shape"], np.int64))
    return [ctx.node("Reshape", [ctx.value(op.inputs["x"]), shape], [ctx.output(out)])]


def export_flatten(ctx, op):
    """Flatten when dims 1.. merge into one; else a Reshape that copies the dims
    before start_axis (0), merges start..stop (-1 or their known product) and
    keeps the known dims after stop_axis."""
    x, out = op.inputs["x"], op.outputs["out"]
    shape = tuple(ctx.shape(x))
    rank = len(shape)
    start, stop = op.attrs["start_axis"] % rank, op.attrs["stop_axis"] % rank
    if start == 1 and stop == rank - 1:
        return [ctx.node("Flatten", [ctx.value(x)], [ctx.output(out)], axis=1)]
    merged = shape[start:stop + 1]
    target = [0] * start + [-1 if min(merged) < 0 else math.prod(merged)]
    target += [d if d >= 0 else -1 for d in shape[stop + 1:]]
    if target.count(-1) > 1:
        raise ValueError(f"flatten computing {out.name!r}: input {x.name!r} of shape {shape} "
                         "has unknown dims both inside and after the merged axes; ONNX "
                         "Reshape can infer only one")
    const = ctx.const(out, "shape", np.array(target, np.int64))
    return [ctx.node("Reshape", [ctx.value(x), const], [ctx.output(out)])]


def export_transpose(ctx, op):
    """Transpose by `perm`."""
    return [ctx.node("Transpose", [ctx.value(op.inputs["x"])], [ctx.output(op.outputs["out"])],
                     perm=[int(p) for p in op.attrs["perm"]])]


RESHAPE_GRAD = grad_maker("reshape_grad", keep=("x",), attrs=False)

register(OpSchema(
    type="reshape", inputs=(Slot("x"),), outputs=(Slot("out"),),
    attrs=(Attr("shape", (tuple, list), (), check_target_shape, required=True),),
    resolve_attrs=as_ints("shape"), infer=infer_reshape, grad=RESHAPE_GRAD,
    export=export_reshape, doc=__doc__))
register(OpSchema(
    type="flatten", inputs=(Slot("x"),), outputs=(Slot("out"),),
    attrs=(int_attr("start_axis", 1), int_attr("stop_axis", -1)), infer=infer_flatten,
    grad=RESHAPE_GRAD, export=export_flatten, doc=__doc__))
register(OpSchema(
    type="reshape_grad", inputs=(Slot("x", shape_only=True), Slot("dout")),
    outputs=(Slot("dx", optional=True),),
    infer=infer_reshape_grad, no_export="a gradient op (training only)"))
TRANSPOSE = register(OpSchema(
    type="transpose", inputs=(Slot("x"),), outputs=(Slot("out"),),
    attrs=(Attr("perm", (tuple, list), (), check_perm, required=True),),
    resolve_attrs=as_ints("perm"), infer=infer_transpose,
    grad=grad_maker("transpose_grad", keep=()), export=export_transpose, doc=__doc__))
register(grad_schema(TRANSPOSE, inputs=(Slot("dout"),), outputs=(Slot("dx", optional=True),),
                     infer=infer_transpose_grad))


kernel("reshape", "cpu", cpu.reshape_cpu, bind=cpu.bind_reshape)
kernel("flatten", "cpu", cpu.flatten_cpu, bind=cpu.bind_reshape)
kernel("reshape_grad", "cpu", cpu.reshape_grad_cpu)
kernel("transpose", "cpu", cpu.transpose_cpu)
kernel("transpose_grad", "cpu", cpu.transpose_grad_cpu)
kernel("reshape", "gpu", cuda.reshape_gpu)
kernel("flatten", "gpu", cuda.flatten_gpu)
kernel("reshape_grad", "gpu", cuda.reshape_grad_gpu)
kernel("transpose", "gpu", cuda.transpose_gpu)
kernel("transpose_grad", "gpu", cuda.transpose_grad_gpu)


# ---- examples ---------------------------------------------------------------------

def reshape_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(2, 3, 4)}, dict(shape=(4, -1)), (("x",),)),
        ("f64", {"x": ex.r(5, 6, dtype=np.float64)}, dict(shape=(3, 10)), (("x",),)),
        ("int64", {"x": np.arange(12)}, dict(shape=(3, 4)), ()),
    ]


def flatten_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(2, 3, 4, 5)}, {}, (("x",),)),
        ("mid-f64", {"x": ex.r(2, 3, 4, 5, dtype=np.float64)},
         dict(start_axis=1, stop_axis=2), (("x",),)),
    ]


def transpose_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(2, 3, 5)}, dict(perm=(2, 0, 1)), (("x",),)),
        ("4d-f64", {"x": ex.r(2, 3, 4, 5, dtype=np.float64)}, dict(perm=(0, 2, 1, 3)), (("x",),)),
    ]


examples("reshape", reshape_examples)
examples("flatten", flatten_examples)
examples("transpose", transpose_examples)
