"""CPU kernels of the activations (ops/activation.py): relu, sigmoid, tanh, gelu,
leaky_relu and their gradients. Outputs keep x's dtype; sigmoid, tanh, gelu and
leaky_relu compute in float64 and cast back, and float32 runs in C where the native
kernels apply (gelu_native; activation_native: sigmoid, tanh, leaky_relu, and silu's);
relu runs on the blocked engine, its gradient in C (relu_native) where it applies,
and both write into a handed-over input (KernelContext.donated).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import activation_native, blocks, gelu_native, prepared, relu_native
from minigraph.kernels.cpu.erf import normal_cdf

INV_SQRT_2PI = 0.3989422804014327        # 1 / sqrt(2 pi)


def relu_cpu(op, ins, ctx):
    """out = max(x, 0), elementwise; into x's array when it is handed over."""
    x = ins["x"]
    return {"out": blocks.relu(x, out=x if "x" in ctx.donated else None)}


_SAME_SIZE_INT = {2: np.int16, 4: np.int32, 8: np.int64}


# values per block when dx is written over dout: a quarter of it, at least 4096 (smaller
# blocks pay more per call than they save) and at most 65536 (the mask stays in cache)
MASK_BLOCK_RANGE = (1 << 12, 1 << 16)


def relu_grad_cpu(op, ins, ctx):
    """dx = dout where out > 0, else 0 (+0.0): the bits of dout ANDed with a mask of
    all ones or zeros, the same values as np.where and many times faster: in one pass
    in C (relu_native) where it applies, else in numpy. When dout is handed over, dx
    is written into it (numpy: block by block through a small mask)."""
    out, d = ins["out"], ins["dout"]
    if d.dtype != out.dtype or d.shape != out.shape or d.dtype.itemsize not in _SAME_SIZE_INT:
        return {"dx": np.where(out > 0, d, np.zeros((), dtype=d.dtype))}
    dx = d if "dout" in ctx.donated else np.empty(d.shape, dtype=d.dtype)
    if relu_native.relu_grad(out, d, dx):
        return {"dx": dx}
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
    if dx is d:                         # handed over, but not contiguous
        dx = np.empty(d.shape, dtype=d.dtype)
    bits = dx.view(ints)
    _and_mask(out, d.view(ints), bits, bits)
    return {"dx": dx}


def _and_mask(out, d_bits, mask, result):
    """result = d_bits where out > 0, else 0, through `mask` (may be `result`)."""
    np.greater(out, 0, out=mask, casting="unsafe")       # 1 or 0
    np.negative(mask, out=mask)                          # all ones or 0
    np.bitwise_and(mask, d_bits, out=result)


def work(a):
    """`a` as float64 (no copy when it already is)."""
    return a.astype(np.float64, copy=False)


def sigmoid64(x):
    """1 / (1 + exp(-x)) of a float64 array, as exp(x) / (1 + exp(x)) for x < 0, from
    e = exp(-|x|) so that nothing overflows."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


def native_forward(kind, x, alpha=0.0):
    """`kind`'s float32 forward in C (activation_native), or None where it does not
    apply."""
    return activation_native.forward(kind, x, alpha)


def into_dout(ins, ctx, dx):
    """{"dx": dx}, its values copied into dout where dout is handed over (the op's reuse:
    the native kernels write there)."""
    d = ins["dout"]
    if "dout" in ctx.donated and d.shape == dx.shape and d.dtype == dx.dtype:
        np.copyto(d, dx)
        return {"dx": d}
    return {"dx": dx}


def native_backward(kind, ins, ctx, v, alpha=0.0):
    """`kind`'s float32 gradient in C for ins["dout"] (v: the op's out or x), written
    into dout where it is handed over (the op's reuse), or None where it does not
    apply."""
    d = ins["dout"]
    return activation_native.backward(kind, v, d, alpha, d if "dout" in ctx.donated else None)


def sigmoid_cpu(op, ins, ctx):
    """out = 1 / (1 + exp(-x)) (sigmoid64; float32 in C where it applies)."""
    x = ins["x"]
    out = native_forward("sigmoid", x)
    return {"out": sigmoid64(work(x)).astype(x.dtype) if out is None else out}


def sigmoid_grad_cpu(op, ins, ctx):
    """dx = dout * out * (1 - out)."""
    dx = native_backward("sigmoid", ins, ctx, ins["out"])
    if dx is not None:
        return {"dx": dx}
    out, d = work(ins["out"]), ins["dout"]
    return into_dout(ins, ctx, (work(d) * out * (1.0 - out)).astype(d.dtype))


def tanh_cpu(op, ins, ctx):
    """out = tanh(x) (float32 in C where it applies)."""
    x = ins["x"]
    out = native_forward("tanh", x)
    return {"out": np.tanh(work(x)).astype(x.dtype) if out is None else out}


def tanh_grad_cpu(op, ins, ctx):
    """dx = dout * (1 - out^2)."""
    dx = native_backward("tanh", ins, ctx, ins["out"])
    if dx is not None:
        return {"dx": dx}
    out, d = work(ins["out"]), ins["dout"]
    return into_dout(ins, ctx, (work(d) * (1.0 - out * out)).astype(d.dtype))


def gelu_cpu(op, ins, ctx):
    """out = x * Phi(x), Phi from erfc so the left tail keeps its relative accuracy
    (float32: the native kernel, in float, where it applies)."""
    return {"out": gelu(ins["x"])}


def gelu(x, out=None):
    """x * Phi(x) in x's dtype, into `out` (x's shape and dtype; it may be x) when given,
    else into a new array: the native float32 kernel where it applies, else in float64
    (gelu_cpu's bits)."""
    out = np.empty(x.shape, x.dtype) if out is None else out
    call = gelu_native.prepared_forward(x, out)
    if call is not None:
        call()
        return out
    xw = work(x)
    out[...] = xw * normal_cdf(xw)
    return out


def bind_gelu(op):
    """gelu_cpu's bound form (minigraph.bound_run): the native float32 kernel into the
    same array every run, its call prepared again only when x is another array."""
    return bind_elementwise(gelu_native.prepared_forward)


def bind_elementwise(prepared_forward):
    """The bound form (minigraph.bound_run) of an elementwise forward whose native
    float32 call prepared_forward(x, out) makes (None where it does not apply): into
    the same array every run, prepared again only when x is another array."""
    kept = {"key": None}

    def prepare(x):
        if (x.shape, x.dtype) != kept["key"]:
            out = prepared.aligned_empty(x.shape, x.dtype)
            kept.update(key=(x.shape, x.dtype), out=out, outs={"out": out})
        call = prepared_forward(x, kept["out"])
        return None if call is None else (call, kept["outs"])
    return prepared.form(("x",), prepare, streamed=("x",))


def bind_native(kind):
    """The binder of `kind`'s forward (activation_native: leaky_relu, sigmoid, tanh,
    silu): bind(op) gives its bound form (bind_elementwise)."""
    def bind(op):
        alpha = op.attrs.get("alpha", 0.0)
        return bind_elementwise(
            lambda x, out: activation_native.prepared_forward(kind, x, out, alpha))
    return bind


def gelu_grad_cpu(op, ins, ctx):
    """dx = dout * (Phi(x) + x * phi(x)); the x * phi(x) term is 0 for |x| >= 40
    (float32: the native kernel, in float, where it applies)."""
    done = gelu_native.backward(ins["x"], ins["dout"])
    if done is not None:
        return {"dx": done}
    x, d = work(ins["x"]), ins["dout"]
    inside = np.abs(x) < 40.0
    xi = np.where(inside, x, 0.0)
    density = np.where(inside, xi * np.exp(-0.5 * xi * xi) * INV_SQRT_2PI, 0.0)
    return {"dx": (work(d) * (normal_cdf(x) + density)).astype(d.dtype)}


def leaky_relu_cpu(op, ins, ctx):
    """out = x where x > 0, else alpha * x (float32 in C where it applies, the same
    bits)."""
    x = ins["x"]
    out = native_forward("leaky_relu", x, op.attrs["alpha"])
    if out is not None:
        return {"out": out}
    xw = work(x)
    return {"out": np.where(xw > 0, xw, op.attrs["alpha"] * xw).astype(x.dtype)}


def leaky_relu_grad_cpu(op, ins, ctx):
    """dx = dout where x > 0, else alpha * dout."""
    dx = native_backward("leaky_relu", ins, ctx, ins["x"], op.attrs["alpha"])
    if dx is not None:
        return {"dx": dx}
    x, d = ins["x"], ins["dout"]
    dw = work(d)
    return into_dout(ins, ctx, np.where(x > 0, dw, op.attrs["alpha"] * dw).astype(d.dtype))
