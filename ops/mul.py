"""mul: a matrix product after flattening x to 2-D.

x is viewed as (prod(x.shape[:n]), prod(x.shape[n:])) with n = x_num_col_dims,
y is (K, M) with K the second of those, and out has shape x.shape[:n] + (M,).
"""
from __future__ import annotations

import math

from minigraph.kernels import matmul as gpu
from minigraph.ops.device import GPU_FLOATS, present
from minigraph.schema import Meta, OpSchema, Slot, grad_maker, grad_schema, kernel, register
from minigraph.validators import (
    check_float,
    check_rank,
    check_same_dtype,
    dims_equal,
    fail,
    int_attr,
    positive,
)


def flat_cols(shape, n):
    """prod(shape[n:]), or -1 when a dim there is unknown."""
    tail = shape[n:]
    return -1 if any(d < 0 for d in tail) else math.prod(tail)


def infer_mul(ins, attrs):
    x, y = ins["x"], ins["y"]
    n = attrs["x_num_col_dims"]
    check_float("mul", "x", x)
    check_same_dtype("mul", "y", y, "x", x)
    if len(x.shape) <= n:
        fail("mul", "x", f"must have more than x_num_col_dims={n} dims, got shape {x.shape}")
    check_rank("mul", "y", y, (2,))
    k = flat_cols(x.shape, n)
    if not dims_equal(y.shape[0], k):
        fail("mul", "y", f"must have {k} rows (the product of dims {n}.. of input 'x' with "
                         f"shape {x.shape}, x_num_col_dims={n}), got shape {y.shape}")
    return {"out": Meta(tuple(x.shape[:n]) + (y.shape[1],), x.dtype)}


def as_matrix(x, n):
    """x viewed as (prod(x.shape[:n]), prod(x.shape[n:]))."""
    return x.reshape(math.prod(x.shape[:n]), flat_cols(x.shape, n))


def infer_mul_grad(ins, attrs):
    x, y = ins["x"], ins["y"]
    return {"dx": Meta(x.shape, x.dtype), "dy": Meta(y.shape, y.dtype)}


MUL = register(OpSchema(
    type="mul", inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
    attrs=(int_attr("x_num_col_dims", 1, positive),), infer=infer_mul,
    grad=grad_maker("mul_grad", keep=("x", "y"), wrt=("x", "y")), doc=__doc__))
register(grad_schema(MUL, inputs=(Slot("x"), Slot("y"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                     infer=infer_mul_grad))


@kernel("mul", "cpu")
def mul_cpu(op, ins, ctx):
    """out = flatten(x) @ y, reshaped to x.shape[:n] + (M,)."""
    x, y = ins["x"], ins["y"]
    n = op.attrs["x_num_col_dims"]
    return {"out": (as_matrix(x, n) @ y).reshape(x.shape[:n] + (y.shape[1],))}


@kernel("mul_grad", "cpu")
def mul_grad_cpu(op, ins, ctx):
    """dx = dout2 @ y.T reshaped to x's shape; dy = x2.T @ dout2."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    n = op.attrs["x_num_col_dims"]
    d2 = d.reshape(math.prod(x.shape[:n]), y.shape[1])
    out = {}
    if op.wants("dx"):
        out["dx"] = (d2 @ y.T).reshape(x.shape)
    if op.wants("dy"):
        out["dy"] = as_matrix(x, n).T @ d2
    return out


@kernel("mul", "gpu", dtypes=GPU_FLOATS)
def mul_gpu(op, ins, ctx):
    """out = flatten(x) @ y on the device (tiled matrix product), shaped x.shape[:n] + (M,)."""
    x, y = ins["x"], ins["y"]
    return {"out": gpu.mul(x, y, op.attrs["x_num_col_dims"])}


@kernel("mul_grad", "gpu", dtypes=GPU_FLOATS)
def mul_grad_gpu(op, ins, ctx):
    """dx = dout2 @ y.T (x's shape), dy = x2.T @ dout2 on the device; each only when bound."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    dx, dy = gpu.mul_grad(x, y, d, op.attrs["x_num_col_dims"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)
