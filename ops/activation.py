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
x must be a float tensor; outputs keep its dtype. The CPU kernels of sigmoid,
tanh, gelu and leaky_relu compute in float64 and cast back.
"""
from __future__ import annotations

import numpy as np

from minigraph import cpu_blocks
from minigraph.kernels import activation as gpu
from minigraph.kernels import map as maps
from minigraph.ops.device import GPU_FLOATS
from minigraph.ops.erf import normal_cdf
from minigraph.schema import Meta, OpSchema, Slot, grad_maker, grad_schema, kernel, register
from minigraph.validators import check_float, check_shape, float_attr

INV_SQRT_2PI = 0.3989422804014327        # 1 / sqrt(2 pi)


def infer_relu(ins, attrs):
    check_float("relu", "x", ins["x"])
    return {"out": Meta(ins["x"].shape, ins["x"].dtype)}


register(OpSchema(type="relu", inputs=(Slot("x"),), outputs=(Slot("out"),), infer=infer_relu,
                  grad=grad_maker("relu_grad", keep=("out",)), reuse={"out": ("x",)},
                  doc=__doc__))
register(OpSchema(type="relu_grad", inputs=(Slot("out"), Slot("dout")),
                  outputs=(Slot("dx", optional=True),), reuse={"dx": ("dout",)},
                  infer=lambda ins, attrs: {"dx": Meta(ins["out"].shape, ins["out"].dtype)}))


@kernel("relu", "cpu")
def relu_cpu(op, ins, ctx):
    """out = max(x, 0), elementwise; into x's array when it is handed over."""
    x = ins["x"]
    return {"out": cpu_blocks.relu(x, out=x if "x" in ctx.donated else None)}


_SAME_SIZE_INT = {2: np.int16, 4: np.int32, 8: np.int64}
# values per block when dx is written over dout: a quarter of it, at least 4096 and at
# most 65536 (per-block calls cost: 16384-value blocks ran 1.5x the time of one pass
# on 2 MiB, 65536-value ones 1.15x, 2026-11-24)
MASK_BLOCK_RANGE = (1 << 12, 1 << 16)


@kernel("relu_grad", "cpu")
def relu_grad_cpu(op, ins, ctx):
    """dx = dout where out > 0, else 0 (+0.0): the bits of dout ANDed with a mask of
    all ones or zeros, the same values as np.where and many times faster. When dout
    is handed over, dx is written into it, block by block through a small mask."""
    out, d = ins["out"], ins["dout"]
    if d.dtype != out.dtype or d.shape != out.shape or d.dtype.itemsize not in _SAME_SIZE_INT:
        return {"dx": np.where(out > 0, d, np.zeros((), dtype=d.dtype))}
    ints = _SAME_SIZE_INT[d.dtype.itemsize]
    if "dout" in ctx.donated and d.flags.c_contiguous and out.flags.c_contiguous:
        flat_out, flat_d = out.reshape(-1), d.reshape(-1).view(ints)
        lo, hi = MASK_BLOCK_RANGE
        step = min(hi, max(lo, d.size // 4))
        mask = np.empty(min(d.size, step), ints)
        for i in range(0, d.size, step):
            block = flat_d[i:i + step]
            _and_mask(flat_out[i:i + step], block, mask[:block.size], block)
        return {"dx": d}
    dx = np.empty(d.shape, dtype=d.dtype)
    bits = dx.view(ints)
    _and_mask(out, d.view(ints), bits, bits)
    return {"dx": dx}


def _and_mask(out, d_bits, mask, result):
    """result = d_bits where out > 0, else 0, through `mask` (may be `result`)."""
    np.greater(out, 0, out=mask, casting="unsafe")       # 1 or 0
    np.negative(mask, out=mask)                          # all ones or 0
    np.bitwise_and(mask, d_bits, out=result)


@kernel("relu", "gpu", dtypes=GPU_FLOATS)
def relu_gpu(op, ins, ctx):
    """out = max(x, 0) on the device."""
    return {"out": gpu.relu(ins["x"])}


@kernel("relu_grad", "gpu", dtypes=GPU_FLOATS)
def relu_grad_gpu(op, ins, ctx):
    """dx = dout where out > 0, else 0, on the device; nothing when dx is unbound."""
    if not op.wants("dx"):
        return {}
    return {"dx": gpu.relu_grad(ins["out"], ins["dout"])}


# ---- sigmoid, tanh, gelu, leaky_relu -------------------------------------------------

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


def finite(v):
    return None if np.isfinite(v) else "must be a finite number"


def register_activation(op_type, keep, attrs=()):
    """Register `op_type` (x -> out) and `<op_type>_grad` (keep, dout -> dx)."""
    schema = register(OpSchema(type=op_type, inputs=(Slot("x"),), outputs=(Slot("out"),),
                               attrs=attrs, infer=same_as_x(op_type),
                               grad=grad_maker(op_type + "_grad", keep=(keep,)), doc=__doc__))
    register(grad_schema(schema, inputs=(Slot(keep), Slot("dout")),
                         outputs=(Slot("dx", optional=True),),
                         infer=grad_like(op_type + "_grad", keep)))


register_activation("sigmoid", "out")
register_activation("tanh", "out")
register_activation("gelu", "x")
register_activation("leaky_relu", "x", attrs=(float_attr("alpha", 0.01, finite),))


def work(a):
    """`a` as float64 (no copy when it already is)."""
    return a.astype(np.float64, copy=False)


def sigmoid64(x):
    """1 / (1 + exp(-x)) of a float64 array, as exp(x) / (1 + exp(x)) for x < 0, from
    e = exp(-|x|) so that nothing overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


@kernel("sigmoid", "cpu")
def sigmoid_cpu(op, ins, ctx):
    """out = 1 / (1 + exp(-x)) (sigmoid64)."""
    x = ins["x"]
    return {"out": sigmoid64(work(x)).astype(x.dtype)}


@kernel("sigmoid_grad", "cpu")
def sigmoid_grad_cpu(op, ins, ctx):
    """dx = dout * out * (1 - out)."""
    out, d = work(ins["out"]), ins["dout"]
    return {"dx": (work(d) * out * (1.0 - out)).astype(d.dtype)}


@kernel("tanh", "cpu")
def tanh_cpu(op, ins, ctx):
    """out = tanh(x)."""
    x = ins["x"]
    return {"out": np.tanh(work(x)).astype(x.dtype)}


@kernel("tanh_grad", "cpu")
def tanh_grad_cpu(op, ins, ctx):
    """dx = dout * (1 - out^2)."""
    out, d = work(ins["out"]), ins["dout"]
    return {"dx": (work(d) * (1.0 - out * out)).astype(d.dtype)}


@kernel("gelu", "cpu")
def gelu_cpu(op, ins, ctx):
    """out = x * Phi(x), Phi from erfc so the left tail keeps its relative accuracy."""
    x = ins["x"]
    xw = work(x)
    return {"out": (xw * normal_cdf(xw)).astype(x.dtype)}


@kernel("gelu_grad", "cpu")
def gelu_grad_cpu(op, ins, ctx):
    """dx = dout * (Phi(x) + x * phi(x)); the x * phi(x) term is 0 for |x| >= 40."""
    x, d = work(ins["x"]), ins["dout"]
    inside = np.abs(x) < 40.0
    xi = np.where(inside, x, 0.0)
    density = np.where(inside, xi * np.exp(-0.5 * xi * xi) * INV_SQRT_2PI, 0.0)
    return {"dx": (work(d) * (normal_cdf(x) + density)).astype(d.dtype)}


@kernel("leaky_relu", "cpu")
def leaky_relu_cpu(op, ins, ctx):
    """out = x where x > 0, else alpha * x."""
    x = ins["x"]
    xw = work(x)
    return {"out": np.where(xw > 0, xw, op.attrs["alpha"] * xw).astype(x.dtype)}


@kernel("leaky_relu_grad", "cpu")
def leaky_relu_grad_cpu(op, ins, ctx):
    """dx = dout where x > 0, else alpha * dout."""
    x, d = ins["x"], ins["dout"]
    dw = work(d)
    return {"dx": np.where(x > 0, dw, op.attrs["alpha"] * dw).astype(d.dtype)}


# ---- GPU bindings: map-only kernels/<op>.cu ----

def register_map_gpu(op_type, keep, scalar=None):
    """GPU kernels of `op_type` and `<op_type>_grad` from kernels/<op_type>.cu, a
    map-only module: out = map(x[, attr]), dx = map_grad(keep, dout[, attr])."""
    def forward(op, ins, ctx):
        args = (op.attrs[scalar],) if scalar else ()
        return {"out": maps.unary(op_type, op_type, ins["x"], *args)}

    def backward(op, ins, ctx):
        if not op.wants("dx"):
            return {}
        args = (op.attrs[scalar],) if scalar else ()
        return {"dx": maps.binary(op_type, op_type + "_grad", ins[keep], ins["dout"], *args)}

    forward.__doc__ = f"{op_type} on the device (kernels/{op_type}.cu)."
    backward.__doc__ = f"{op_type}_grad on the device (kernels/{op_type}.cu), when bound."
    kernel(op_type, "gpu", dtypes=GPU_FLOATS)(forward)
    kernel(op_type + "_grad", "gpu", dtypes=GPU_FLOATS)(backward)


register_map_gpu("sigmoid", "out")
register_map_gpu("tanh", "out")
register_map_gpu("gelu", "x")
register_map_gpu("leaky_relu", "x", scalar="alpha")
