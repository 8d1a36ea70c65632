"""batch_norm: the op's schema, shape checks, CPU drivers, grad maker and registration.

Semantics (n = values per channel in the batch):
  training:        y = (x - batch_mean) / sqrt(batch_var + eps) * scale + bias,
                   batch_var biased; the estimates take the unbiased variance.
                   First batch (counter 0): est = batch. Then
                   est = momentum * est + (1 - momentum) * batch, or, with
                   momentum=None, est += (batch - est) / k for the k-th batch.
                   n <= 1 is an error.
  use_global_est:  normalise with the estimates; nothing is updated.
  is_infer:        likewise; nothing persistable is written.
`saved_*` outputs are the `estimated_*` / `num_batches` Variables themselves,
updated in place, and never with NaN or Inf. minigraph's `saved_mean`/`saved_var`
are these in-place running estimates (Paddle's `MeanOut`/`VarianceOut`), the
reverse of Paddle's `SavedMean`/`SavedVariance`, which are batch statistics
(ours are `batch_mean`/`batch_var`).

Where the rest lives: the numerics in ops/batch_norm_cpu.py (on the blocked,
threaded engine of minigraph/cpu_blocks.py), the GPU bindings in
ops/batch_norm_gpu.py (which registers nothing). This module registers every
kernel of the op - the list at the bottom, the GPU ones with the float dtypes
they take; sync_batch_norm reuses the drivers through `combine`.
"""
from __future__ import annotations

import numpy as np

from minigraph.ops.batch_norm_cpu import (
    as_3d,
    as_work,
    centring_needed,
    grad_sums,
    input_grad,
    local_stats,
    normalize,
)
from minigraph.ops.batch_norm_gpu import backward_gpu, forward_gpu
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpDesc, OpError, OpSchema, Slot, kernel, register
from minigraph.validators import (
    bool_attr,
    check_float,
    check_rank,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
    one_of,
    positive,
    str_attr,
)

PARAM_SLOTS = ("scale", "bias", "estimated_mean", "estimated_var")


def momentum_range(v):
    """The momentum attribute's check: a weight of the old estimate, in [0, 1]."""
    if 0.0 <= v <= 1.0:
        return None
    return ("must be in [0, 1] (the weight of the old estimate), or None for the "
            "cumulative average")


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
               float_attr("momentum", 0.9, momentum_range, nullable=True),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))),
        inplace={"saved_mean": "estimated_mean", "saved_var": "estimated_var",
                 "saved_num_batches": "num_batches"},
        mode_attr="is_infer",
        infer=lambda ins, attrs: infer_bn(op_type, ins, attrs),
        validate=validate_bn,
        grad=grad_bn,
        doc=__doc__,
    )


def validate_bn(op):
    """Cross-slot rules: momentum=None needs the counter; the counter pair goes together."""
    if op.inputs["num_batches"] is None and op.attrs["momentum"] is None:
        raise OpError(f"{op.type}: momentum=None (cumulative average) needs the "
                      "'num_batches' counter input")
    if (op.inputs["num_batches"] is None) != (op.outputs["saved_num_batches"] is None):
        raise OpError(f"{op.type}: 'num_batches' and 'saved_num_batches' go together "
                      "(an in-place pair); bind both or neither")


def infer_bn(op_type, ins, attrs):
    """Check x (rank 2-5, float), the per-channel parameters and the counter; y is x's shape."""
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



def too_few_values(op, n, x, layout):
    """The error of a training batch with n <= 1 values per channel (CPU and GPU)."""
    return OpError(f"{op.type}: training needs more than one value per channel, got "
                   f"n={n} for input 'x' of shape {tuple(x.shape)} ({layout}); use a bigger "
                   "batch or is_infer/use_global_est")


def updated_estimates(op, mean, var, n, est_mean, est_var, counter):
    """New (mean, var) estimates after a batch, in est's dtype; never NaN or Inf."""
    dtype = est_mean.dtype
    unbiased = var * (n / (n - 1))
    est_mean, est_var = est_mean.astype(np.float64), est_var.astype(np.float64)
    momentum = op.attrs["momentum"]
    seen = int(counter) if counter is not None else None
    if seen == 0:
        new = mean, unbiased
    elif momentum is None:
        w = 1.0 / (seen + 1)
        new = est_mean + (mean - est_mean) * w, est_var + (unbiased - est_var) * w
    else:
        new = (momentum * est_mean + (1 - momentum) * mean,
               momentum * est_var + (1 - momentum) * unbiased)
    with np.errstate(over="ignore", invalid="ignore"):
        new = tuple(v.astype(dtype) for v in new)
    if not np.isfinite(np.concatenate((mean, var) + new)).all():
        raise OpError(f"{op.type}: the batch statistics are not finite (input 'x' holds NaN "
                      "or Inf, or its variance overflows); the running estimates and the "
                      "counter were left unchanged")
    return new


def batch_norm_cpu(op, ins, ctx):
    """The CPU kernel of batch_norm (forward_cpu on this process's batch)."""
    return forward_cpu(op, ins)


def batch_norm_grad_cpu(op, ins, ctx):
    """The CPU kernel of batch_norm_grad (backward_cpu; dx into dy when handed over)."""
    return backward_cpu(op, ins, donated=ctx.donated)


def batch_norm_gpu(op, ins, ctx):
    """The GPU kernel of batch_norm (forward_gpu on this process's batch)."""
    return forward_gpu(op, ins)


def batch_norm_grad_gpu(op, ins, ctx):
    """The GPU kernel of batch_norm_grad (backward_gpu)."""
    return backward_gpu(op, ins)


def forward_cpu(op, ins, combine=None):
    """The CPU forward of batch_norm. `combine(n, mean, m2) -> (n, mean, m2)`
    turns local statistics into global ones (sync_batch_norm). Everything is
    computed before the estimates and the counter are written, in place."""
    x = ins["x"]
    a = op.attrs
    layout = a["data_layout"]
    xw = as_work(x)
    x3 = as_3d(xw, layout)
    est_mean, est_var = ins["estimated_mean"], ins["estimated_var"]
    counter = ins.get("num_batches")
    training = not (a["is_infer"] or a["use_global_est"])
    if training:
        n, mean, m2 = local_stats(x3)
        if combine is not None:
            n, mean, m2 = combine(n, mean, m2)
        if n <= 1:
            raise too_few_values(op, n, x, layout)
        var = m2 / n
        new_mean, new_var = updated_estimates(op, mean, var, n, est_mean, est_var, counter)
    else:
        mean = est_mean.astype(np.float64)
        var = est_var.astype(np.float64)
    invstd = 1.0 / np.sqrt(var + a["epsilon"])
    yw = np.empty(xw.shape, xw.dtype)
    normalize(x3, mean, invstd, ins["scale"].astype(np.float64),
              ins["bias"].astype(np.float64), as_3d(yw, layout))
    out = {"y": yw.astype(x.dtype, copy=False), "batch_mean": mean.astype(x.dtype),
           "batch_var": var.astype(x.dtype), "saved_mean": est_mean, "saved_var": est_var,
           "saved_num_batches": counter}
    if training:             # everything is computed: now commit, all at once
        est_mean[...] = new_mean
        est_var[...] = new_var
        if counter is not None:
            counter[...] = counter + 1
    return out


def backward_cpu(op, ins, combine=None, donated=()):
    """The CPU grad kernel of batch_norm. `combine(n, s_dy, s_dyxmu) -> (n, s_dy, s_dyxmu)` sums
    over ranks (sync_batch_norm); n is then the global count. dx goes into dy's array
    when dy is handed over (OpSchema.reuse) and already in its work dtype."""
    a = op.attrs
    x, dy = ins["x"], ins["dy"]
    layout = a["data_layout"]
    x3, dy3 = as_3d(as_work(x), layout), as_3d(as_work(dy), layout)
    mean = ins["mean"].astype(np.float64)
    invstd = 1.0 / np.sqrt(ins["var"].astype(np.float64) + a["epsilon"])
    scale = ins["scale"].astype(np.float64)
    out = {}
    if not a["use_global_est"] or op.wants("dscale") or op.wants("dbias"):
        n, s_dy, s_dyxmu = grad_sums(x3, dy3, mean, invstd)
        if combine is not None and not a["use_global_est"]:
            n, s_dy, s_dyxmu = combine(n, s_dy, s_dyxmu)
        out["dbias"] = s_dy.astype(x.dtype)
        out["dscale"] = (s_dyxmu * invstd).astype(x.dtype)
    if op.wants("dx"):
        k_dy = scale * invstd
        into = "dy" in donated and dy.dtype == x3.dtype and dy.flags.c_contiguous
        dx = dy3 if into else np.empty(x3.shape, x3.dtype)
        if a["use_global_est"]:
            input_grad(x3, dy3, mean, k_dy, None, None, dx)
        else:
            k_x = -scale * invstd ** 3 * s_dyxmu / n
            k_c = -scale * invstd * s_dy / n
            input_grad(x3, dy3, mean, k_dy, k_x, k_c, dx, centring_needed(mean, invstd))
        out["dx"] = dy if into else dx.reshape(x.shape).astype(x.dtype, copy=False)
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


def bn_grad_schema(op_type, presummed=None):
    """`<op_type>_grad`: dx, dscale, dbias from x, dy and the statistics used.
    presummed: see OpSchema.presummed (sync_batch_norm's dscale and dbias)."""
    def infer(ins, attrs):
        x = ins["x"]
        check_shape(op_type + "_grad", "dy", ins["dy"], x.shape, " (the shape of x)")
        c = Meta(ins["scale"].shape, x.dtype)
        return {"dx": Meta(x.shape, x.dtype), "dscale": c, "dbias": c}

    return OpSchema(
        type=op_type + "_grad",
        inputs=(Slot("x"), Slot("scale"), Slot("mean"), Slot("var"), Slot("dy")),
        outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                 Slot("dbias", optional=True)), reuse={"dx": ("dy",)},
        attrs=(bool_attr("use_global_est", False), float_attr("epsilon", 1e-5, positive),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC"))),
        infer=infer,
        presummed=presummed,
    )


register(bn_schema("batch_norm"))
register(bn_grad_schema("batch_norm"))
kernel("batch_norm", "cpu")(batch_norm_cpu)
kernel("batch_norm_grad", "cpu")(batch_norm_grad_cpu)
kernel("batch_norm", "gpu", dtypes=GPU_FLOATS)(batch_norm_gpu)
kernel("batch_norm_grad", "gpu", dtypes=GPU_FLOATS)(batch_norm_grad_gpu)
