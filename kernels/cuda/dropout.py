"""Launchers for kernels/cuda/dropout.cu: inverted dropout with masks from Philox, and
its gradient, on device arrays.

The mask of element i depends only on (seed, step, i) (see dropout.cu and
ops/philox.py): the CPU and the GPU drop the same elements. The step counter
is an int64 device scalar, read and incremented on the device.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import launch, loader
from minigraph.kernels.cuda import shape_ops as gpu_shape
from minigraph.schema import OpError

MODULE = "dropout"
_VARIANTS = [(t, w) for t, ws in (("f32", (1, 4)), ("f64", (1, 2))) for w in ws]
SIGNATURES = {**{f"dropout_{t}_w{w}": "PPPPPqddI" for t, w in _VARIANTS},
              **{f"dropout_grad_{t}_w{w}": "PPPqd" for t, w in _VARIANTS}}


def keep_factor(p):
    """1 / (1 - p) in double (the kernels round it to the data's dtype)."""
    return 1.0 / (1.0 - float(p))


def _check_p(p):
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")


def dropout(x, step, p, seed, want_mask=True):
    """(out, mask) of training-mode dropout: out = x * keep / (1 - p), mask =
    keep as uint8 (None unless `want_mask`), then step (an int64 device scalar)
    += 1 in place. seed: an int in [0, 2**32)."""
    _check_p(p)
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"dropout: seed must be in [0, 2**32), got {seed}")
    launch.check_array("dropout: step", step, (), np.int64)
    out = loader.empty(x.shape, x.dtype)
    mask = loader.empty(x.shape, np.uint8) if want_mask else None
    pointers = [loader.ptr(x, "dropout: x"), loader.ptr(out, "dropout: out"),
                loader.ptr(mask, "dropout: mask")]
    width = launch.vector_width(np.dtype(x.dtype).itemsize)
    if not launch.is_aligned(*pointers):
        width = 1
    name = f"dropout_{loader.suffix(x.dtype)}_w{width}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    grid = launch.flat_grid(-(-x.size // 4), dev, threads, k.resources)
    k.launch((grid, 1, 1), (threads, 1, 1), *pointers, loader.ptr(step, "dropout: step"),
             loader.ptr(loader.tickets(1)), x.size, float(p), keep_factor(p), int(seed))
    return out, mask


def dropout_grad(mask, dout, p, dx=None):
    """dx = dout * mask / (1 - p) (mask: uint8 of dout's shape). Returns dx."""
    _check_p(p)
    launch.check_array("dropout_grad: mask", mask, dout.shape, np.uint8)
    dx = loader.empty(dout.shape, dout.dtype) if dx is None else dx
    launch.check_array("dropout_grad: dx", dx, dout.shape, dout.dtype)
    if dout.size:
        loader.launch_flat(MODULE, SIGNATURES, "dropout_grad_{t}_w{w}", dout.dtype, dout.size,
                           (mask, dout, dx), dout.size, keep_factor(p))
    return dx


# ---- op kernels -------------------------------------------------------------------

def dropout_gpu(op, ins, ctx):
    """train: the CPU's masks drawn on the device (same bits), step += 1 there;
    infer: out = a device copy of x."""
    x, step = ins["x"], ins["step"]
    a = op.attrs
    if a["is_infer"]:
        return {"out": gpu_shape.copy(x), "step_out": step}
    out, mask = dropout(x, step, a["p"], a["seed"], want_mask=op.wants("mask"))
    return present(out=out, mask=mask, step_out=step)


def dropout_grad_gpu(op, ins, ctx):
    """dx = dout * (mask * factor) on the device; a copy of dout for is_infer."""
    if not op.wants("dx"):
        return {}
    d, mask = ins["dout"], ins["mask"]
    if op.attrs["is_infer"]:
        return {"dx": gpu_shape.copy(d)}
    if mask is None:
        raise OpError("dropout_grad: input 'mask' is required in training (is_infer=False)")
    return {"dx": dropout_grad(mask, d, op.attrs["p"])}
