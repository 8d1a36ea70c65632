"""CPU kernels of group_norm, instance_norm and tracked_instance_norm (ops/group_norm.py,
ops/instance_norm.py): the native kernels of norm_native where they are built, else
batch norm's stable numpy engine (batch_norm_stats).

NCHW: x (N, C, *spatial) is C-contiguous, so group g of sample n is one contiguous
row of C/G * S values (S the spatial size). The native kernels normalise the
N G rows with the affine index of channel c = (e / S) % C for value e. On the
numpy engine the statistics of the rows come from one read of x viewed as (1,
N G, C/G S) - batch norm's per-channel reduction with the rows as its
channels; normalising, the affine and the gradient then work on the (1, N C,
S) view with per-(sample, channel) constants, so each is one pass over x: y =
(x - mean) invstd scale + bias, and dx = k_dy dy + k_x (x - mean) + k_c with
the group sums of one `grad_sums` pass.

NHWC: x (N, *spatial, C). Sample n is an (S, C) matrix: batch norm's per-channel
engine (native or numpy) takes it as (S, C, 1) and gives each channel's (n, mean,
M2), merged over a group's channels with Chan's formula; normalising and the
gradient sums are batch norm's per-channel passes with the group's constants
repeated over its channels. One pass per sample, no transposed copy.

instance_norm is group_norm with a group per channel. float16 works in float32.
With epsilon 0 a zero variance is an error naming the sample and the group.
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
from minigraph.schema import OpError


def sizes(x, groups, layout="NCHW"):
    """(N, C, G, C / G, S) of x in `layout` with `groups` groups."""
    n = x.shape[0]
    c = x.shape[1] if layout == "NCHW" else x.shape[-1]
    spatial = x.shape[2:] if layout == "NCHW" else x.shape[1:-1]
    return n, c, groups, c // groups, math.prod(spatial)


def check_variance(what, var, eps, per_channel):
    """With eps 0, an OpError naming the first (sample, group) whose variance is 0
    (nothing to divide by); `per_channel`: the groups are channels (instance_norm)."""
    if eps != 0:
        return
    zero = np.argwhere(np.asarray(var).reshape(var.shape[0], -1) == 0)
    if zero.size:
        n, g = (int(v) for v in zero[0])
        unit = f"channel {g}" if per_channel else f"group {g}"
        raise OpError(f"{what}: epsilon is 0 and sample {n}, {unit} of input 'x' has variance "
                      f"0 (all its values are equal): nothing to divide by; use epsilon > 0")


def per_channel(values, cg):
    """(N, G) values as (N, C): each group's value repeated over its cg channels."""
    return np.repeat(np.asarray(values, np.float64), cg, axis=-1)


def affine_nc(scale, bias, n, c):
    """(scale, bias) per (sample, channel) as float64 (N C,) vectors; 1 and 0 without them."""
    return (np.tile(np.ones(c) if scale is None else scale.astype(np.float64), n),
            np.tile(np.zeros(c) if bias is None else bias.astype(np.float64), n))


def forward(x, scale, bias, groups, eps, layout="NCHW"):
    """(y, mean (N, G), variance (N, G)) of x; scale and bias (C,) or None."""
    if layout == "NHWC":
        return forward_nhwc(x, scale, bias, groups, eps)
    n, c, g, cg, s = sizes(x, groups)
    xw = as_work(x)
    done = norm_native.forward(xw.reshape(n * g, cg * s), eps, scale, bias, post=s, size=c)
    if done is not None:
        y, stats = done
        y, stats = y.astype(x.dtype, copy=False), stats.astype(x.dtype, copy=False)
        return y.reshape(x.shape), stats[0].reshape(n, g), stats[1].reshape(n, g)
    _, mean, m2 = local_stats(xw.reshape(1, n * g, cg * s))
    var = m2 / max(cg * s, 1)
    with np.errstate(divide="ignore"):
        invstd = 1.0 / np.sqrt(var + eps)
    scale_nc, bias_nc = affine_nc(scale, bias, n, c)
    y = np.empty(xw.shape, xw.dtype)
    normalize(xw.reshape(1, n * c, s), np.repeat(mean, cg), np.repeat(invstd, cg), scale_nc,
              bias_nc, y.reshape(1, n * c, s))
    return (y.astype(x.dtype, copy=False), mean.reshape(n, g).astype(x.dtype),
            var.reshape(n, g).astype(x.dtype))


def sample_stats(x3, g, cg):
    """(mean, biased variance) per group (G,) of one NHWC sample viewed as (S, C, 1):
    per-channel (n, mean, M2) from batch norm's engine, merged over each group's
    channels (Chan: M2 = sum M2_c + n_c sum (mean_c - mean)^2)."""
    count, mean_c, m2_c = local_stats(x3)
    mean_c, m2_c = mean_c.reshape(g, cg), m2_c.reshape(g, cg)
    mean = mean_c.mean(axis=1)
    m2 = m2_c.sum(axis=1) + count * ((mean_c - mean[:, None]) ** 2).sum(axis=1)
    return mean, m2 / max(count * cg, 1)


def forward_nhwc(x, scale, bias, groups, eps):
    """forward() of x (N, *spatial, C): per sample, batch norm's per-channel engine."""
    n, c, g, cg, s = sizes(x, groups, "NHWC")
    xw = as_work(x).reshape(n, s, c)
    y = np.empty(xw.shape, xw.dtype)
    mean, var = np.zeros((n, g)), np.zeros((n, g))
    scale_c = np.ones(c) if scale is None else scale.astype(np.float64)
    bias_c = np.zeros(c) if bias is None else bias.astype(np.float64)
    for i in range(n):
        x3 = xw[i].reshape(s, c, 1)
        mean[i], var[i] = sample_stats(x3, g, cg)
        with np.errstate(divide="ignore"):
            invstd = 1.0 / np.sqrt(var[i] + eps)
        normalize(x3, np.repeat(mean[i], cg), np.repeat(invstd, cg), scale_c, bias_c,
                  y[i].reshape(s, c, 1))
    return (y.reshape(x.shape).astype(x.dtype, copy=False), mean.astype(x.dtype),
            var.astype(x.dtype))


def backward(x, scale, mean, var, dy, groups, eps, need, layout="NCHW"):
    """{dx, dscale, dbias} (those in `need`) from x, the saved statistics and dy."""
    if layout == "NHWC":
        return backward_nhwc(x, scale, mean, var, dy, groups, eps, need)
    n, c, g, cg, s = sizes(x, groups)
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
        scale_nc, _ = affine_nc(scale, None, n, c)
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


def backward_nhwc(x, scale, mean, var, dy, groups, eps, need):
    """backward() of x (N, *spatial, C): per sample, batch norm's per-channel gradient
    sums and input gradient with the group's constants on its channels."""
    n, c, g, cg, s = sizes(x, groups, "NHWC")
    xw, dyw = as_work(x).reshape(n, s, c), as_work(dy).reshape(n, s, c)
    scale_c = np.ones(c) if scale is None else scale.astype(np.float64)
    mean = mean.astype(np.float64).reshape(n, g)
    invstd = 1.0 / np.sqrt(var.astype(np.float64).reshape(n, g) + eps)
    dscale, dbias = np.zeros(c), np.zeros(c)
    dx = np.empty(xw.shape, xw.dtype) if "dx" in need else None
    m = max(cg * s, 1)
    for i in range(n):
        x3, dy3 = xw[i].reshape(s, c, 1), dyw[i].reshape(s, c, 1)
        mean_c, invstd_c = np.repeat(mean[i], cg), np.repeat(invstd[i], cg)
        _, s_dy, s_dyxmu = grad_sums(x3, dy3, mean_c, invstd_c)      # per channel
        dbias += s_dy
        dscale += s_dyxmu * invstd_c
        if dx is not None:
            s_g = (scale_c * s_dy).reshape(g, cg).sum(axis=1)
            s_gxmu = (scale_c * s_dyxmu).reshape(g, cg).sum(axis=1)
            k_x = np.repeat(-invstd[i] ** 3 * s_gxmu / m, cg)
            k_c = np.repeat(-invstd[i] * s_g / m, cg)
            input_grad(x3, dy3, mean_c, invstd_c * scale_c, k_x, k_c, dx[i].reshape(s, c, 1),
                       centring_needed(mean_c, invstd_c))
    out = {"dscale": dscale.astype(x.dtype), "dbias": dbias.astype(x.dtype)}
    out = {k: v for k, v in out.items() if k in need}
    if dx is not None:
        out["dx"] = dx.reshape(x.shape).astype(x.dtype, copy=False)
    return out


def check_group_values(op, x, groups, layout):
    """PyTorch's check: an OpError when the batch holds one value per group in all
    (a single sample whose groups hold one value each: nothing to normalise)."""
    n, _, _, cg, s = sizes(x, groups, layout)
    if n * cg * s == 1:
        raise OpError(f"{op.type}: input 'x' needs more than one value per group, got shape "
                      f"{tuple(x.shape)} ({layout}) with {groups} groups")


def group_norm_cpu(op, ins, ctx):
    """y, mean and variance of every group of channels, per sample."""
    a = op.attrs
    x = ins["x"]
    check_group_values(op, x, a["groups"], a["data_layout"])
    y, mean, var = forward(x, ins["scale"], ins["bias"], a["groups"], a["epsilon"],
                           a["data_layout"])
    check_variance(op.type, var, a["epsilon"], per_channel=False)
    return {"y": y, "mean": mean, "variance": var}


def group_norm_grad_cpu(op, ins, ctx):
    """dx, dscale and dbias (those bound) of group_norm."""
    need = [s for s in ("dx", "dscale", "dbias") if op.wants(s)]
    a = op.attrs
    return backward(ins["x"], ins["scale"], ins["mean"], ins["variance"], ins["dy"],
                    a["groups"], a["epsilon"], need, a["data_layout"])


def channels(x, layout):
    """The channel count of x in `layout`."""
    return x.shape[1] if layout == "NCHW" else x.shape[-1]


def instance_norm_cpu(op, ins, ctx):
    """group_norm with a group per channel."""
    x, a = ins["x"], op.attrs
    y, mean, var = forward(x, ins["scale"], ins["bias"], channels(x, a["data_layout"]),
                           a["epsilon"], a["data_layout"])
    check_variance(op.type, var, a["epsilon"], per_channel=True)
    return {"y": y, "mean": mean, "variance": var}


def instance_norm_grad_cpu(op, ins, ctx):
    """group_norm_grad with a group per channel."""
    x, a = ins["x"], op.attrs
    need = [s for s in ("dx", "dscale", "dbias") if op.wants(s)]
    return backward(x, ins["scale"], ins["mean"], ins["variance"], ins["dy"],
                    channels(x, a["data_layout"]), a["epsilon"], need, a["data_layout"])
