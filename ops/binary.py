"""add and multiply: elementwise with numpy broadcasting both ways (and their grads).

x and y are float tensors of the same dtype. Their shapes are right-aligned;
in each aligned dim the sizes are equal or one of them is 1 (a missing dim
counts as 1), and out has the broadcast shape (numpy's rule; -1 where a size
is unknown at build time).
add:      out = x + y;  add_grad(x, y, dout) -> dx = R_x(dout), dy = R_y(dout)
multiply: out = x * y;  multiply_grad(x, y, dout) -> dx = R_x(dout * y), dy = R_y(dout * x)
R_v(g) sums g over the axes along which v was broadcast, back to v's shape,
in float64, cast to v's dtype. x and y of the grad ops give the shapes (and,
for multiply, the factors).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import broadcast as gpu
from minigraph.ops.device import GPU_FLOATS, present
from minigraph.schema import Meta, OpSchema, Slot, grad_maker, grad_schema, kernel, register
from minigraph.validators import check_float, check_same_dtype, check_shape, fail


def broadcast_shape(op_type, x_shape, y_shape):
    """numpy's broadcast of two shapes, -1 where unknown; OpError naming input 'y'
    when two known sizes (neither 1) differ."""
    n = max(len(x_shape), len(y_shape))
    xs = (1,) * (n - len(x_shape)) + tuple(x_shape)
    ys = (1,) * (n - len(y_shape)) + tuple(y_shape)
    out = []
    for i, (a, b) in enumerate(zip(xs, ys)):
        if a == b or b == 1:
            out.append(a)
        elif a == 1:
            out.append(b)
        elif a < 0 or b < 0:              # unknown vs a known size other than 1: that size
            out.append(max(a, b))
        else:
            fail(op_type, "y", f"with shape {tuple(y_shape)} does not broadcast with input "
                               f"'x' with shape {tuple(x_shape)}: aligned dim {i - n} has "
                               f"sizes {a} and {b} (each pair must be equal, or one of them 1)")
    return tuple(out)


def infer_binary(op_type):
    """infer of add/multiply: float x, y of x's dtype, out of the broadcast shape."""
    def infer(ins, attrs):
        x, y = ins["x"], ins["y"]
        check_float(op_type, "x", x)
        check_same_dtype(op_type, "y", y, "x", x)
        return {"out": Meta(broadcast_shape(op_type, x.shape, y.shape), x.dtype)}
    return infer


def infer_binary_grad(op_type):
    """infer of add_grad/multiply_grad: dout has the broadcast shape; dx, dy are x, y."""
    def infer(ins, attrs):
        x, y = ins["x"], ins["y"]
        out = broadcast_shape(op_type, x.shape, y.shape)
        check_shape(op_type, "dout", ins["dout"], out, " (the broadcast shape of x and y)")
        return {"dx": Meta(x.shape, x.dtype), "dy": Meta(y.shape, y.dtype)}
    return infer


def register_binary(op_type, shapes_only=False):
    """Register `op_type` (x, y -> out) and `<op_type>_grad` (x, y, dout -> dx, dy);
    shapes_only: the grad reads only x's and y's shapes (add), and then the forward
    may write out into x or y when a training step hands it over (OpSchema.reuse)."""
    schema = register(OpSchema(
        type=op_type, inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
        infer=infer_binary(op_type), reuse={"out": ("x", "y")} if shapes_only else {},
        grad=grad_maker(op_type + "_grad", keep=("x", "y"), wrt=("x", "y")), doc=__doc__))
    register(grad_schema(schema, inputs=(Slot("x", shape_only=shapes_only),
                                         Slot("y", shape_only=shapes_only), Slot("dout")),
                         outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                         infer=infer_binary_grad(op_type + "_grad")))


register_binary("add", shapes_only=True)
register_binary("multiply")


def reduce_to(g, shape, dtype):
    """g (of the broadcast shape) summed in float64 over the axes that broadcast
    `shape` to it, reshaped to `shape`, as a new `dtype` array."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and g.shape[lead + i] != 1)
    if axes:
        g = np.add.reduce(g, axis=axes, dtype=np.float64)
    return np.array(g.reshape(shape), dtype=dtype)


@kernel("add", "cpu")
def add_cpu(op, ins, ctx):
    """out = x + y, broadcast; into x's or y's array when one of out's shape is
    handed over."""
    x, y = ins["x"], ins["y"]
    shape = np.broadcast_shapes(x.shape, y.shape)
    into = next((ins[s] for s in ctx.donated if ins[s].shape == shape), None)
    return {"out": np.add(x, y, out=into)}


@kernel("add_grad", "cpu")
def add_grad_cpu(op, ins, ctx):
    """dx = dout reduced to x's shape, dy = dout reduced to y's shape (each when bound);
    an input of dout's shape and dtype gets dout itself, not a copy (kernels never
    write their inputs unless handed them: see OpSchema.reuse)."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    out = {}
    for slot, v in (("dx", x), ("dy", y)):
        if op.wants(slot):
            same = v.shape == d.shape and v.dtype == d.dtype
            out[slot] = d if same else reduce_to(d, v.shape, v.dtype)
    return out


@kernel("multiply", "cpu")
def multiply_cpu(op, ins, ctx):
    """out = x * y, broadcast."""
    return {"out": np.multiply(ins["x"], ins["y"])}


@kernel("multiply_grad", "cpu")
def multiply_grad_cpu(op, ins, ctx):
    """dx = (dout * y) reduced to x's shape, dy = (dout * x) reduced to y's shape; the
    products in float64."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    out = {}
    if op.wants("dx"):
        out["dx"] = reduce_to(np.multiply(d, y, dtype=np.float64), x.shape, x.dtype)
    if op.wants("dy"):
        out["dy"] = reduce_to(np.multiply(d, x, dtype=np.float64), y.shape, y.dtype)
    return out


# ---- GPU bindings: kernels/broadcast.cu ----

@kernel("add", "gpu", dtypes=GPU_FLOATS)
def add_gpu(op, ins, ctx):
    """out = x + y, broadcast, on the device."""
    return {"out": gpu.add(ins["x"], ins["y"])}


@kernel("add_grad", "gpu", dtypes=GPU_FLOATS)
def add_grad_gpu(op, ins, ctx):
    """dx, dy = dout summed (in double) back to x's and y's shapes, each when bound."""
    dx, dy = gpu.add_grad(ins["x"].shape, ins["y"].shape, ins["dout"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


@kernel("multiply", "gpu", dtypes=GPU_FLOATS)
def multiply_gpu(op, ins, ctx):
    """out = x * y, broadcast, on the device."""
    return {"out": gpu.multiply(ins["x"], ins["y"])}


@kernel("multiply_grad", "gpu", dtypes=GPU_FLOATS)
def multiply_grad_gpu(op, ins, ctx):
    """dx = (dout * y) and dy = (dout * x) summed back to x's and y's shapes, each when
    bound; the products in the dtype, the sums in double."""
    dx, dy = gpu.multiply_grad(ins["x"], ins["y"], ins["dout"], need_dx=op.wants("dx"),
                               need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)
