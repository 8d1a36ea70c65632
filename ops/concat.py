"""concat: join tensors along an axis (np.concatenate), and its grad.

x: a list of at least one tensor, all of one dtype and one rank (>= 1), equal
in every dim except `axis`; axis (int, default 0) counts from the end when
negative. out's size along axis is the sum of theirs (-1 when one is
unknown at build time).
concat_grad(x, dout; axis, index): dx = the slice of dout along axis that
came from x[index] (the full list x gives the offsets). The grad maker builds
one per input that needs a gradient.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import concat as cpu
from minigraph.kernels.cuda import shape_ops as cuda
from minigraph.schema import Meta, OpDesc, OpError, OpSchema, Slot, examples, kernel, register
from minigraph.validators import (
    check_same_dtype,
    dims_equal,
    fail,
    int_attr,
    non_negative,
    normalized_axis,
)


def check_parts(op_type, xs, axis):
    """Check the list of input metas; returns (normalized axis, joined shape)."""
    if not xs:
        fail(op_type, "x", "must hold at least one tensor, got an empty list")
    first = xs[0]
    if len(first.shape) == 0:
        fail(op_type, "x[0]", "must have rank >= 1 (a scalar cannot be concatenated)")
    rank = len(first.shape)
    ax = normalized_axis(op_type, axis, rank, "x[0]")
    shape = list(first.shape)
    for i, m in enumerate(xs[1:], start=1):
        check_same_dtype(op_type, f"x[{i}]", m, "x[0]", first)
        if len(m.shape) != rank:
            fail(op_type, f"x[{i}]", f"must have the rank of input 'x[0]' ({rank}, shape "
                                     f"{first.shape}), got shape {m.shape}")
        for d in range(rank):
            if d != ax and not dims_equal(m.shape[d], shape[d]):
                fail(op_type, f"x[{i}]", f"must match input 'x[0]' in every dim but axis {ax}: "
                                         f"shape {m.shape} vs {first.shape}")
            if d != ax and shape[d] < 0:
                shape[d] = m.shape[d]
        shape[ax] = -1 if shape[ax] < 0 or m.shape[ax] < 0 else shape[ax] + m.shape[ax]
    return ax, tuple(shape)


def infer_concat(ins, attrs):
    _, shape = check_parts("concat", ins["x"], attrs["axis"])
    return {"out": Meta(shape, ins["x"][0].dtype)}


def grad_concat(op, dout, make_grad):
    """One concat_grad per input of x that needs a gradient."""
    d = dout.get("out")
    if d is None:
        return []
    xs = op.inputs["x"]
    descs = []
    for i, v in enumerate(xs):
        g = make_grad(v)
        if g is not None:
            descs.append(OpDesc("concat_grad", dict(x=xs, dout=d, dx=g, axis=op.attrs["axis"],
                                                    index=i)))
    return descs


def infer_concat_grad(ins, attrs):
    xs = ins["x"]
    _, shape = check_parts("concat_grad", xs, attrs["axis"])
    index = attrs["index"]
    if index >= len(xs):
        raise OpError(f"concat_grad: attribute 'index' must be < {len(xs)} (the number of "
                      f"inputs 'x'), got {index}")
    d = ins["dout"]
    if len(d.shape) != len(shape) or not all(dims_equal(a, b) for a, b in zip(d.shape, shape)):
        fail("concat_grad", "dout", f"must have shape {shape} (concat's output), got {d.shape}")
    return {"dx": Meta(xs[index].shape, xs[index].dtype)}


def export_concat(ctx, op):
    """Concat along `axis`."""
    ins = [ctx.value(v) for v in op.inputs["x"]]
    return [ctx.node("Concat", ins, [ctx.output(op.outputs["out"])],
                     axis=int(op.attrs["axis"]))]


CONCAT = register(OpSchema(
    type="concat", inputs=(Slot("x", duplicable=True),), outputs=(Slot("out"),),
    attrs=(int_attr("axis", 0),), infer=infer_concat, grad=grad_concat, export=export_concat,
    doc=__doc__))
register(OpSchema(
    type="concat_grad", inputs=(Slot("x", duplicable=True, shape_only=True), Slot("dout")),
    outputs=(Slot("dx", optional=True),),
    attrs=CONCAT.attrs + (int_attr("index", 0, non_negative),), infer=infer_concat_grad,
    no_export="a gradient op (training only)"))


kernel("concat", "cpu", cpu.concat_cpu)
kernel("concat_grad", "cpu", cpu.concat_grad_cpu)
kernel("concat", "gpu", cuda.concat_gpu)
kernel("concat_grad", "gpu", cuda.concat_grad_gpu)


# ---- examples ---------------------------------------------------------------------

def concat_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("axis1-f32", {"x": [ex.r(2, 3, 4), ex.r(2, 5, 4, seed=1), ex.r(2, 1, 4, seed=2)]},
         dict(axis=1), (("x",),)),
        ("neg-f64", {"x": [ex.r(3, 2, dtype=np.float64), ex.r(3, 7, dtype=np.float64, seed=1)]},
         dict(axis=-1), (("x",),)),
        ("axis0-int64", {"x": [np.arange(6).reshape(2, 3), np.arange(3).reshape(1, 3)]}, {}, ()),
    ]


examples("concat", concat_examples)
