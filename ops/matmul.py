"""matmul: batched matrix products with numpy's broadcasting (np.matmul, torch.matmul).

x (..., M, K) and y (..., K, N), each of rank >= 2 (transpose_x / transpose_y swap
its last two axes first); the batch axes broadcast as in numpy; out (..., M, N).
matmul_grad(x, y, dout): with X, Y the (transposed) operands,
dX = dout @ Y^T and dY = X^T @ dout, each summed over the batch axes its operand
was broadcast along and transposed back. (The fc layer's `mul` is the 2-D special
case with x flattened.) In ONNX: MatMul, with Transpose where asked. Kernels:
kernels/cpu/matmul.py, kernels/cuda/matmul.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import matmul as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import batched_matmul as cuda
from minigraph.ops.binary import broadcast_shape
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
    bool_attr,
    check_float,
    check_rank,
    check_same_dtype,
    check_shape,
    dims_equal,
    fail,
)

TYPE = "matmul"


def operands(op_type, ins, attrs):
    """(x's (M, K), y's (K, N), the broadcast batch shape), checked."""
    x, y = ins["x"], ins["y"]
    check_float(op_type, "x", x)
    check_same_dtype(op_type, "y", y, "x", x)
    ranks = tuple(range(2, 9))
    check_rank(op_type, "x", x, ranks)
    check_rank(op_type, "y", y, ranks)
    mk = x.shape[-2:][::-1] if attrs["transpose_x"] else x.shape[-2:]
    kn = y.shape[-2:][::-1] if attrs["transpose_y"] else y.shape[-2:]
    if not dims_equal(mk[1], kn[0]):
        fail(op_type, "y", f"with shape {y.shape}{' (transposed)' if attrs['transpose_y'] else ''}"
                           f" does not chain with input 'x' with shape {x.shape}"
                           f"{' (transposed)' if attrs['transpose_x'] else ''}: {mk[1]} columns "
                           f"against {kn[0]} rows")
    return mk, kn, broadcast_shape(op_type, x.shape[:-2], y.shape[:-2])


def infer_matmul(ins, attrs):
    mk, kn, batch = operands(TYPE, ins, attrs)
    return {"out": Meta(batch + (mk[0], kn[1]), ins["x"].dtype)}


def infer_matmul_grad(ins, attrs):
    x, y = ins["x"], ins["y"]
    check_shape(TYPE + "_grad", "dout", ins["dout"], infer_matmul(ins, attrs)["out"].shape,
                " (the shape of matmul's out)")
    return {"dx": Meta(x.shape, x.dtype), "dy": Meta(y.shape, y.dtype)}


def export_matmul(ctx, op):
    """MatMul, each operand first Transposed (its last two axes) when asked."""
    out, ins, nodes = op.outputs["out"], [], []
    for slot in ("x", "y"):
        v = op.inputs[slot]
        name = ctx.value(v)
        if op.attrs[f"transpose_{slot}"]:
            rank = len(ctx.shape(v))
            t = ctx.temp(out, f"{slot}_t")
            nodes.append(ctx.node("Transpose", [name], [t],
                                  perm=[*range(rank - 2), rank - 1, rank - 2]))
            name = t
        ins.append(name)
    return nodes + [ctx.node("MatMul", ins, [ctx.output(out)])]


SCHEMA = register(OpSchema(
    type=TYPE, inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),),
    attrs=(bool_attr("transpose_x", False), bool_attr("transpose_y", False)),
    infer=infer_matmul, grad=grad_maker("matmul_grad", keep=("x", "y"), wrt=("x", "y")),
    export=export_matmul, doc=__doc__))
register(grad_schema(SCHEMA, inputs=(Slot("x"), Slot("y"), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                     infer=infer_matmul_grad))
kernel(TYPE, "cpu", cpu.matmul_cpu, bind=cpu.bind_matmul)
kernel(TYPE + "_grad", "cpu", cpu.matmul_grad_cpu)
kernel(TYPE, "gpu", cuda.matmul_gpu, dtypes=GPU_FLOATS)
kernel(TYPE + "_grad", "gpu", cuda.matmul_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def matmul_examples(ex):
    """Cases the device tests run on every place against the CPU."""
    xy = (("x", "y"), ("x",), ("y",))
    return [("2d-f32", {"x": ex.r(5, 7), "y": ex.r(7, 3)}, {}, xy),
            ("batched-f64", {"x": ex.r(2, 3, 4, 5, dtype=np.float64),
                             "y": ex.r(2, 3, 5, 6, dtype=np.float64)}, {}, xy),
            ("broadcast-f32", {"x": ex.r(4, 3, 5), "y": ex.r(5, 2)}, {}, xy),
            ("transposed-f64", {"x": ex.r(3, 6, 4, dtype=np.float64),
                                "y": ex.r(1, 5, 6, dtype=np.float64)},
             dict(transpose_x=True, transpose_y=True), xy)]


examples(TYPE, matmul_examples)
