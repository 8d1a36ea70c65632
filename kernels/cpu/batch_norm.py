"""CPU kernels of batch_norm, sync_batch_norm and their ReLU-fused forms
(ops/batch_norm.py, ops/sync_batch_norm.py, ops/batch_norm_relu.py) on the stable
statistics of batch_norm_stats.

`forward_cpu` and `backward_cpu` are the drivers: everything is computed before
the estimates and the counter are written, in place, and never with NaN or Inf.
sync_batch_norm passes them `combine`, which turns this rank's statistics (or
gradient sums) into the whole batch's with one collective on the communicator
of the kernel's context: the forward's (n, mean_c, M2_c) merged with Chan's
formula (`pack_stats`), the backward's (n, sum dy, sum dy (x - mean)) summed.
batch_norm_relu passes `relu=True` forward (y = max(y, 0), in the same pass) and its
output `y` backward as `relu_out` (dy counts where y > 0, in the same passes).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import bn_estimates
from minigraph.kernels.cpu.batch_norm_stats import (
    as_3d,
    as_work,
    centring_needed,
    grad_sums,
    grad_sums_and_input_grad,
    input_grad,
    local_stats,
    normalize,
    stats_and_normalize,
)
from minigraph.schema import OpError


def too_few_values(op, n, x, layout):
    """The error of a training batch with exactly one value per channel (CPU and GPU)."""
    return OpError(f"{op.type}: training needs more than one value per channel, got "
                   f"n={n} for input 'x' of shape {tuple(x.shape)} ({layout}); use a bigger "
                   "batch or is_infer/use_global_est")


def batch_statistics(op, ins):
    """Whether `op` normalises with its batch's statistics: in training, and in
    inference too when it keeps no estimates (track_running_stats=False)."""
    a = op.attrs
    return not a["use_global_est"] and (not a["is_infer"] or ins.get("estimated_mean") is None)


def affine(ins, channels, dtype=np.float64):
    """(scale, bias) as arrays of `channels` values: ones and zeros without them."""
    scale, bias = ins.get("scale"), ins.get("bias")
    return (np.ones(channels, dtype) if scale is None else scale.astype(dtype),
            np.zeros(channels, dtype) if bias is None else bias.astype(dtype))


def first_batch_rule(op, counter):
    """Whether this training batch sets the estimates outright: the counter is 0 and
    the op keeps the design's first-batch rule (first_batch_sets_estimates)."""
    return (counter is not None and int(counter) == 0
            and op.attrs.get("first_batch_sets_estimates", True))


def estimate_rule(op, counter):
    """How a training batch moves the estimates: ("batch", None) under the first-batch
    rule (the batch sets them), ("momentum", m) for the momentum blend (m weights the
    old estimate), ("average", 1 / (counter + 1)) for the cumulative average."""
    momentum = op.attrs["momentum"]
    if first_batch_rule(op, counter):
        return "batch", None
    if momentum is None:
        return "average", 1.0 / (int(counter) + 1)
    return "momentum", momentum


def not_finite(op):
    """The error of a batch whose statistics or new estimates are not finite."""
    return OpError(f"{op.type}: the batch statistics are not finite (input 'x' holds NaN or "
                   "Inf, or its variance overflows); the running estimates and the counter "
                   "were left unchanged")


def blended_estimates(op, mean, unbiased, est_mean, est_var, counter):
    """New (mean, var) estimates from a batch's per-channel mean and unbiased variance
    (float64), in est's dtype, by estimate_rule: the batch itself, est * m + batch *
    (1 - m), or est + (batch - est) * w. Never NaN or Inf: an OpError naming the op
    instead."""
    dtype = est_mean.dtype
    est_mean, est_var = est_mean.astype(np.float64), est_var.astype(np.float64)
    kind, weight = estimate_rule(op, counter)
    if kind == "batch":
        new = mean, unbiased
    elif kind == "average":
        new = (est_mean + (mean - est_mean) * weight,
               est_var + (unbiased - est_var) * weight)
    else:
        new = (weight * est_mean + (1 - weight) * mean,
               weight * est_var + (1 - weight) * unbiased)
    with np.errstate(over="ignore", invalid="ignore"):
        new = tuple(v.astype(dtype) for v in new)
    if not np.isfinite(np.concatenate((mean, unbiased) + new)).all():
        raise not_finite(op)
    return new


def updated_estimates(op, mean, var, n, est_mean, est_var, counter):
    """New (mean, var) estimates after a batch of n values per channel with biased
    variance `var` (blended_estimates with the unbiased variance var * n / (n - 1));
    bn_estimates' native call, the same bits, where it applies."""
    factor = n / (n - 1)
    done = bn_estimates.blend(estimate_rule(op, counter), mean, var, factor, est_mean, est_var)
    if done is not None:
        if not done[2]:
            raise not_finite(op)
        return done[:2]
    with np.errstate(over="ignore", invalid="ignore"):
        unbiased = var * factor
    return blended_estimates(op, mean, unbiased, est_mean, est_var, counter)


def empty_batch(x, est_mean, est_var, channels):
    """The outputs of a training batch with no values: y empty, batch_mean/batch_var
    the estimates (zeros without them, as PyTorch); nothing is written."""
    if est_mean is not None:
        mean, var = est_mean.astype(x.dtype), est_var.astype(x.dtype)
    else:
        mean = var = np.zeros(channels, x.dtype)
    return np.empty(x.shape, x.dtype), mean, var


def batch_norm_cpu(op, ins, ctx):
    """The CPU kernel of batch_norm (forward_cpu on this process's batch)."""
    return forward_cpu(op, ins)


def batch_norm_grad_cpu(op, ins, ctx):
    """The CPU kernel of batch_norm_grad (backward_cpu; dx into dy when handed over)."""
    return backward_cpu(op, ins, donated=ctx.donated)


def forward_cpu(op, ins, combine=None, relu=False):
    """The CPU forward of batch_norm (with relu: y = max(y, 0), batch_norm_relu).
    `combine(n, mean, m2) -> (n, mean, m2)` turns local statistics into global ones
    (sync_batch_norm). Everything is computed before the estimates and the counter
    (when the op keeps them) are written, in place. Without `combine`, training
    normalises each channel right after its statistics where the native kernels run
    (stats_and_normalize)."""
    x = ins["x"]
    a = op.attrs
    layout = a["data_layout"]
    xw = as_work(x)
    x3 = as_3d(xw, layout)
    est_mean, est_var = ins.get("estimated_mean"), ins.get("estimated_var")
    counter = ins.get("num_batches")
    training = batch_statistics(op, ins)
    tracked = training and est_mean is not None
    scale, bias = affine(ins, x3.shape[1])
    yw = np.empty(xw.shape, xw.dtype)
    fused = None
    if training and combine is None:
        fused = stats_and_normalize(x3, a["epsilon"], scale, bias, as_3d(yw, layout), relu)
    if training:
        n, mean, m2 = fused if fused is not None else local_stats(x3)
        if combine is not None:
            n, mean, m2 = combine(n, mean, m2)
        if n == 0:              # an empty batch: an empty y, nothing written
            y, mean, var = empty_batch(x, est_mean, est_var, x3.shape[1])
            return {"y": y, "batch_mean": mean, "batch_var": var, "saved_mean": est_mean,
                    "saved_var": est_var, "saved_num_batches": counter}
        if n == 1:
            raise too_few_values(op, n, x, layout)
        var = m2 / n
        if tracked:
            new_mean, new_var = updated_estimates(op, mean, var, n, est_mean, est_var, counter)
    else:
        mean = est_mean.astype(np.float64)
        var = est_var.astype(np.float64)
    if fused is None:
        normalize(x3, mean, 1.0 / np.sqrt(var + a["epsilon"]), scale, bias, as_3d(yw, layout),
                  relu)
    out = {"y": yw.astype(x.dtype, copy=False), "batch_mean": mean.astype(x.dtype),
           "batch_var": var.astype(x.dtype), "saved_mean": est_mean, "saved_var": est_var,
           "saved_num_batches": counter}
    if tracked:              # everything is computed: now commit, all at once
        est_mean[...] = new_mean
        est_var[...] = new_var
        if counter is not None:
            counter[...] = counter + 1
    return out


def backward_cpu(op, ins, combine=None, donated=(), relu_out=None, out_scale=1.0):
    """The CPU grad kernel of batch_norm. `combine(n, s_dy, s_dyxmu) -> (n, s_dy, s_dyxmu)` sums
    over ranks (sync_batch_norm); n is then the global count. dx goes into dy's array
    when dy is handed over (OpSchema.reuse) and already in its work dtype. Without
    `combine`, with batch statistics, each channel's dx is written right after its
    sums where the native kernels run (grad_sums_and_input_grad). relu_out:
    batch_norm_relu's forward output; dy then counts only where it is > 0. dscale and
    dbias are multiplied by `out_scale` (sync: 1 / ranks under data parallelism)."""
    a = op.attrs
    x, dy = ins["x"], ins["dy"]
    layout = a["data_layout"]
    x3, dy3 = as_3d(as_work(x), layout), as_3d(as_work(dy), layout)
    mask3 = None if relu_out is None else as_3d(relu_out, layout)
    mean = ins["mean"].astype(np.float64)
    invstd = 1.0 / np.sqrt(ins["var"].astype(np.float64) + a["epsilon"])
    scale, _ = affine(ins, x3.shape[1])
    out = {}
    into = "dy" in donated and dy.dtype == x3.dtype and dy.flags.c_contiguous
    dx = None
    if op.wants("dx"):
        dx = dy3 if into else np.empty(x3.shape, x3.dtype)
    fused = None
    if dx is not None and combine is None and not a["use_global_est"]:
        fused = grad_sums_and_input_grad(x3, dy3, mean, invstd, scale, dx, mask3)
    if not a["use_global_est"] or op.wants("dscale") or op.wants("dbias"):
        n, s_dy, s_dyxmu = fused if fused is not None else grad_sums(x3, dy3, mean, invstd,
                                                                     mask3)
        if combine is not None and not a["use_global_est"]:
            n, s_dy, s_dyxmu = combine(n, s_dy, s_dyxmu)
        out["dbias"] = (s_dy * out_scale).astype(x.dtype)
        out["dscale"] = (s_dyxmu * invstd * out_scale).astype(x.dtype)
    if dx is not None and fused is None:
        k_dy = scale * invstd
        if a["use_global_est"]:
            input_grad(x3, dy3, mean, k_dy, None, None, dx, mask3=mask3)
        elif n:                 # (an empty batch has an empty dx)
            k_x = -scale * invstd ** 3 * s_dyxmu / n
            k_c = -scale * invstd * s_dy / n
            input_grad(x3, dy3, mean, k_dy, k_x, k_c, dx, centring_needed(mean, invstd), mask3)
    if dx is not None:
        out["dx"] = dy if into else dx.reshape(x.shape).astype(x.dtype, copy=False)
    return out


# ---- sync_batch_norm ------------------------------------------------------------

def forward_label(op):
    """The `what=` of the forward's allreduce_stats (the same on every rank): it
    names the op and its input in the order check and in deadline errors."""
    return f"{op.type} forward x={op.inputs['x'].name}"


def backward_label(op):
    """The `what=` of the backward's allreduce ("sync_batch_norm_grad x=...")."""
    return f"{op.type} x={op.inputs['x'].name}"


def pack_stats(n, mean, m2):
    """The forward's message: float64 (n, mean_c..., M2_c...), 2C+1 numbers (the GPU
    kernel bn_local_stats writes the same vector on the device). A rank with no
    values sends zeros."""
    c = mean.shape[0]
    buf = np.zeros(2 * c + 1)
    if n:
        buf[0] = n
        buf[1:c + 1] = mean
        buf[c + 1:] = m2
    return buf


def unpack_stats(total):
    """(n, mean, M2) of the whole batch from the merged pack_stats vector."""
    c = (total.shape[0] - 1) // 2
    return int(round(total[0])), total[1:c + 1].copy(), total[c + 1:].copy()


def stats_combiner(op, comm):
    """combine(n, mean, m2) -> the whole batch's (n, mean, m2), one allreduce_stats."""
    def combine(n, mean, m2):
        return unpack_stats(comm.allreduce_stats(pack_stats(n, mean, m2),
                                                 what=forward_label(op)))
    return combine


def grad_combiner(op, comm):
    """combine(n, s_dy, s_dyxmu) -> sums over every rank, with one allreduce."""
    def combine(n, s_dy, s_dyxmu):
        c = s_dy.shape[0]
        buf = np.concatenate(([float(n)], s_dy, s_dyxmu))
        total = comm.allreduce(buf, what=backward_label(op))
        return int(round(total[0])), total[1:c + 1], total[c + 1:]
    return combine


def sync_batch_norm_cpu(op, ins, ctx):
    """CPU forward: batch_norm's with the statistics combined over ranks."""
    training = batch_statistics(op, ins)
    comm = ctx.comm if training else None
    combine = stats_combiner(op, comm) if training and comm.size > 1 else None
    return forward_cpu(op, ins, combine=combine)


def presummed_scale(op, comm):
    """What a sync grad op multiplies its dscale and dbias by: 1 / world size when its
    `average_ranks` is set and the statistics came from the batch, else 1."""
    averaged = op.attrs.get("average_ranks") and not op.attrs["use_global_est"]
    return 1.0 / comm.size if averaged else 1.0


def sync_batch_norm_grad_cpu(op, ins, ctx, relu_out=None):
    """CPU grad: batch_norm_grad with Σdy and Σdy·(x−μ) summed over ranks (dx into dy's
    array when it is handed over); dscale and dbias divided by the world size with
    `average_ranks`."""
    comm = ctx.comm
    combine = grad_combiner(op, comm) if comm.size > 1 else None
    return backward_cpu(op, ins, combine=combine, donated=ctx.donated, relu_out=relu_out,
                        out_scale=presummed_scale(op, comm))


# ---- batch_norm_relu and its sync form -------------------------------------------------

def batch_norm_relu_cpu(op, ins, ctx):
    """The CPU kernel of batch_norm_relu: batch_norm's forward with y = max(y, 0)."""
    return forward_cpu(op, ins, relu=True)


def batch_norm_relu_grad_cpu(op, ins, ctx):
    """The CPU kernel of batch_norm_relu_grad: batch_norm_grad with dy counting only
    where the forward's y > 0."""
    return backward_cpu(op, ins, donated=ctx.donated, relu_out=ins["y"])


def sync_batch_norm_relu_cpu(op, ins, ctx):
    """sync_batch_norm's forward with y = max(y, 0)."""
    training = batch_statistics(op, ins)
    comm = ctx.comm if training else None
    combine = stats_combiner(op, comm) if training and comm.size > 1 else None
    return forward_cpu(op, ins, combine=combine, relu=True)


def sync_batch_norm_relu_grad_cpu(op, ins, ctx):
    """sync_batch_norm_grad with dy counting only where the forward's y > 0."""
    return sync_batch_norm_grad_cpu(op, ins, ctx, relu_out=ins["y"])
