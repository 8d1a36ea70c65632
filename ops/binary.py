"""add, subtract, multiply, divide: elementwise with numpy broadcasting both ways.

x and y are float tensors of the same dtype. Their shapes are right-aligned;
in each aligned dim the sizes are equal or one of them is 1 (a missing dim
counts as 1), and out has the broadcast shape (numpy's rule; -1 where a size
is unknown at build time).
add:      out = x + y;  add_grad(x, y, dout) -> dx = R_x(dout), dy = R_y(dout)
subtract: out = x - y;  subtract_grad(x, y, dout) -> dx = R_x(dout), dy = -R_y(dout)
          same_shape=True (the losses' difference) refuses broadcasting: y must have
          x's shape, checked again on every new input shape, so a (4, 1) fed against a
          (1, 4) is an error rather than a silent 4 x 4
multiply: out = x * y;  multiply_grad(x, y, dout) -> dx = R_x(dout * y), dy = R_y(dout * x)
divide:   out = x / y;  divide_grad(x, y, dout) -> dx = R_x(dout / y),
                        dy = -R_y(dout * x / y^2)
R_v(g) sums g over the axes along which v was broadcast, back to v's shape,
in float64, cast to v's dtype. x and y of the grad ops give the shapes (and,
for multiply, the factors). Kernels: kernels/cpu/binary.py, kernels/cuda/broadcast.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import binary as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import broadcast as cuda
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
from minigraph.validators import bool_attr, check_float, check_same_dtype, check_shape, fail


def broadcast_shape(op_type, x_shape, y_shape, names=("x", "y")):
    """numpy's broadcast of two shapes, -1 where unknown; OpError naming input 'y'
    (names: what x and y are called) when two known sizes (neither 1) differ."""
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
            fail(op_type, names[1], f"with shape {tuple(y_shape)} does not broadcast with "
                                    f"{_named(names[0])} with shape {tuple(x_shape)}: aligned "
                                    f"dim {i - n} has sizes {a} and {b} (each pair must be "
                                    "equal, or one of them 1)")
    return tuple(out)


def _named(name):
    return f"input {name!r}" if name.isidentifier() else name


def infer_binary(op_type):
    """infer of add/multiply: float x, y of x's dtype, out of the broadcast shape (x's
    shape, which y must have, with the attribute same_shape)."""
    def infer(ins, attrs):
        x, y = ins["x"], ins["y"]
        check_float(op_type, "x", x)
        check_same_dtype(op_type, "y", y, "x", x)
        check_same_shape(op_type, x, y, attrs)
        return {"out": Meta(broadcast_shape(op_type, x.shape, y.shape), x.dtype)}
    return infer


def check_same_shape(op_type, x, y, attrs):
    """With the attribute same_shape, an OpError naming both shapes unless y has x's
    (sizes unknown at build time match anything: the runner checks again with the
    fed arrays)."""
    if attrs.get("same_shape"):
        check_shape(op_type, "y", y, x.shape, " (the shape of input 'x': same_shape=True, "
                                              "no broadcasting)")


def infer_binary_grad(op_type):
    """infer of add_grad/multiply_grad: dout has the broadcast shape; dx, dy are x, y."""
    def infer(ins, attrs):
        x, y = ins["x"], ins["y"]
        check_same_shape(op_type, x, y, attrs)
        out = broadcast_shape(op_type, x.shape, y.shape)
        check_shape(op_type, "dout", ins["dout"], out, " (the broadcast shape of x and y)")
        return {"dx": Meta(x.shape, x.dtype), "dy": Meta(y.shape, y.dtype)}
    return infer


def register_binary(op_type, onnx_type, shapes_only=False, roles=(), attrs=()):
    """Register `op_type` (x, y -> out; ONNX `onnx_type`) and `<op_type>_grad`
    (x, y, dout -> dx, dy); shapes_only: the grad reads only x's and y's shapes
    (add), and then the forward may write out into x or y when a training step
    hands it over (OpSchema.reuse)."""
    schema = register(OpSchema(
        type=op_type, inputs=(Slot("x"), Slot("y")), outputs=(Slot("out"),), attrs=attrs,
        infer=infer_binary(op_type), reuse={"out": ("x", "y")} if shapes_only else {},
        grad=grad_maker(op_type + "_grad", keep=("x", "y"), wrt=("x", "y")),
        export=onnx_export.binary(onnx_type), roles=roles, doc=__doc__))
    register(grad_schema(schema, inputs=(Slot("x", shape_only=shapes_only),
                                         Slot("y", shape_only=shapes_only), Slot("dout")),
                         outputs=(Slot("dx", optional=True), Slot("dy", optional=True)),
                         infer=infer_binary_grad(op_type + "_grad")))


register_binary("add", "Add", shapes_only=True, roles=("add",))
register_binary("subtract", "Sub", shapes_only=True, attrs=(bool_attr("same_shape", False),))
register_binary("multiply", "Mul")
register_binary("divide", "Div")
kernel("add", "cpu", cpu.add_cpu, bind=cpu.bind_add)
kernel("add_grad", "cpu", cpu.add_grad_cpu)
kernel("multiply", "cpu", cpu.multiply_cpu)
kernel("multiply_grad", "cpu", cpu.multiply_grad_cpu)
kernel("subtract", "cpu", cpu.subtract_cpu)
kernel("subtract_grad", "cpu", cpu.subtract_grad_cpu)
kernel("divide", "cpu", cpu.divide_cpu)
kernel("divide_grad", "cpu", cpu.divide_grad_cpu)
kernel("add", "gpu", cuda.add_gpu, dtypes=GPU_FLOATS)
kernel("add_grad", "gpu", cuda.add_grad_gpu, dtypes=GPU_FLOATS)
kernel("multiply", "gpu", cuda.multiply_gpu, dtypes=GPU_FLOATS)
kernel("multiply_grad", "gpu", cuda.multiply_grad_gpu, dtypes=GPU_FLOATS)
kernel("subtract", "gpu", cuda.subtract_gpu, dtypes=GPU_FLOATS)
kernel("subtract_grad", "gpu", cuda.subtract_grad_gpu, dtypes=GPU_FLOATS)
kernel("divide", "gpu", cuda.divide_gpu, dtypes=GPU_FLOATS)
kernel("divide_grad", "gpu", cuda.divide_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def add_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("both-ways-f32", {"x": ex.r(4, 1, 5), "y": ex.r(3, 1)}, {}, (("x", "y"), ("x",), ("y",))),
        ("bias-f64", {"x": ex.r(2, 3, 4, 5, dtype=np.float64),
                "y": ex.r(3, 1, 1, dtype=np.float64)},
         {}, (("x", "y"), ("x",), ("y",))),
        ("same-f32", {"x": ex.r(3, 7), "y": ex.r(3, 7, seed=1)}, {}, (("x", "y"), ("x",), ("y",))),
        ("scalar-f64", {"x": ex.r(5, dtype=np.float64), "y": np.array(1.5)},
         {}, (("x", "y"), ("x",), ("y",))),
        ("kept-inner-f32", {"x": ex.r(2, 1, 6), "y": ex.r(2, 4, 6, seed=2)},
         {}, (("x", "y"), ("x",), ("y",))),
    ]


def multiply_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("both-ways-f64", {"x": ex.r(1, 3, 5, dtype=np.float64),
                "y": ex.r(4, 1, 5, dtype=np.float64)},
         {}, (("x", "y"), ("x",), ("y",))),
        ("rows-f32", {"x": ex.r(9, 33), "y": ex.r(9, 1, seed=3)}, {}, (("x", "y"), ("x",), ("y",))),
        ("same-f32", {"x": ex.r(2, 5), "y": ex.r(2, 5, seed=4)}, {}, (("x", "y"), ("x",), ("y",))),
    ]


def subtract_examples(ex):
    """Cases the device tests run on every place against the CPU."""
    xy = (("x", "y"), ("x",), ("y",))
    return [("both-ways-f32", {"x": ex.r(4, 1, 5), "y": ex.r(3, 1)}, {}, xy),
            ("same-f64", {"x": ex.r(3, 7, dtype=np.float64),
                          "y": ex.r(3, 7, dtype=np.float64, seed=1)}, {}, xy)]


def divide_examples(ex):
    """Cases the device tests run on every place against the CPU (y kept away from 0)."""
    def away(*shape, dtype=np.float32, seed=0):
        y = ex.r(*shape, dtype=dtype, seed=seed)
        return (np.sign(y) + (y == 0)) * (np.abs(y) + 0.5)
    xy = (("x", "y"), ("x",), ("y",))
    return [("both-ways-f32", {"x": ex.r(4, 1, 5), "y": away(3, 1, seed=2)}, {}, xy),
            ("rows-f64", {"x": ex.r(6, 9, dtype=np.float64),
                          "y": away(6, 1, dtype=np.float64, seed=3)}, {}, xy)]


examples("add", add_examples)
examples("multiply", multiply_examples)
examples("subtract", subtract_examples)
examples("divide", divide_examples)
