"""CPU kernels of group_norm and instance_norm (ops/group_norm.py,
ops/instance_norm.py): the native kernels of norm_native where they are built,
else batch norm's stable numpy engine (batch_norm_stats).

x (N, C, *spatial) is NCHW-contiguous, so group g of sample n is one contiguous
row of C/G * S values (S the spatial size). The native kernels normalise the
N G rows with the affine index of channel c = (e / S) % C for value e. On the
numpy engine the statistics of the rows come from one read of x viewed as (1,
N G, C/G S) - batch norm's per-channel reduction with the rows as its
channels; normalising, the affine and the gradient then work on the (1, N C,
S) view with per-(sample, channel) constants, so each is one pass over x: y =
(x - mean) invstd scale + bias, and dx = k_dy dy + k_x (x - mean) + k_c with
the group sums of one `grad_sums` pass. instance_norm is group_norm with a
group per channel. float16 works in float32.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import norm_native
from minigraph.kernels.cpu.batch_norm_stats import (
    as_work,
    centring_needed,
    grad_sums,
    input_grad,
    local_stats,
    normalize,
)


def _sizes(x, groups):
    n, c = x.shape[:2]
    return n, c, groups, c // groups, math.prod(x.shape[2:])


def forward(x, scale, bias, groups, eps):
    """(y, mean (N, G), variance (N, G)) of x; scale and bias (C,) or None."""
    n, c, g, cg, s = _sizes(x, groups)
    xw = as_work(x)
    done = norm_native.forward(xw.reshape(n * g, cg * s), eps, scale, bias, post=s, size=c)
    if done is not None:
        y, stats = done
        y, stats = y.astype(x.dtype, copy=False), stats.astype(x.dtype, copy=False)
        return y.reshape(x.shape), stats[0].reshape(n, g), stats[1].reshape(n, g)
    _, mean, m2 = local_stats(xw.reshape(1, n * g, cg * s))
    var = m2 / max(cg * s, 1)
    invstd = 1.0 / np.sqrt(var + eps)
    ones = np.ones(c)
    scale_nc = np.tile(ones if scale is None else scale.astype(np.float64), n)
    bias_nc = np.tile(np.zeros(c) if bias is None else bias.astype(np.float64), n)
    y = np.empty(xw.shape, xw.dtype)
    normalize(xw.reshape(1, n * c, s), np.repeat(mean, cg), np.repeat(invstd, cg), scale_nc,
              bias_nc, y.reshape(1, n * c, s))
    return (y.astype(x.dtype, copy=False), mean.reshape(n, g).astype(x.dtype),
            var.reshape(n, g).astype(x.dtype))


def backward(x, scale, mean, var, dy, groups, eps, need):
    """{dx, dscale, dbias} (those in `need`) from x, the saved statistics and dy."""
    n, c, g, cg, s = _sizes(x, groups)
    xw, dyw = as_work(x), as_work(dy)
    out = norm_native.backward(xw.reshape(n * g, cg * s), dyw.reshape(n * g, cg * s),
                               mean.reshape(n * g), var.reshape(n * g), eps, scale, post=s,
                               size=c, want=need)
    if out is not None:
        if "dx" in out:
            out["dx"] = out["dx"].reshape(x.shape)
        return {k: v.astype(x.dtype, copy=False) for k, v in out.items()}
    mean = mean.astype(np.float64).reshape(-1)
    invstd = 1.0 / np.sqrt(var.astype(np.float64).reshape(-1) + eps)
    mean_nc, invstd_nc = np.repeat(mean, cg), np.repeat(invstd, cg)
    x3, dy3 = xw.reshape(1, n * c, s), dyw.reshape(1, n * c, s)
    _, s_dy, s_dyxmu = grad_sums(x3, dy3, mean_nc, invstd_nc)       # per (sample, channel)
    out = {}
    if "dbias" in need:
        out["dbias"] = s_dy.reshape(n, c).sum(axis=0).astype(x.dtype)
    if "dscale" in need:
        out["dscale"] = (s_dyxmu * invstd_nc).reshape(n, c).sum(axis=0).astype(x.dtype)
    if "dx" in need:
        scale_nc = np.tile(np.ones(c) if scale is None else scale.astype(np.float64), n)
        s_g = (scale_nc * s_dy).reshape(n * g, cg).sum(axis=1)
        s_gxmu = (scale_nc * s_dyxmu).reshape(n * g, cg).sum(axis=1)
        m = max(cg * s, 1)
        k_x = np.repeat(-invstd ** 3 * s_gxmu / m, cg)
        k_c = np.repeat(-invstd * s_g / m, cg)
        dx = np.empty(xw.shape, xw.dtype)
        input_grad(x3, dy3, mean_nc, invstd_nc * scale_nc, k_x, k_c, dx.reshape(1, n * c, s),
                   centring_needed(mean_nc, invstd_nc))
        out["dx"] = dx.astype(x.dtype, copy=False)
    return out


def group_norm_cpu(op, ins, ctx):
    """y, mean and variance of every group of channels, per sample."""
    a = op.attrs
    y, mean, var = forward(ins["x"], ins["scale"], ins["bias"], a["groups"], a["epsilon"])
    return {"y": y, "mean": mean, "variance": var}


def group_norm_grad_cpu(op, ins, ctx):
    """dx, dscale and dbias (those bound) of group_norm."""
    need = [s for s in ("dx", "dscale", "dbias") if op.wants(s)]
    return backward(ins["x"], ins["scale"], ins["mean"], ins["variance"], ins["dy"],
                    op.attrs["groups"], op.attrs["epsilon"], need)


def instance_norm_cpu(op, ins, ctx):
    """group_norm with a group per channel."""
    x = ins["x"]
    y, mean, var = forward(x, ins["scale"], ins["bias"], x.shape[1], op.attrs["epsilon"])
    return {"y": y, "mean": mean, "variance": var}


def instance_norm_grad_cpu(op, ins, ctx):
    """group_norm_grad with a group per channel."""
    x = ins["x"]
    need = [s for s in ("dx", "dscale", "dbias") if op.wants(s)]
    return backward(x, ins["scale"], ins["mean"], ins["variance"], ins["dy"], x.shape[1],
                    op.attrs["epsilon"], need)
