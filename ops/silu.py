"""silu: out = x * sigmoid(x) (torch.nn.SiLU, "swish").

silu_grad(x, dout): dx = dout * s * (1 + x * (1 - s)), s = sigmoid(x).
x must be a float tensor; the CPU kernels (kernels/cpu/silu.py) compute in
float64 and cast back, float32 in C where the native kernel applies
(activation_native); the GPU kernels are the two map lines of
kernels/cuda/silu.cu. In ONNX it is Mul(x, Sigmoid(x)). This module is the
worked example of docs/adding_an_op.md.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import silu as cpu
from minigraph.ops.activation import register_activation
from minigraph.schema import examples


def export_silu(ctx, op):
    """Mul(x, Sigmoid(x)) (opset 17 has no Swish)."""
    x, out = ctx.value(op.inputs["x"]), op.outputs["out"]
    s = ctx.temp(out, "sigmoid")
    return [ctx.node("Sigmoid", [x], [s]), ctx.node("Mul", [x, s], [ctx.output(out)])]


register_activation("silu", "x", export_silu, (cpu.silu_cpu, cpu.silu_grad_cpu, cpu.bind_silu),
                    doc=__doc__, grad_reuse=True)


def silu_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets)."""
    return [("f32", {"x": ex.r(4, 9) * 8}, {}, (("x",),)),
            ("f64", {"x": ex.r(13, dtype=np.float64) * 40}, {}, (("x",),))]


examples("silu", silu_examples)
