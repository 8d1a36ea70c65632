"""reduce_sum, reduce_mean, reduce_max: a float tensor reduced over some axes.

axis: None (every axis) or a tuple of distinct axes (negative from the end); keepdim
keeps them as size-1 axes. out: x's dtype; sums and means in float64.
reduce_sum_grad(x, dout):       dx = dout broadcast back over the reduced axes
reduce_mean_grad(x, dout):      dx = dout / (values reduced) broadcast back
reduce_max_grad(x, out, dout):  dx = dout / ties where x equals the maximum, else 0
                                (torch.amax's: ties share the gradient equally)
In ONNX: ReduceSum / ReduceMean / ReduceMax. Kernels: kernels/cpu/reduce.py,
kernels/cuda/reduce.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import reduce as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import reduce as cuda
from minigraph.schema import (
    Attr,
    Meta,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import bool_attr, check_float, check_shape, fail, is_int


def check_axes(v):
    if v is None:
        return None
    if not v or not all(is_int(a) for a in v) or len(set(v)) != len(v):
        return "must be None (every axis) or a non-empty tuple of distinct ints"
    return None


def resolve(attrs):
    axis = attrs["axis"]
    return {**attrs, "axis": None if axis is None else tuple(int(a) for a in axis)}


def reduced(op_type, shape, attrs):
    """(the reduced axes, normalised; out's shape); an OpError naming `axis` when one
    is outside [-rank, rank)."""
    rank = len(shape)
    axis = attrs["axis"]
    if axis is None:
        axes = tuple(range(rank))
    else:
        for a in axis:
            if not -rank <= a < rank:
                fail(op_type, "x", f"of rank {rank} has no axis {a} (attribute 'axis' "
                                   f"{tuple(axis)})")
        axes = tuple(sorted({a % rank for a in axis}))
        if len(axes) != len(axis):
            fail(op_type, "x", f"of rank {rank}: attribute 'axis' {tuple(axis)} names one axis "
                               "twice")
    if attrs["keepdim"]:
        return axes, tuple(1 if i in axes else d for i, d in enumerate(shape))
    return axes, tuple(d for i, d in enumerate(shape) if i not in axes)


def infer_reduce(op_type):
    def infer(ins, attrs):
        x = ins["x"]
        check_float(op_type, "x", x)
        axes, shape = reduced(op_type, x.shape, attrs)
        if op_type == "reduce_max" and any(x.shape[a] == 0 for a in axes):
            fail(op_type, "x", f"of shape {tuple(x.shape)} has no values to take the maximum of "
                               f"along the reduced axes {axes}")
        return {"out": Meta(shape, x.dtype)}
    return infer


def infer_reduce_grad(op_type):
    def infer(ins, attrs):
        x = ins["x"]
        _, shape = reduced(op_type, x.shape, attrs)
        check_shape(op_type, "dout", ins["dout"], shape, " (the reduced shape of x)")
        return {"dx": Meta(x.shape, x.dtype)}
    return infer


def exporter(onnx_type):
    """ReduceX over the axes (every one when None), keepdims as asked: the axes an
    input for ReduceSum (opset 13+) and for every reduction from opset 18, else an
    attribute; Identity for a scalar."""
    def export(ctx, op):
        x, out = op.inputs["x"], op.outputs["out"]
        axes = list(reduced(op.type, ctx.shape(x), op.attrs)[0])
        keep = int(op.attrs["keepdim"])
        if not axes:                                  # a scalar reduced: itself
            return [ctx.node("Identity", [ctx.value(x)], [ctx.output(out)])]
        ins = [ctx.value(x)]
        if onnx_type == "ReduceSum" or ctx.opset >= 18:
            ins.append(ctx.const(out, "axes", np.array(axes, np.int64)))
            return [ctx.node(onnx_type, ins, [ctx.output(out)], keepdims=keep)]
        return [ctx.node(onnx_type, ins, [ctx.output(out)], axes=axes, keepdims=keep)]
    export.__doc__ = f"{onnx_type} over the reduced axes."
    return export


ATTRS = (Attr("axis", (tuple, list), None, check_axes, nullable=True),
         bool_attr("keepdim", False))
for _op, _onnx, _keep in (("reduce_sum", "ReduceSum", ("x",)),
                          ("reduce_mean", "ReduceMean", ("x",)),
                          ("reduce_max", "ReduceMax", ("x", "out"))):
    _schema = register(OpSchema(type=_op, inputs=(Slot("x"),), outputs=(Slot("out"),),
                                attrs=ATTRS, resolve_attrs=resolve, infer=infer_reduce(_op),
                                grad=grad_maker(f"{_op}_grad", keep=_keep),
                                export=exporter(_onnx), doc=__doc__))
    _grad_ins = (Slot("x", shape_only=_op != "reduce_max"),) + \
        ((Slot("out"),) if _op == "reduce_max" else ()) + (Slot("dout"),)
    register(grad_schema(_schema, inputs=_grad_ins, outputs=(Slot("dx", optional=True),),
                         infer=infer_reduce_grad(f"{_op}_grad")))
    for _name in (_op, f"{_op}_grad"):
        kernel(_name, "cpu", getattr(cpu, f"{_name}_cpu"))
        kernel(_name, "gpu", getattr(cuda, f"{_name}_gpu"), dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def reduce_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets)."""
    return [("all-f32", {"x": ex.r(3, 4, 5)}, {}, (("x",),)),
            ("axis1-keep-f64", {"x": ex.r(3, 7, 2, dtype=np.float64)},
             dict(axis=(1,), keepdim=True), (("x",),)),
            ("axes-0-2-f32", {"x": ex.r(4, 3, 6)}, dict(axis=(0, -1)), (("x",),)),
            ("last-f64", {"x": ex.r(5, 33, dtype=np.float64)}, dict(axis=(-1,)), (("x",),))]


for _op in ("reduce_sum", "reduce_mean", "reduce_max"):
    examples(_op, reduce_examples)
