"""batch_norm: schema, shape checks, CPU kernel, grad maker and grad kernel.

Semantics (n = values per channel in the batch):
  training:        y = (x - batch_mean) / sqrt(batch_var + eps) * scale + bias,
                   batch_var biased; the estimates take the unbiased variance.
                   First batch (counter 0): est = batch. Then
                   est = momentum * est + (1 - momentum) * batch, or, with
                   momentum=None, est += (batch - est) / k for the k-th batch.
  use_global_est:  normalise with the estimates; nothing is updated.
  is_infer:        likewise; nothing persistable is written.
`saved_*` outputs are the `estimated_*` / `num_batches` Variables themselves,
updated in place, and never with NaN or Inf.
"""
from __future__ import annotations

import numpy as np

from minigraph.schema import (
    Meta, OpDesc, OpError, OpSchema, Slot, bool_attr, check_float, check_rank,
    check_same_dtype, check_shape, fail, float_attr, in_range, kernel, one_of,
    positive, register, str_attr,
)

PARAM_SLOTS = ("scale", "bias", "estimated_mean", "estimated_var")
CHUNK_BYTES = 1 << 19          # work on x in cache-sized row blocks


def bn_schema(op_type):
    """The batch-norm schema under `op_type` (sync_batch_norm shares it)."""
    return OpSchema(
        type=op_type,
        inputs=(Slot("x"), Slot("estimated_mean"), Slot("estimated_var"), Slot("scale"),
                Slot("bias"), Slot("num_batches", optional=True)),
        outputs=(Slot("y"), Slot("batch_mean"), Slot("batch_var"), Slot("saved_mean"),
                 Slot("saved_var"), Slot("saved_num_batches", optional=True)),
        attrs=(bool_attr("is_infer", False), bool_attr("use_global_est", False),
               float_attr("epsilon", 1e-5, positive),
               float_attr("momentum", 0.9, in_range(0.0, 1.0), nullable=True),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))),
        inplace={"saved_mean": "estimated_mean", "saved_var": "estimated_var",
                 "saved_num_batches": "num_batches"},
        infer=lambda ins, attrs: infer_bn(op_type, ins, attrs),
        validate=validate_bn,
        grad=grad_bn,
        doc=__doc__,
    )


def validate_bn(op):
    if op.inputs["num_batches"] is None and op.attrs["momentum"] is None:
        raise OpError(f"{op.type}: momentum=None (cumulative average) needs the "
                      "'num_batches' counter input")
    if (op.inputs["num_batches"] is None) != (op.outputs["saved_num_batches"] is None):
        raise OpError(f"{op.type}: 'num_batches' and 'saved_num_batches' go together "
                      "(an in-place pair); bind both or neither")


def infer_bn(op_type, ins, attrs):
    x = ins["x"]
    check_rank(op_type, "x", x, (2, 3, 4, 5))
    check_float(op_type, "x", x)
    layout = attrs["data_layout"]
    channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
    for slot in PARAM_SLOTS:
        check_shape(op_type, slot, ins[slot], (channels,),
                    f" to match the {channels} channels of input 'x' ({layout}, shape {x.shape})")
        check_same_dtype(op_type, slot, ins[slot], "x", x)
    if ins.get("num_batches") is not None:
        nb = ins["num_batches"]
        if nb.shape != () or nb.dtype != np.int64:
            fail(op_type, "num_batches", f"must be an int64 scalar (shape ()), got "
                                         f"{nb.dtype} of shape {nb.shape}")
    stat = Meta((channels,), x.dtype)
    return {"y": Meta(x.shape, x.dtype), "batch_mean": stat, "batch_var": stat}


def as_3d(x, layout):
    """View x as (rows, C, inner) so every statistic reduces over axes 0 and 2."""
    if layout == "NCHW":
        return x.reshape(x.shape[0], x.shape[1], -1)
    return x.reshape(-1, x.shape[-1], 1)


def row_blocks(x3):
    """Slices of axis 0 of about CHUNK_BYTES each."""
    rows = x3.shape[0]
    per_row = max(1, x3[0].nbytes if rows else 1)
    step = max(1, CHUNK_BYTES // per_row)
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def local_stats(x3):
    """(n, mean, M2) per channel in float64, stably: a two-pass mean and
    centred sum of squares per row block, merged with Chan's formula."""
    channels = x3.shape[1]
    n = 0
    mean = np.zeros(channels)
    m2 = np.zeros(channels)
    for rows in row_blocks(x3):
        blk = x3[rows]
        nb = blk.shape[0] * blk.shape[2]
        if nb == 0:
            continue
        bmean = np.add.reduce(blk, axis=2).sum(axis=0, dtype=np.float64) / nb
        d = blk - bmean.astype(blk.dtype)[None, :, None]
        np.multiply(d, d, out=d)
        bm2 = np.add.reduce(d, axis=2).sum(axis=0, dtype=np.float64)
        # the block mean was rounded to x's dtype before centring: correct for it
        shift = bmean - bmean.astype(blk.dtype)
        bm2 -= nb * shift * shift
        total = n + nb
        delta = bmean - mean
        mean += delta * (nb / total)
        m2 += bm2 + delta * delta * (n * nb / total)
        n = total
    return n, mean, m2


def normalize(x3, mean, invstd, scale, bias, out3):
    """out = (x - mean) * invstd * scale + bias per channel, written into out3.
    x is centred first, so offset data keeps its precision."""
    m = mean.astype(x3.dtype)
    k = invstd * scale
    kk = k.astype(x3.dtype)[None, :, None]
    c = (bias - (mean - m) * k).astype(x3.dtype)[None, :, None]
    m = m[None, :, None]
    for rows in row_blocks(x3):
        o = out3[rows]
        np.subtract(x3[rows], m, out=o)
        o *= kk
        o += c


def updated_estimates(op, mean, var, n, est_mean, est_var, counter):
    """New (mean, var) estimates after a batch, in float64; never NaN or Inf."""
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(var))):
        raise OpError(f"{op.type}: the batch statistics contain NaN or Inf (input 'x' has "
                      "non-finite values); the running estimates were left unchanged")
    unbiased = var * (n / (n - 1))
    momentum = op.attrs["momentum"]
    seen = int(counter) if counter is not None else None
    if seen == 0:
        return mean, unbiased
    if momentum is None:
        w = 1.0 / (seen + 1)
        return est_mean + (mean - est_mean) * w, est_var + (unbiased - est_var) * w
    return (momentum * est_mean + (1 - momentum) * mean,
            momentum * est_var + (1 - momentum) * unbiased)


def forward_cpu(op, ins, combine=None):
    """The CPU forward of batch_norm. `combine(n, mean, m2) -> (n, mean, m2)`
    turns local statistics into global ones (sync_batch_norm)."""
    x = ins["x"]
    a = op.attrs
    layout = a["data_layout"]
    x3 = as_3d(x, layout)
    est_mean, est_var = ins["estimated_mean"], ins["estimated_var"]
    counter = ins.get("num_batches")
    training = not (a["is_infer"] or a["use_global_est"])
    if training:
        n, mean, m2 = local_stats(x3)
        if combine is not None:
            n, mean, m2 = combine(n, mean, m2)
        if n <= 1:
            raise OpError(f"{op.type}: training needs more than one value per channel, got "
                          f"n={n} for input 'x' of shape {x.shape} ({layout}); use a bigger "
                          "batch or is_infer/use_global_est")
        var = m2 / n
        new_mean, new_var = updated_estimates(op, mean, var, n, est_mean, est_var, counter)
    else:
        mean = est_mean.astype(np.float64)
        var = est_var.astype(np.float64)
    invstd = 1.0 / np.sqrt(var + a["epsilon"])
    y = np.empty_like(x)
    normalize(x3, mean, invstd, ins["scale"].astype(np.float64),
              ins["bias"].astype(np.float64), as_3d(y, layout))
    out = {"y": y, "batch_mean": mean.astype(x.dtype), "batch_var": var.astype(x.dtype),
           "saved_mean": est_mean, "saved_var": est_var, "saved_num_batches": counter}
    if training:             # everything is computed: now commit, all at once
        np.copyto(est_mean, new_mean, casting="unsafe")
        np.copyto(est_var, new_var, casting="unsafe")
        if counter is not None:
            counter[...] = counter + 1
    return out


def grad_bn(op, dout, make_grad):
    """batch_norm_grad from batch statistics, or with the estimates as constants."""
    dy = dout.get("y")
    if dy is None:
        return []
    use_est = op.attrs["is_infer"] or op.attrs["use_global_est"]
    src = op.inputs if use_est else op.outputs
    mean_slot, var_slot = (("estimated_mean", "estimated_var") if use_est
                           else ("batch_mean", "batch_var"))
    return [OpDesc(op.type + "_grad", dict(
        x=op.inputs["x"], scale=op.inputs["scale"], mean=src[mean_slot], var=src[var_slot],
        dy=dy, dx=make_grad(op.inputs["x"]), dscale=make_grad(op.inputs["scale"]),
        dbias=make_grad(op.inputs["bias"]), use_global_est=use_est,
        epsilon=op.attrs["epsilon"], data_layout=op.attrs["data_layout"]))]


def bn_grad_schema(op_type):
    """`<op_type>_grad`: dx, dscale, dbias from x, dy and the statistics used."""
    def infer(ins, attrs):
        x = ins["x"]
        check_shape(op_type + "_grad", "dy", ins["dy"], x.shape, " (the shape of x)")
        c = Meta(ins["scale"].shape, x.dtype)
        return {"dx": Meta(x.shape, x.dtype), "dscale": c, "dbias": c}

    return OpSchema(
        type=op_type + "_grad",
        inputs=(Slot("x"), Slot("scale"), Slot("mean"), Slot("var"), Slot("dy")),
        outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                 Slot("dbias", optional=True)),
        attrs=(bool_attr("use_global_est", False), float_attr("epsilon", 1e-5, positive),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))),
        infer=infer,
    )


def grad_sums(x3, dy3, mean):
    """(n, Σdy, Σdy·(x−mean)) per channel in float64, centred for stability."""
    channels = x3.shape[1]
    s_dy = np.zeros(channels)
    s_dyxmu = np.zeros(channels)
    m = mean.astype(x3.dtype)[None, :, None]
    for rows in row_blocks(x3):
        d = x3[rows] - m
        d *= dy3[rows]
        s_dyxmu += np.add.reduce(d, axis=2).sum(axis=0, dtype=np.float64)
        s_dy += np.add.reduce(dy3[rows], axis=2).sum(axis=0, dtype=np.float64)
    # x was centred on mean rounded to x's dtype: move to the exact mean
    s_dyxmu -= s_dy * (mean - mean.astype(x3.dtype))
    return x3.shape[0] * x3.shape[2], s_dy, s_dyxmu


def backward_cpu(op, ins, combine=None):
    """The CPU grad kernel. `combine(s_dy, s_dyxmu) -> (s_dy, s_dyxmu)` sums
    over ranks (sync_batch_norm); n is then the global count."""
    a = op.attrs
    x, dy = ins["x"], ins["dy"]
    layout = a["data_layout"]
    x3, dy3 = as_3d(x, layout), as_3d(dy, layout)
    mean = ins["mean"].astype(np.float64)
    invstd = 1.0 / np.sqrt(ins["var"].astype(np.float64) + a["epsilon"])
    scale = ins["scale"].astype(np.float64)
    n, s_dy, s_dyxmu = grad_sums(x3, dy3, mean)
    if combine is not None and not a["use_global_est"]:
        n, s_dy, s_dyxmu = combine(n, s_dy, s_dyxmu)
    out = {"dbias": s_dy.astype(x.dtype), "dscale": (s_dyxmu * invstd).astype(x.dtype)}
    if op.outputs.get("dx") is not None:
        k_dy = scale * invstd
        dx = np.empty_like(x)
        dx3 = as_3d(dx, layout)
        kd = k_dy.astype(x.dtype)[None, :, None]
        if a["use_global_est"]:
            for rows in row_blocks(x3):
                np.multiply(dy3[rows], kd, out=dx3[rows])
        else:
            m = mean.astype(x.dtype)
            k_x = -scale * invstd ** 3 * s_dyxmu / n
            k_c = -scale * invstd * s_dy / n - k_x * (mean - m)
            kx, kc = (v.astype(x.dtype)[None, :, None] for v in (k_x, k_c))
            m = m[None, :, None]
            for rows in row_blocks(x3):
                o = dx3[rows]
                np.subtract(x3[rows], m, out=o)
                o *= kx
                o += kc
                o += dy3[rows] * kd
        out["dx"] = dx
    return out


register(bn_schema("batch_norm"))
register(bn_grad_schema("batch_norm"))
kernel("batch_norm", "cpu")(forward_cpu)
kernel("batch_norm_grad", "cpu")(backward_cpu)
