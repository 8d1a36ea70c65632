"""Independent float64 numpy references, one of each, shared by every suite: the CPU op
tests (through helpers.helper_test_op) and the GPU launcher tests (tests/gpu).

Each function takes numpy arrays and plain attributes and returns float64 arrays
(or Python ints for Philox words). They follow the design's definitions, not the
kernels' code: direct loops or numpy reductions in float64. tests/test_references.py
checks them against known answers, direct formulas and their adjoints. Layer, group
and instance norm's are in tests/references_norms.py.
"""
from __future__ import annotations

import numpy as np


def pair(v):
    """(v, v) for an int, else the pair itself as a tuple."""
    return (v, v) if isinstance(v, int | np.integer) else tuple(v)


# ---- batch norm ----------------------------------------------------------------------


def channel_axis(ndim, layout):
    """The channel axis of a rank-`ndim` tensor in `layout` ("NCHW": 1, "NHWC": last)."""
    return 1 if layout == "NCHW" else ndim - 1


def per_channel(v, ndim, layout):
    """Per-channel values `v` as float64, shaped to broadcast against a rank-`ndim` tensor."""
    shape = [1] * ndim
    shape[channel_axis(ndim, layout)] = -1
    return np.asarray(v, np.float64).reshape(shape)


def reduce_axes(ndim, layout):
    """Every axis but the channel axis: the axes batch statistics reduce over."""
    return tuple(a for a in range(ndim) if a != channel_axis(ndim, layout))


def batch_stats(x, layout):
    """Per-channel (mean, biased variance, n) of x in float64, two-pass."""
    x = np.asarray(x, np.float64)
    axes = reduce_axes(x.ndim, layout)
    mean = x.mean(axis=axes)
    var = ((x - per_channel(mean, x.ndim, layout)) ** 2).mean(axis=axes)
    return mean, var, x.size // x.shape[channel_axis(x.ndim, layout)]


def bn_normalize(x, scale, bias, mean, var, epsilon, layout):
    """y = (x - mean) / sqrt(var + epsilon) * scale + bias, per channel, in float64."""
    nd = np.ndim(x)
    return ((np.asarray(x, np.float64) - per_channel(mean, nd, layout))
            / np.sqrt(per_channel(var, nd, layout) + epsilon)
            * per_channel(scale, nd, layout) + per_channel(bias, nd, layout))


def bn_estimates(est_mean, est_var, mean, var, n, counter, momentum, first_batch=True):
    """(mean, var) estimates after one training batch of per-channel statistics
    (mean, biased var) over n values: the unbiased variance var * n / (n - 1) replaces
    the estimates on the first batch (counter == 0) when first_batch; afterwards (from
    the first batch on without first_batch: PyTorch's _NormBase) momentum weights the
    old estimate, or momentum None averages the counter + 1 batches seen. counter None
    (no counter): never the first-batch rule, and momentum must be a number."""
    unbiased = np.asarray(var, np.float64) * n / (n - 1)
    return blend_estimates(est_mean, est_var, mean, unbiased, counter, momentum, first_batch)


def blend_estimates(est_mean, est_var, mean, unbiased, counter, momentum, first_batch=True):
    """bn_estimates from the batch's mean and unbiased variance."""
    est_mean, est_var = np.float64(est_mean), np.float64(est_var)
    if first_batch and counter is not None and counter == 0:
        return np.asarray(mean, np.float64), unbiased
    if momentum is None:
        if counter is None:
            raise ValueError("bn_estimates: momentum None needs a counter")
        k = counter + 1
        return est_mean + (mean - est_mean) / k, est_var + (unbiased - est_var) / k
    return (momentum * est_mean + (1 - momentum) * mean,
            momentum * est_var + (1 - momentum) * unbiased)


def batch_norm(x, est_mean, est_var, scale, bias, counter=None, layout="NCHW", is_infer=False,
               use_global_est=False, epsilon=1e-5, momentum=0.9, first_batch=True):
    """Everything the batch_norm op produces, in float64: {"y", "batch_mean",
    "batch_var" (the statistics y used), "estimated_mean", "estimated_var",
    "num_batches" (after the op; None without a counter)}."""
    est_mean, est_var = np.float64(est_mean), np.float64(est_var)
    if is_infer or use_global_est:
        mean, var = est_mean, est_var
        new_mean, new_var, new_counter = est_mean, est_var, counter
    else:
        mean, var, n = batch_stats(x, layout)
        new_mean, new_var = bn_estimates(est_mean, est_var, mean, var, n, counter, momentum,
                                         first_batch)
        new_counter = None if counter is None else counter + 1
    return {"y": bn_normalize(x, scale, bias, mean, var, epsilon, layout), "batch_mean": mean,
            "batch_var": var, "estimated_mean": new_mean, "estimated_var": new_var,
            "num_batches": new_counter}


def batch_norm_grad(x, dy, scale, mean, var, epsilon, layout, use_global_est):
    """(dx, dscale, dbias) of batch norm at the statistics (mean, var) y used, by the
    closed form; with use_global_est the statistics are constants."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    nd = x.ndim
    axes = reduce_axes(nd, layout)
    invstd = 1 / np.sqrt(np.asarray(var, np.float64) + epsilon)
    xhat = (x - per_channel(mean, nd, layout)) * per_channel(invstd, nd, layout)
    dbias, dscale = dy.sum(axis=axes), (dy * xhat).sum(axis=axes)
    k = per_channel(np.asarray(scale, np.float64) * invstd, nd, layout)
    if use_global_est:
        return k * dy, dscale, dbias
    n = x.size // x.shape[channel_axis(nd, layout)]
    dx = k * (dy - per_channel(dbias / n, nd, layout) - xhat * per_channel(dscale / n, nd, layout))
    return dx, dscale, dbias


# ---- conv2d and pool2d (NCHW; NHWC by moving the channel axis) ----------------------


def nchw(x, layout):
    """x (4-D) in NCHW: moved there from NHWC."""
    return np.asarray(x).transpose(0, 3, 1, 2) if layout == "NHWC" else np.asarray(x)


def in_layout(x, layout):
    """x (4-D NCHW) in `layout`."""
    return np.asarray(x).transpose(0, 2, 3, 1) if layout == "NHWC" else np.asarray(x)


def conv2d_out_size(size, k, stride, pad, dil):
    """Output extent of one spatial axis."""
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def conv2d(x, w, strides=1, paddings=0, dilations=1, groups=1, data_layout="NCHW"):
    """Grouped, strided, padded, dilated cross-correlation of x (N, C, H, W) with
    w (O, C / groups, KH, KW), one filter tap at a time, in float64; data_layout
    "NHWC": x (N, H, W, C) and the result (N, Ho, Wo, O), the same filter."""
    if data_layout == "NHWC":
        return in_layout(conv2d(nchw(x, data_layout), w, strides, paddings, dilations, groups),
                         data_layout)
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    (sh, sw), (ph, pw), (dh, dw) = pair(strides), pair(paddings), pair(dilations)
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho, wo = conv2d_out_size(h, kh, sh, ph, dh), conv2d_out_size(wd, kw, sw, pw, dw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    og = o // groups
    out = np.zeros((n, o, ho, wo))
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i * dh:i * dh + sh * (ho - 1) + 1:sh,
                           j * dw:j * dw + sw * (wo - 1) + 1:sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch,
                                                         w[g * og:(g + 1) * og, :, i, j])
    return out


def conv2d_grad(x, w, dout, strides=1, paddings=0, dilations=1, groups=1, data_layout="NCHW"):
    """(dx, dw) of conv2d for d(loss)/d(out) = dout: conv2d's adjoint, tap by tap (dx in
    data_layout, as x and dout are)."""
    if data_layout == "NHWC":
        dx, dw = conv2d_grad(nchw(x, data_layout), w, nchw(dout, data_layout), strides,
                             paddings, dilations, groups)
        return in_layout(dx, data_layout), dw
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    d = np.asarray(dout, np.float64)
    (sh, sw), (ph, pw), (dh, dw_) = pair(strides), pair(paddings), pair(dilations)
    _, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    ho, wo = d.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dxp = np.zeros_like(xp)
    dwt = np.zeros_like(w)
    og = o // groups
    for g in range(groups):
        dg = d[:, g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                sl = (slice(None), slice(g * cg, (g + 1) * cg),
                      slice(i * dh, i * dh + sh * (ho - 1) + 1, sh),
                      slice(j * dw_, j * dw_ + sw * (wo - 1) + 1, sw))
                dwt[g * og:(g + 1) * og, :, i, j] = np.einsum("nohw,nchw->oc", dg, xp[sl])
                dxp[sl] += np.einsum("nohw,oc->nchw", dg, w[g * og:(g + 1) * og, :, i, j])
    return dxp[:, :, ph:ph + h, pw:pw + wd], dwt


def _pool_windows(shape, ksize, strides, paddings, global_pooling):
    """(ho, wo, windows): the output size and, for every output pixel, (oh, ow, rows,
    cols), its window clipped to the real input."""
    h, w = shape[2:]
    if global_pooling:
        (kh, kw), (sh, sw), (ph, pw) = (h, w), (h, w), (0, 0)
    else:
        (kh, kw), (ph, pw) = pair(ksize), pair(paddings)
        sh, sw = pair(strides if strides is not None else ksize)
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    windows = []
    for oh in range(ho):
        for ow in range(wo):
            r0, c0 = oh * sh - ph, ow * sw - pw
            windows.append((oh, ow, slice(max(r0, 0), min(r0 + kh, h)),
                            slice(max(c0, 0), min(c0 + kw, w))))
    return ho, wo, windows


def pool2d(x, pool_type="max", ksize=2, strides=None, paddings=0, global_pooling=False,
           data_layout="NCHW"):
    """Max or average pooling of x (N, C, H, W) in float64, output pixel by output
    pixel; each window is clipped to the real input (avg divides by what is left);
    strides default to ksize. data_layout "NHWC": x and the result channels-last."""
    if data_layout == "NHWC":
        return in_layout(pool2d(nchw(x, data_layout), pool_type, ksize, strides, paddings,
                                global_pooling), data_layout)
    x = np.asarray(x, np.float64)
    ho, wo, windows = _pool_windows(x.shape, ksize, strides, paddings, global_pooling)
    out = np.zeros(x.shape[:2] + (ho, wo))
    for oh, ow, rows, cols in windows:
        win = x[:, :, rows, cols]
        out[:, :, oh, ow] = win.max(axis=(2, 3)) if pool_type == "max" else win.mean(axis=(2, 3))
    return out


def pool2d_grad(x, dout, pool_type="max", ksize=2, strides=None, paddings=0,
                global_pooling=False, data_layout="NCHW"):
    """dx of pool2d for d(loss)/d(out) = dout: avg spreads each value evenly over its
    clipped window; max gives it to the window's first maximum (row-major)."""
    if data_layout == "NHWC":
        return in_layout(pool2d_grad(nchw(x, data_layout), nchw(dout, data_layout), pool_type,
                                     ksize, strides, paddings, global_pooling), data_layout)
    x, d = np.asarray(x, np.float64), np.asarray(dout, np.float64)
    n, c = x.shape[:2]
    dx = np.zeros_like(x)
    _, _, windows = _pool_windows(x.shape, ksize, strides, paddings, global_pooling)
    for oh, ow, rows, cols in windows:
        if pool_type == "avg":
            count = (rows.stop - rows.start) * (cols.stop - cols.start)
            dx[:, :, rows, cols] += d[:, :, oh, ow][:, :, None, None] / count
            continue
        width = cols.stop - cols.start
        first = x[:, :, rows, cols].reshape(n, c, -1).argmax(axis=2)
        for ni in range(n):
            for ci in range(c):
                a = first[ni, ci]
                dx[ni, ci, rows.start + a // width, cols.start + a % width] += d[ni, ci, oh, ow]
    return dx


# ---- broadcasting, softmax -------------------------------------------------------------


def unbroadcast(g, shape):
    """g summed down to `shape` over the axes numpy broadcast `shape` along: every
    leading axis, then every axis where `shape` has 1."""
    g = np.asarray(g, np.float64)
    while g.ndim > len(shape):
        g = np.add.reduce(g, axis=0)
    for i, n in enumerate(shape):
        if n == 1:
            g = np.add.reduce(g, axis=i, keepdims=True)
    return g


def softmax(x, axis=-1):
    """exp(x - max) / sum(exp(x - max)) along `axis`, in float64."""
    z = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# ---- Philox4x32-10 and dropout ----------------------------------------------------------


def philox4x32(counter, key):
    """Random123's Philox4x32-10 on Python ints (the round of kernels/cuda/fill.cu, line by
    line): four 32-bit words from a 4-word counter and a 2-word key."""
    c0, c1, c2, c3 = (int(v) for v in counter)
    k0, k1 = (int(v) for v in key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1,
                          p0 & 0xFFFFFFFF)
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return [c0, c1, c2, c3]


def dropout_keep(n, p, seed, step):
    """dropout's keep mask of n values: keep_i = u_i >= p, u_i = (word i % 4 of
    philox(counter i // 4, stream 2; key (seed, step))) >> 8 / 2**24."""
    words = []
    for call in range((n + 3) // 4):
        words += philox4x32([call & 0xFFFFFFFF, call >> 32, 2, 0], [seed, step & 0xFFFFFFFF])
    return np.array([(w >> 8) / 2.0**24 >= p for w in words[:n]], dtype=bool)


# ---- attention -----------------------------------------------------------------------------


def attention_keep(shape, p, seed, step):
    """The keep mask (N, H, Tq, Tk) of scaled_dot_product_attention's dropout: pair
    f = ((n*H + h)*Tq + i)*Tk + j is kept when (word f % 4 of philox(counter f // 4,
    stream 3; key (seed, step))) >> 8 / 2**24 >= p."""
    n = int(np.prod(shape))
    words = []
    for call in range((n + 3) // 4):
        words += philox4x32([call & 0xFFFFFFFF, call >> 32, 3, 0], [seed, step & 0xFFFFFFFF])
    return np.array([(w >> 8) / 2.0**24 >= p for w in words[:n]], dtype=bool).reshape(shape)


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False,
                                 causal_variant="upper_left", scale=None, keep=None,
                                 dropout_p=0.0):
    """torch's F.scaled_dot_product_attention in float64 on (N, H, T, d) arrays, the whole
    score matrix at once: {"out", "lse" (the rows' log-sum-exp, -inf where no key takes
    part), "weights" (after the softmax, before dropout)}. A row with no key has weights
    and out 0. keep: the dropout's keep mask (scaled by 1 / (1 - dropout_p)) or None."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tq, tk = q.shape[2], k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[3]) if scale is None else scale
    s = np.einsum("nhic,nhjc->nhij", q, k) * scale
    allowed = np.ones(s.shape, bool)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            allowed &= np.broadcast_to(m, s.shape)
        else:
            s = s + m.astype(np.float64)
    if is_causal:
        offset = 0 if causal_variant == "upper_left" else tk - tq
        allowed &= np.arange(tk)[None, :] <= np.arange(tq)[:, None] + offset
    s = np.where(allowed, s, -np.inf)
    lse = np.full(s.shape[:3], -np.inf)
    weights = np.zeros(s.shape)
    for idx in np.ndindex(*s.shape[:3]):
        row = s[idx]
        if np.isneginf(row).all():
            continue
        top = row.max()
        e = np.exp(row - top)
        lse[idx] = top + np.log(e.sum())
        weights[idx] = e / e.sum()
    dropped = weights if keep is None else weights * keep / (1.0 - dropout_p)
    return {"out": np.einsum("nhij,nhjc->nhic", dropped, v), "lse": lse, "weights": weights}
