"""Elementwise activations: relu, sigmoid, tanh, gelu, leaky_relu (and their grads).

relu:       out = max(x, 0); relu_grad(out, dout): dx = dout where out > 0, else 0.
sigmoid:    out = 1 / (1 + exp(-x)), from exp(-|x|) so nothing overflows;
            sigmoid_grad(out, dout): dx = dout * out * (1 - out).
tanh:       out = tanh(x); tanh_grad(out, dout): dx = dout * (1 - out^2).
gelu:       out = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the exact form (not the
            tanh approximation), Phi the standard normal CDF;
            gelu_grad(x, dout): dx = dout * (Phi(x) + x * phi(x)), phi its density.
leaky_relu: out = x where x > 0, else alpha * x (alpha: finite, default 0.01);
            leaky_relu_grad(x, dout): dx = dout where x > 0, else alpha * dout.
x must be a float tensor; outputs keep its dtype. Kernels: kernels/cpu/activation.py;
on the GPU relu in kernels/cuda/activation.cu, the others map-only .cu files of their
own name (kernels/cuda/sigmoid.cu, ...).
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import activation as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import activation as cuda
from minigraph.kernels.cuda import map as cuda_map
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
from minigraph.validators import check_float, check_shape, finite, float_attr


def same_as_x(op_type):
    """infer for a float elementwise op: out has x's shape and dtype."""
    def infer(ins, attrs):
        check_float(op_type, "x", ins["x"])
        return {"out": Meta(ins["x"].shape, ins["x"].dtype)}
    return infer


def grad_like(op_type, ref_slot):
    """infer for an elementwise grad op: dx has the shape and dtype of `ref_slot`, and dout
    matches that shape."""
    def infer(ins, attrs):
        ref = ins[ref_slot]
        check_shape(op_type, "dout", ins["dout"], ref.shape, f" (the shape of {ref_slot!r})")
        return {"dx": Meta(ref.shape, ref.dtype)}
    return infer


def register_activation(op_type, keep, export, cpu_kernels, attrs=(), gpu_scalar=None,
                        doc=__doc__, gpu_module=None, grad_reuse=False, **fields):
    """Register `op_type` (x -> out) and `<op_type>_grad` (keep, dout -> dx; with
    grad_reuse its CPU kernel may write dx into a handed-over dout) with their
    exporter, their CPU kernels (forward, grad and, optionally, the forward's bound
    form) and, on the GPU, the map kernels of kernels/cuda/<gpu_module or op_type>.cu
    (`gpu_scalar`: the attribute, or tuple of attributes, passed to them)."""
    schema = register(OpSchema(type=op_type, inputs=(Slot("x"),), outputs=(Slot("out"),),
                               attrs=attrs, infer=same_as_x(op_type), export=export,
                               grad=grad_maker(op_type + "_grad", keep=(keep,)), doc=doc,
                               **fields))
    register(grad_schema(schema, inputs=(Slot(keep), Slot("dout")),
                         outputs=(Slot("dx", optional=True),),
                         reuse={"dx": ("dout",)} if grad_reuse else {},
                         infer=grad_like(op_type + "_grad", keep)))
    kernel(op_type, "cpu", cpu_kernels[0], bind=cpu_kernels[2] if len(cpu_kernels) > 2 else None)
    kernel(op_type + "_grad", "cpu", cpu_kernels[1])
    forward, backward = cuda_map.op_kernels(op_type, keep, gpu_scalar, gpu_module)
    kernel(op_type, "gpu", forward, dtypes=GPU_FLOATS)
    kernel(op_type + "_grad", "gpu", backward, dtypes=GPU_FLOATS)


def export_gelu(ctx, op):
    """0.5 x (1 + Erf(x / sqrt 2)): the exact form (opset 17 has no Gelu)."""
    out = op.outputs["out"]
    return gelu_nodes(ctx, ctx.value(op.inputs["x"]), out, ctx.output(out))


def gelu_nodes(ctx, xs, out, result):
    """The ONNX nodes of gelu from the value named `xs` into the one named `result`,
    their temporaries and constants named after the Variable `out` (which has the
    dtype)."""
    dt = ctx.dtype(out)
    scaled, erf, plus, half = (ctx.temp(out, s) for s in ("scaled", "erf", "one_plus", "half_x"))
    return [ctx.node("Div", [xs, ctx.const(out, "sqrt2", np.array(math.sqrt(2.0), dt))],
                     [scaled]),
            ctx.node("Erf", [scaled], [erf]),
            ctx.node("Add", [erf, ctx.const(out, "one", np.array(1.0, dt))], [plus]),
            ctx.node("Mul", [xs, ctx.const(out, "0.5", np.array(0.5, dt))], [half]),
            ctx.node("Mul", [half, plus], [result])]


def export_leaky_relu(ctx, op):
    """LeakyRelu with the op's alpha."""
    return onnx_export.unary("LeakyRelu", alpha=float(op.attrs["alpha"]))(ctx, op)


register(OpSchema(type="relu", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  infer=same_as_x("relu"), grad=grad_maker("relu_grad", keep=("out",)),
                  reuse={"out": ("x",)}, roles=("relu",), export=onnx_export.unary("Relu"),
                  doc=__doc__))
register(OpSchema(type="relu_grad", inputs=(Slot("out"), Slot("dout")),
                  outputs=(Slot("dx", optional=True),), reuse={"dx": ("dout",)},
                  infer=lambda ins, attrs: {"dx": Meta(ins["out"].shape, ins["out"].dtype)},
                  no_export="a gradient op (training only)"))
kernel("relu", "cpu", cpu.relu_cpu)
kernel("relu_grad", "cpu", cpu.relu_grad_cpu)
kernel("relu", "gpu", cuda.relu_gpu, dtypes=GPU_FLOATS)
kernel("relu_grad", "gpu", cuda.relu_grad_gpu, dtypes=GPU_FLOATS)

register_activation("sigmoid", "out", onnx_export.unary("Sigmoid"),
                    (cpu.sigmoid_cpu, cpu.sigmoid_grad_cpu, cpu.bind_native("sigmoid")),
                    grad_reuse=True)
register_activation("tanh", "out", onnx_export.unary("Tanh"),
                    (cpu.tanh_cpu, cpu.tanh_grad_cpu, cpu.bind_native("tanh")), grad_reuse=True)
register_activation("gelu", "x", export_gelu, (cpu.gelu_cpu, cpu.gelu_grad_cpu, cpu.bind_gelu),
                    roles=("gelu",))
register_activation("leaky_relu", "x", export_leaky_relu,
                    (cpu.leaky_relu_cpu, cpu.leaky_relu_grad_cpu, cpu.bind_native("leaky_relu")),
                    attrs=(float_attr("alpha", 0.01, finite),), gpu_scalar="alpha", grad_reuse=True)


# ---- examples ---------------------------------------------------------------------

def relu_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(3, 4, 5)}, {}, (("x",),)),
        ("f64", {"x": ex.r(7, dtype=np.float64)}, {}, (("x",),)),
    ]


def sigmoid_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(3, 17) * 10}, {}, (("x",),)),
        ("f64", {"x": ex.r(7, dtype=np.float64) * 40}, {}, (("x",),)),
    ]


def tanh_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(5, 9)}, {}, (("x",),)),
        ("f64", {"x": ex.r(11, dtype=np.float64)}, {}, (("x",),)),
    ]


def gelu_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(4, 13) * 3}, {}, (("x",),)),
        ("f64", {"x": ex.r(2, 9, dtype=np.float64) * 3}, {}, (("x",),)),
    ]


def leaky_relu_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); ex.r(*shape, dtype, seed) gives random values, ex.labels(n, k)
    class indices."""
    return [
        ("f32", {"x": ex.r(6, 5)}, dict(alpha=0.1), (("x",),)),
        ("f64", {"x": ex.r(13, dtype=np.float64)}, {}, (("x",),)),
    ]


examples("relu", relu_examples)
examples("sigmoid", sigmoid_examples)
examples("tanh", tanh_examples)
examples("gelu", gelu_examples)
examples("leaky_relu", leaky_relu_examples)
