"""Elementwise math: exp, log, sqrt, square, abs, pow, scale, clip (and their grads).

exp:    out = e^x;                 exp_grad(out, dout):  dx = dout * out
log:    out = ln x;                log_grad(x, dout):    dx = dout / x
sqrt:   out = sqrt(x);             sqrt_grad(out, dout): dx = dout / (2 out)
square: out = x^2;                 square_grad(x, dout): dx = 2 x dout
abs:    out = |x|;                 abs_grad(x, dout):    dx = sign(x) dout (0 at 0)
pow:    out = x^factor;            pow_grad(x, dout):    dx = factor x^(factor-1) dout
scale:  out = x * scale + bias;    scale_grad(dout):     dx = scale * dout
clip:   out = min(max(x, min), max); clip_grad(x, dout): dx = dout where min <= x <= max
        (both ends included, as torch.clamp), else 0
x must be a float tensor; outputs keep its dtype; out-of-domain inputs give nan or
inf as in numpy and torch. Kernels: kernels/cpu/math.py; on the GPU the map kernels
of kernels/cuda/math.cu.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import math as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import map as cuda_map
from minigraph.kernels.cuda import math as cuda_math
from minigraph.ops.activation import register_activation, same_as_x
from minigraph.schema import OpError, OpSchema, Slot, examples, grad_maker, kernel, register
from minigraph.validators import float_attr

MODULE = "math"


def finite(v):
    return None if math.isfinite(v) else "must be a finite number"


def export_square(ctx, op):
    """Mul(x, x)."""
    x = ctx.value(op.inputs["x"])
    return [ctx.node("Mul", [x, x], [ctx.output(op.outputs["out"])])]


def export_pow(ctx, op):
    """Pow(x, factor) with the factor a constant of x's dtype."""
    x, out = op.inputs["x"], op.outputs["out"]
    factor = ctx.const(out, "factor", np.array(op.attrs["factor"], ctx.dtype(x)))
    return [ctx.node("Pow", [ctx.value(x), factor], [ctx.output(out)])]


def export_scale(ctx, op):
    """Mul by scale, then Add bias (constants of x's dtype)."""
    x, out = op.inputs["x"], op.outputs["out"]
    dt = ctx.dtype(x)
    scaled = ctx.temp(out, "scaled")
    return [ctx.node("Mul", [ctx.value(x), ctx.const(out, "scale",
                                                     np.array(op.attrs["scale"], dt))], [scaled]),
            ctx.node("Add", [scaled, ctx.const(out, "bias", np.array(op.attrs["bias"], dt))],
                     [ctx.output(out)])]


def export_clip(ctx, op):
    """Clip(x, min, max) with the bounds constants of x's dtype."""
    x, out = op.inputs["x"], op.outputs["out"]
    dt = ctx.dtype(x)
    lo, hi = (ctx.const(out, k, np.array(op.attrs[k], dt)) for k in ("min", "max"))
    return [ctx.node("Clip", [ctx.value(x), lo, hi], [ctx.output(out)])]


def validate_clip(op):
    for k in ("min", "max"):
        if math.isnan(op.attrs[k]):
            raise OpError(f"clip: attribute '{k}' must be a number or +-inf, got nan")
    if op.attrs["min"] > op.attrs["max"]:
        raise OpError(f"clip: attribute 'min' ({op.attrs['min']}) must be <= attribute 'max' "
                      f"({op.attrs['max']})")


for _op, _keep, _export in (("exp", "out", onnx_export.unary("Exp")),
                            ("log", "x", onnx_export.unary("Log")),
                            ("sqrt", "out", onnx_export.unary("Sqrt")),
                            ("square", "x", export_square),
                            ("abs", "x", onnx_export.unary("Abs"))):
    register_activation(_op, _keep, _export,
                        (getattr(cpu, f"{_op}_cpu"), getattr(cpu, f"{_op}_grad_cpu")),
                        doc=__doc__, gpu_module=MODULE)
register_activation("pow", "x", export_pow, (cpu.pow_cpu, cpu.pow_grad_cpu),
                    attrs=(float_attr("factor", 1.0, finite),), gpu_scalar="factor",
                    doc=__doc__, gpu_module=MODULE)
register_activation("clip", "x", export_clip, (cpu.clip_cpu, cpu.clip_grad_cpu),
                    attrs=(float_attr("min", -math.inf), float_attr("max", math.inf)),
                    gpu_scalar=("min", "max"), doc=__doc__, gpu_module=MODULE,
                    validate=validate_clip)

register(OpSchema(type="scale", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  attrs=(float_attr("scale", 1.0, finite), float_attr("bias", 0.0, finite)),
                  infer=same_as_x("scale"), grad=grad_maker("scale_grad", keep=()),
                  export=export_scale, doc=__doc__))
register(OpSchema(type="scale_grad", inputs=(Slot("dout"),), outputs=(Slot("dx", optional=True),),
                  attrs=(float_attr("scale", 1.0, finite), float_attr("bias", 0.0, finite)),
                  infer=lambda ins, attrs: {"dx": ins["dout"]},
                  no_export="a gradient op (training only)"))
kernel("scale", "cpu", cpu.scale_cpu)
kernel("scale_grad", "cpu", cpu.scale_grad_cpu)
_scale_fwd, _ = cuda_map.op_kernels("scale", "x", ("scale", "bias"), MODULE)
kernel("scale", "gpu", _scale_fwd, dtypes=GPU_FLOATS)
kernel("scale_grad", "gpu", cuda_math.scale_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def _unary_examples(make, positive=False):
    def cases(ex):
        def x(*shape, dtype=np.float32):
            v = ex.r(*shape, dtype=dtype) * 3
            return np.abs(v) + 0.1 if positive else v
        return [(f"{dt.__name__}", {"x": x(4, 9, dtype=dt)}, make(dt), (("x",),))
                for dt in (np.float32, np.float64)]
    return cases


for _op, _positive, _attrs in (("exp", False, {}), ("log", True, {}), ("sqrt", True, {}),
                               ("square", False, {}), ("abs", False, {}),
                               ("pow", True, {"factor": 2.5}), ("scale", False,
                                                                {"scale": -1.5, "bias": 0.25}),
                               ("clip", False, {"min": -1.0, "max": 2.0})):
    examples(_op, _unary_examples(lambda dt, a=_attrs: a, _positive))
