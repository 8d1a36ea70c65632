"""elementwise_add (PaddlePaddle broadcasting) and sum (adds a list of same-shaped tensors).

elementwise_add: y's shape equals a contiguous run of x's dims starting at
`axis` (axis=-1: the trailing dims, axis = x.ndim - y.ndim), and y is
broadcast over every other dim of x: x (N, C, H, W) + y (C,) with axis=1
adds a per-channel bias. out has x's shape.
sum: out = x[0] + x[1] + ...; autodiff uses it to add gradient contributions.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels import elementwise as gpu
from minigraph.ops.device import GPU_FLOATS, present
from minigraph.schema import Meta, OpDesc, OpSchema, Slot, grad_maker, grad_schema, kernel, register
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


def y_view(x_ndim, y, start):
    """y reshaped so numpy broadcasting lines it up with x's dims from `start`."""
    return y.reshape(y.shape + (1,) * (x_ndim - start - y.ndim))


def infer_add_grad(ins, attrs):
    y, d = ins["y"], ins["dout"]
    broadcast_axis("elementwise_add_grad", d.shape, y.shape, attrs["axis"])
    return {"dx": Meta(d.shape, d.dtype), "dy": Meta(y.shape, d.dtype)}


ADD = register(OpSchema(
    type="elementwise_add", inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
    attrs=(int_attr("axis", -1, check_axis),), infer=infer_add,
    grad=grad_maker("elementwise_add_grad", keep=("y",), wrt=("x", "y")), reuse={"out": ("x",)},
    doc=__doc__))
register(grad_schema(ADD, inputs=(Slot("y"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                     infer=infer_add_grad))


@kernel("elementwise_add", "cpu")
def elementwise_add_cpu(op, ins, ctx):
    """out = x + y, y broadcast along x's dims from `axis`; into x's array when it is
    handed over."""
    x, y = ins["x"], ins["y"]
    start = broadcast_axis(op.type, x.shape, y.shape, op.attrs["axis"])
    return {"out": np.add(x, y_view(x.ndim, y, start), out=x if "x" in ctx.donated else None)}


@kernel("elementwise_add_grad", "cpu")
def elementwise_add_grad_cpu(op, ins, ctx):
    """dx = dout (the same array: kernels write only inputs handed over to them,
    OpSchema.reuse); dy = dout summed over every dim of x outside y's run - along
    the trailing dims by one BLAS product with a ones vector, over the leading ones
    in float64."""
    y, d = ins["y"], ins["dout"]
    out = {}
    if op.wants("dx"):
        out["dx"] = d
    if op.wants("dy"):
        start = broadcast_axis(op.type, d.shape, y.shape, op.attrs["axis"])
        post = math.prod(d.shape[start + y.ndim:])
        rows = np.ascontiguousarray(d).reshape(-1, y.size, post)
        if post > 1:
            rows = rows @ np.ones(post, dtype=d.dtype)
        else:
            rows = rows[..., 0]
        dy = np.add.reduce(rows, axis=0, dtype=np.float64)
        out["dy"] = dy.astype(d.dtype).reshape(y.shape)
    return out


@kernel("elementwise_add", "gpu", dtypes=GPU_FLOATS)
def elementwise_add_gpu(op, ins, ctx):
    """out = x + y on the device, y broadcast along x's dims from `axis`."""
    x, y = ins["x"], ins["y"]
    return {"out": gpu.add(x, y, op.attrs["axis"])}


@kernel("elementwise_add_grad", "gpu", dtypes=GPU_FLOATS)
def elementwise_add_grad_gpu(op, ins, ctx):
    """dx = a device copy of dout; dy = dout summed over the broadcast dims (in
    double on the device); each only when bound."""
    y, d = ins["y"], ins["dout"]
    dx, dy = gpu.add_grad(d, tuple(y.shape), op.attrs["axis"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


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
    infer=infer_sum, grad=grad_sum, roles=("accumulate",), replication="inputs", doc=__doc__))
register(OpSchema(
    type="sum_grad", inputs=(Slot("dout"),), outputs=(Slot("dx"),),
    infer=lambda ins, attrs: {"dx": ins["dout"]}))


@kernel("sum", "cpu")
def sum_cpu(op, ins, ctx):
    """out = x[0] + x[1] + ... (a new array)."""
    xs = ins["x"]
    out = xs[0].copy()
    for x in xs[1:]:
        out += x
    return {"out": out}


@kernel("sum_grad", "cpu")
def sum_grad_cpu(op, ins, ctx):
    """dx = a copy of dout."""
    return {"dx": ins["dout"].copy()}


@kernel("sum", "gpu", dtypes=GPU_FLOATS)
def sum_gpu(op, ins, ctx):
    """out = x[0] + x[1] + ... (a new device array)."""
    return {"out": gpu.sum_n(ins["x"])}


@kernel("sum_grad", "gpu", dtypes=GPU_FLOATS)
def sum_grad_gpu(op, ins, ctx):
    """dx = a device copy of dout."""
    return {"dx": gpu.copy(ins["dout"])}
