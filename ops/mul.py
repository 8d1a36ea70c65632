"""mul: a matrix product after flattening x to 2-D.

x is viewed as (prod(x.shape[:n]), prod(x.shape[n:])) with n = x_num_col_dims,
y is (K, M) with K the second of those, and out has shape x.shape[:n] + (M,).
An fc layer is mul and a bias add (elementwise_add). Kernels: kernels/cpu/mul.py,
kernels/cuda/matmul.py.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import mul as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import matmul as cuda
from minigraph.schema import (
    Meta,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
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


def infer_mul_grad(ins, attrs):
    x, y = ins["x"], ins["y"]
    return {"dx": Meta(x.shape, x.dtype), "dy": Meta(y.shape, y.dtype)}


def export_mul(ctx, op):
    """MatMul of x viewed as a matrix (Flatten, or a Reshape keeping the first
    x_num_col_dims dims) with y."""
    return matmul_nodes(ctx, op, ctx.output(op.outputs["out"]))


def matmul_nodes(ctx, op, name, x_name=None):
    """The ONNX nodes of a mul or fused_fc op's product, its result named `name`; its x
    the value named x_name where given (a normalised x, of x's shape)."""
    x, n = op.inputs["x"], int(op.attrs["x_num_col_dims"])
    out = op.outputs["out"]
    rank, xs = len(ctx.shape(x)), x_name or ctx.value(x)
    nodes = []
    if rank > n + 1:
        flat = ctx.temp(out, "flat")
        if n == 1:
            nodes.append(ctx.node("Flatten", [xs], [flat], axis=1))
        else:
            shape = ctx.const(out, "shape", np.array([0] * n + [-1], np.int64))
            nodes.append(ctx.node("Reshape", [xs, shape], [flat]))
        xs = flat
    return nodes + [ctx.node("MatMul", [xs, ctx.value(op.inputs["y"])], [name])]


MUL = register(OpSchema(
    type="mul", inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
    attrs=(int_attr("x_num_col_dims", 1, positive),), infer=infer_mul,
    grad=grad_maker("mul_grad", keep=("x", "y"), wrt=("x", "y")), export=export_mul,
    roles=("linear", "matrix_product"), weight=("y", 1, -1), doc=__doc__))
register(grad_schema(MUL, inputs=(Slot("x"), Slot("y"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                     infer=infer_mul_grad))

kernel("mul", "cpu", cpu.mul_cpu)
kernel("mul_grad", "cpu", cpu.mul_grad_cpu)
kernel("mul", "gpu", cuda.mul_gpu, dtypes=GPU_FLOATS)
kernel("mul_grad", "gpu", cuda.mul_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def mul_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(2, 3, 4), "y": ex.r(12, 5)}, {}, (("x", "y"), ("x",), ("y",))),
        ("cols2-f64", {"x": ex.r(2, 3, 4, dtype=np.float64), "y": ex.r(4, 6, dtype=np.float64)},
         dict(x_num_col_dims=2), (("x", "y"), ("x",), ("y",))),
    ]


examples("mul", mul_examples)
