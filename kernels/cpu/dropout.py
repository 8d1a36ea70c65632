"""CPU kernels of dropout (ops/dropout.py): counter-based Philox masks, the same bits
as the GPU's (kernels/cuda/dropout.cu). The training forward runs the native kernel
of dropout_native where it applies; the numpy path here is its reference.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import dropout_native
from minigraph.kernels.cpu.philox import philox_words, uniforms24
from minigraph.schema import OpError

STREAM = 2      # fill.cu's uniform and gaussian initialisers use streams 0 and 1


def scale_factor(p, dtype):
    """1 / (1 - p) computed in float64, as a scalar of `dtype`."""
    return np.dtype(dtype).type(1.0 / (1.0 - p))


def seed_of(seed, step):
    """The 64-bit Philox key of a step: the op's seed, the step in the high word."""
    return int(seed) + ((int(step) & 0xFFFFFFFF) << 32)


def keep_mask(n, p, seed, step):
    """keep_i = u_i >= p for i < n (see the module docstring), a bool array."""
    return uniforms24(philox_words(n, STREAM, seed_of(seed, step))) >= p


def dropout_cpu(op, ins, ctx):
    """train: out = x * (keep * factor), mask = keep, then step += 1 in place;
    infer: out = a copy of x."""
    x, step = ins["x"], ins["step"]
    a = op.attrs
    if a["is_infer"]:
        return {"out": x.copy(), "step_out": step}
    p = a["p"]
    if p == 0.0:                        # every u_i >= 0: all kept, factor 1
        keep = np.ones(x.shape, dtype=bool)
        out = x.copy()
    else:
        done = dropout_native.forward(x, p, 1.0 / (1.0 - p), seed_of(a["seed"], step), STREAM)
        if done is not None:
            step[...] = step + 1
            return {"out": done[0], "mask": done[1], "step_out": step}
        keep = keep_mask(x.size, p, a["seed"], step).reshape(x.shape)
        out = x * (keep.astype(x.dtype) * scale_factor(p, x.dtype))
    step[...] = step + 1
    return {"out": out, "mask": keep.astype(np.uint8), "step_out": step}


def dropout_grad_cpu(op, ins, ctx):
    """dx = dout * (mask * factor); dx = a copy of dout for is_infer."""
    if not op.wants("dx"):
        return {}
    d, mask = ins["dout"], ins["mask"]
    if op.attrs["is_infer"]:
        return {"dx": d.copy()}
    if mask is None:
        raise OpError("dropout_grad: input 'mask' is required in training (is_infer=False)")
    return {"dx": d * (mask.astype(d.dtype) * scale_factor(op.attrs["p"], d.dtype))}
