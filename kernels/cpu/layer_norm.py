"""CPU kernels of layer_norm (ops/layer_norm.py): the native kernels of norm_native
where they are built, else batch norm's stable numpy engine (batch_norm_stats).

x is viewed as R rows of L values (the axes before begin_norm_axis, and those
from it on); the scale and bias hold one value per position of a row (the
native kernels' affine index with post 1). On the numpy engine the rows'
statistics come from one read of x viewed as (1, R, L), batch norm's
per-channel reduction with the rows as its channels, and dx = k_dy g + k_x (x -
mean) + k_c per row, with g = dy * scale and the row sums of one `grad_sums`
pass. float16 works in float32.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import norm_native, prepared
from minigraph.kernels.cpu.batch_norm_stats import (
    as_work,
    centring_needed,
    grad_sums,
    input_grad,
    local_stats,
    normalize,
)
from minigraph.schema import OpError


def rows(x, begin):
    """(R, L): the rows and the row length of x normalised from axis `begin`."""
    return math.prod(x.shape[:begin]), math.prod(x.shape[begin:])


def normalized(x3, mean, invstd):
    """(x - mean) * invstd per row of the (1, R, L) view, in x's work dtype."""
    out = np.empty(x3.shape, x3.dtype)
    r = x3.shape[1]
    normalize(x3, mean, invstd, np.ones(r), np.zeros(r), out)
    return out


def check_rows(op, var, eps, what="epsilon"):
    """With eps 0, an OpError naming the first row (its index on the leading axes) whose
    variance is 0: nothing to divide by (`what`: the attribute eps is)."""
    if eps == 0 and var.size and not var.all():
        row = tuple(int(i) for i in np.argwhere(var == 0)[0])
        raise OpError(f"{op.type}: {what} is 0 and row {row} of input 'x' has variance 0 "
                      f"(all its values are equal): nothing to divide by; use {what} > 0")


def layer_norm_cpu(op, ins, ctx):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over each row; the rows' mean
    and (biased) variance."""
    out = layer_norm_rows(op, ins)
    check_rows(op, out["variance"], op.attrs["epsilon"])
    return out


def normalized_input(op, x, scale, bias, begin, eps):
    """layer_norm's y of x normalised from axis `begin` (its kernel's bits), for an op
    that normalises its input first (a fused op with layer_norm folded in: attribute
    norm_epsilon), with its errors."""
    out = normalize_rows(x, scale, bias, begin, eps)
    check_rows(op, out["variance"], eps, "norm_epsilon")
    return out["y"]


def layer_norm_rows(op, ins):
    """layer_norm_cpu's outputs, before the check of the variances."""
    a = op.attrs
    return normalize_rows(ins["x"], ins["scale"], ins["bias"], a["begin_norm_axis"],
                          a["epsilon"])


def normalize_rows(x, scale, bias, begin, eps):
    """{y, mean, variance} of x normalised from axis `begin` with epsilon `eps`."""
    shape = x.shape
    stat_shape = shape[:begin]
    r, length = math.prod(stat_shape), math.prod(shape[begin:])
    xw = as_work(x)
    done = norm_native.forward(xw.reshape(r, length), eps, scale, bias)
    if done is not None:
        y, stats = done
        if y.dtype != x.dtype:
            y, stats = y.astype(x.dtype), stats.astype(x.dtype)
        mean, var = stats.reshape((2, *stat_shape))
        return {"y": y.reshape(shape), "mean": mean, "variance": var}
    x3 = xw.reshape(1, r, length)
    _, mean, m2 = local_stats(x3)
    var = m2 / max(length, 1)
    with np.errstate(divide="ignore"):
        invstd = 1.0 / np.sqrt(var + eps)
    y = normalized(x3, mean, invstd).reshape(r, length)
    if scale is not None:
        y *= scale.astype(y.dtype, copy=False)
    if bias is not None:
        y += bias.astype(y.dtype, copy=False)
    return {"y": y.reshape(x.shape).astype(x.dtype, copy=False),
            "mean": mean.reshape(stat_shape).astype(x.dtype),
            "variance": var.reshape(stat_shape).astype(x.dtype)}


def bind_layer_norm(op):
    """layer_norm_cpu's bound form (minigraph.bound_run): the native forward into the
    same y, mean and variance every run, its call prepared again only when x, scale or
    bias is another array. None with epsilon 0 (each run would check the variances)."""
    eps, begin = op.attrs["epsilon"], op.attrs["begin_norm_axis"]
    if eps == 0:
        return None
    kept = {"key": None}

    def prepare(x, scale, bias):
        done = prepared_rows(x, scale, bias, begin, eps, kept)
        if done is None:
            return None
        y, stats, call = done
        if kept.get("out_of") is not y:
            mean, var = stats.reshape((2, *x.shape[:begin]))
            kept.update(out_of=y, out={"y": y, "mean": mean, "variance": var})
        return call, kept["out"]
    return prepared.form(("x", "scale", "bias"), prepare, streamed=("x",))


def prepared_rows(x, scale, bias, begin, eps, kept):
    """(y, stats, call) for a bound form (bind_layer_norm's, and a fused op's that
    normalises its input first): call() writes layer_norm's y of x (its bits) into y and
    the rows' mean and variance into stats (2, rows), arrays kept in the form's dict
    `kept` while x's shape and dtype stay; None where the native forward does not apply
    (or eps is 0: each run would check the variances)."""
    if eps == 0:
        return None
    key = (x.shape, x.dtype)
    if key != kept.get("key"):
        rows, length = math.prod(x.shape[:begin]), math.prod(x.shape[begin:])
        kept.update(key=key, rows=(rows, length),
                    y=prepared.aligned_empty(x.shape, x.dtype),
                    stats=prepared.aligned_empty((2, rows), x.dtype))
    call = norm_native.prepared_forward(x, *kept["rows"], eps, scale, bias, kept["y"],
                                        kept["stats"])
    return None if call is None else (kept["y"], kept["stats"], call)


def layer_norm_grad_cpu(op, ins, ctx):
    """dx, dscale and dbias (those bound) of layer_norm."""
    x, scale, dy = ins["x"], ins["scale"], ins["dy"]
    a = op.attrs
    r, length = rows(x, a["begin_norm_axis"])
    xw, dyw = as_work(x), as_work(dy)
    out = norm_native.backward(xw.reshape(r, length), dyw.reshape(r, length),
                               ins["mean"].reshape(r), ins["variance"].reshape(r),
                               a["epsilon"], scale,
                               want=[s for s in ("dx", "dscale", "dbias") if op.wants(s)])
    if out is not None:
        if "dx" in out:
            out["dx"] = out["dx"].reshape(x.shape)
        return {k: v.astype(x.dtype, copy=False) for k, v in out.items()}
    x3, dy3 = xw.reshape(1, r, length), dyw.reshape(1, r, length)
    mean = ins["mean"].astype(np.float64).reshape(-1)
    invstd = 1.0 / np.sqrt(ins["variance"].astype(np.float64).reshape(-1) + a["epsilon"])
    out = {}
    if op.wants("dscale") or op.wants("dbias"):
        dy2 = dy3.reshape(r, length)
        if op.wants("dbias"):
            out["dbias"] = dy2.sum(axis=0, dtype=np.float64).astype(x.dtype)
        if op.wants("dscale"):
            xhat = normalized(x3, mean, invstd).reshape(r, length)
            out["dscale"] = np.einsum("rl,rl->l", dy2, xhat, dtype=np.float64).astype(x.dtype)
    if op.wants("dx"):
        g3 = dy3 if scale is None else dy3 * scale.astype(dy3.dtype, copy=False)
        _, s_g, s_gxmu = grad_sums(x3, g3, mean, invstd)
        dx = np.empty(x3.shape, x3.dtype)
        m = max(length, 1)
        input_grad(x3, g3, mean, invstd, -invstd ** 3 * s_gxmu / m, -invstd * s_g / m, dx,
                   centring_needed(mean, invstd))
        out["dx"] = dx.reshape(x.shape).astype(x.dtype, copy=False)
    return out
