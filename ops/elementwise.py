"""elementwise_add (PaddlePaddle broadcasting) and sum (adds a list of same-shaped tensors).

elementwise_add: y's shape equals a contiguous run of x's dims starting at
`axis` (axis=-1: the trailing dims, axis = x.ndim - y.ndim), and y is
broadcast over every other dim of x: x (N, C, H, W) + y (C,) with axis=1
adds a per-channel bias. out has x's shape.
sum: out = x[0] + x[1] + ...; autodiff uses it to add gradient contributions.
Kernels: kernels/cpu/elementwise.py, kernels/cuda/elementwise.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import elementwise as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import elementwise as cuda
from minigraph.schema import (
    Meta,
    OpDesc,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import check_same_dtype, check_shape, fail, int_attr, shapes_equal


def broadcast_axis(op_type, x_shape, y_shape, axis):
    """The dim of x where y's dims start; OpError naming 'y' unless y's shape
    equals x's dims [axis, axis + y.ndim)."""
    start = len(x_shape) - len(y_shape) if axis == -1 else axis
    if len(y_shape) > len(x_shape):
        fail(op_type, "y", f"must not have more dims than input 'x': y has shape {y_shape}, "
                           f"x has shape {x_shape}")
    if not 0 <= start <= len(x_shape) - len(y_shape):
        fail(op_type, "y", f"of rank {len(y_shape)} cannot start at axis={axis} of input 'x' "
                           f"with shape {x_shape}; axis must be -1 or in "
                           f"[0, {len(x_shape) - len(y_shape)}]")
    want = tuple(x_shape[start:start + len(y_shape)])
    if not shapes_equal(tuple(y_shape), want):
        fail(op_type, "y", f"must have shape {want} (dims {start}..{start + len(y_shape) - 1} "
                           f"of input 'x' with shape {tuple(x_shape)}, axis={axis}), "
                           f"got {tuple(y_shape)}")
    return start


def check_axis(v):
    return None if v >= -1 else "must be -1 (trailing dims) or >= 0"


def infer_add(ins, attrs):
    x, y = ins["x"], ins["y"]
    check_same_dtype("elementwise_add", "y", y, "x", x)
    broadcast_axis("elementwise_add", x.shape, y.shape, attrs["axis"])
    return {"out": Meta(x.shape, x.dtype)}


def infer_add_grad(ins, attrs):
    y, d = ins["y"], ins["dout"]
    broadcast_axis("elementwise_add_grad", d.shape, y.shape, attrs["axis"])
    return {"dx": Meta(d.shape, d.dtype), "dy": Meta(y.shape, d.dtype)}


def export_elementwise_add(ctx, op):
    """Add, y lined up with x's dims from `axis`: a persistable y is stored with
    trailing 1s (a bias (C,) at axis 1 of NCHW as (C, 1, 1)); a computed y is
    Unsqueezed."""
    x, y, out = op.inputs["x"], op.inputs["y"], op.outputs["out"]
    x_rank, y_shape = len(ctx.shape(x)), tuple(ctx.shape(y))
    axis = int(op.attrs["axis"])
    start = x_rank - len(y_shape) if axis == -1 else axis
    trailing = x_rank - start - len(y_shape)
    nodes = []
    if trailing == 0:
        ys = ctx.value(y)
    elif y.persistable:
        ys = ctx.value(y, shape=y_shape + (1,) * trailing)
    else:
        ys = ctx.temp(out, "y")
        axes = ctx.const(out, "axes", np.arange(len(y_shape), len(y_shape) + trailing))
        nodes.append(ctx.node("Unsqueeze", [ctx.value(y), axes], [ys]))
    return nodes + [ctx.node("Add", [ctx.value(x), ys], [ctx.output(out)])]


def export_sum(ctx, op):
    """Sum of the list x."""
    return [ctx.node("Sum", [ctx.value(v) for v in op.inputs["x"]],
                     [ctx.output(op.outputs["out"])])]


ADD = register(OpSchema(
    type="elementwise_add", inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
    attrs=(int_attr("axis", -1, check_axis),), infer=infer_add,
    grad=grad_maker("elementwise_add_grad", keep=("y",), wrt=("x", "y")), reuse={"out": ("x",)},
    roles=("bias_add",), export=export_elementwise_add, doc=__doc__))
register(grad_schema(ADD, inputs=(Slot("y"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                     infer=infer_add_grad))


def infer_sum(ins, attrs):
    xs = ins["x"]
    if not xs:
        fail("sum", "x", "must hold at least one tensor, got an empty list")
    first = xs[0]
    for i, m in enumerate(xs[1:], start=1):
        check_shape("sum", f"x[{i}]", m, first.shape, " (the shape of x[0])")
        check_same_dtype("sum", f"x[{i}]", m, "x[0]", first)
    return {"out": Meta(first.shape, first.dtype)}


def grad_sum(op, dout, make_grad):
    """One sum_grad per input that needs a gradient: each gets dout."""
    d = dout.get("out")
    if d is None:
        return []
    dxs = [g for g in (make_grad(v) for v in op.inputs["x"]) if g is not None]
    return [OpDesc("sum_grad", dict(dout=d, dx=g)) for g in dxs]


register(OpSchema(
    type="sum", inputs=(Slot("x", duplicable=True),), outputs=(Slot("out"),),
    infer=infer_sum, grad=grad_sum, roles=("accumulate",), replication="inputs",
    export=export_sum, doc=__doc__))
register(OpSchema(
    type="sum_grad", inputs=(Slot("dout"),), outputs=(Slot("dx"),),
    infer=lambda ins, attrs: {"dx": ins["dout"]}, no_export="a gradient op (training only)"))

kernel("elementwise_add", "cpu", cpu.elementwise_add_cpu)
kernel("elementwise_add_grad", "cpu", cpu.elementwise_add_grad_cpu)
kernel("sum", "cpu", cpu.sum_cpu)
kernel("sum_grad", "cpu", cpu.sum_grad_cpu)
kernel("elementwise_add", "gpu", cuda.elementwise_add_gpu, dtypes=GPU_FLOATS)
kernel("elementwise_add_grad", "gpu", cuda.elementwise_add_grad_gpu, dtypes=GPU_FLOATS)
kernel("sum", "gpu", cuda.sum_gpu, dtypes=GPU_FLOATS)
kernel("sum_grad", "gpu", cuda.sum_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def elementwise_add_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("channel-f32", {"x": ex.r(2, 3, 4, 5), "y": ex.r(3)},
         dict(axis=1), (("x", "y"), ("x",), ("y",))),
        ("same-f64", {"x": ex.r(4, 6, dtype=np.float64), "y": ex.r(4, 6, dtype=np.float64)},
         {}, (("x", "y"), ("x",), ("y",))),
        ("trailing-f32", {"x": ex.r(2, 3, 4), "y": ex.r(3, 4)}, {}, (("x", "y"), ("x",), ("y",))),
        ("leading-f64", {"x": ex.r(2, 3, 4, dtype=np.float64), "y": ex.r(2, dtype=np.float64)},
         dict(axis=0), (("y",),)),
    ]


def sum_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": [ex.r(3, 5, seed=k) for k in range(3)]}, {}, (("x",),)),
    ]


examples("elementwise_add", elementwise_add_examples)
examples("sum", sum_examples)
