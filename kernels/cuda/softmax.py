"""Launchers for kernels/cuda/softmax.cu: softmax along any axis and its gradient,
computed in double on the device."""
from __future__ import annotations

import math

from minigraph.kernels.cuda import launch, loader

MODULE = "softmax"
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"softmax_rows_{_t}": "PPqi", f"softmax_columns_{_t}": "PPqqq",
                       f"softmax_grad_rows_{_t}": "PPPqi",
                       f"softmax_grad_columns_{_t}": "PPPqqq"})


def axis_view(what, shape, axis):
    """(pre, K, post) of `shape` around `axis` (negative counts from the end);
    ValueError naming `what` when the axis is out of range."""
    shape = tuple(int(n) for n in shape)
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"{what}: axis {axis} is out of range for shape {shape}")
    a = axis % len(shape)
    return math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])


def _launch(kind, dtype, pre, k_len, post, *pointers):
    sfx = loader.suffix(dtype)
    dev = loader.device()
    if post == 1:
        if k_len >= 2**31:
            raise ValueError(f"{kind}: {k_len} values along the axis; at most 2**31 - 1")
        name = f"{kind}_rows_{sfx}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        threads = launch.row_block_threads(k_len, dev)
        k.launch((launch.rows_grid(pre, threads, dev, k.resources), 1, 1), (threads, 1, 1),
                 *pointers, pre, k_len)
    else:
        name = f"{kind}_columns_{sfx}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        threads = launch.block_threads(dev)
        k.launch((launch.flat_grid(pre * post, dev, threads, k.resources), 1, 1),
                 (threads, 1, 1), *pointers, pre, k_len, post)


def softmax(x, axis=-1, out=None):
    """exp(x - max) / sum(exp(x - max)) along `axis`, in double. Returns out
    (a new array of x's shape and dtype unless given)."""
    pre, k_len, post = axis_view("softmax", x.shape, axis)
    out = loader.empty(x.shape, x.dtype) if out is None else out
    launch.check_array("softmax: out", out, x.shape, x.dtype)
    if x.size:
        _launch("softmax", x.dtype, pre, k_len, post, loader.ptr(x, "softmax: x"),
                loader.ptr(out, "softmax: out"))
    return out


def softmax_grad(out, dout, axis=-1, dx=None):
    """dx = out * (dout - sum(dout * out, axis)) (out: softmax's output), in double.
    Returns dx."""
    pre, k_len, post = axis_view("softmax_grad", out.shape, axis)
    launch.check_array("softmax_grad: dout", dout, out.shape, out.dtype)
    dx = loader.empty(out.shape, out.dtype) if dx is None else dx
    launch.check_array("softmax_grad: dx", dx, out.shape, out.dtype)
    if out.size:
        _launch("softmax_grad", out.dtype, pre, k_len, post, loader.ptr(out),
                loader.ptr(dout), loader.ptr(dx))
    return dx


# ---- op kernels -------------------------------------------------------------------

def softmax_gpu(op, ins, ctx):
    """out = softmax of x along axis, in double on the device."""
    return {"out": softmax(ins["x"], op.attrs["axis"])}


def softmax_grad_gpu(op, ins, ctx):
    """dx = out * (dout - sum(dout * out, axis)) on the device, when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": softmax_grad(ins["out"], ins["dout"], op.attrs["axis"])}
