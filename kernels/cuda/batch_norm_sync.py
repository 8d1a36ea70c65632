"""Launchers of kernels/cuda/batch_norm.cu for synchronized batch norm: statistics
and gradients over several devices or processes. The caller combines one
float64 vector of 2C+1 numbers over the ranks between two launches, with one
collective each way:

  local_stats              1 kernel: this device's (n, mean, M2) per channel
  merge_stats              1 kernel: K ranks' such vectors (allgathered) merged
                           in rank order with Chan's formula
  forward_train_from_sums  2 kernels: the channels finished from the whole
                           batch's (N, mean, M2) (the first-batch / momentum /
                           cumulative update, the guard), then forward_train's
                           normalisation
  backward_sums            1 kernel: (n, sum dy, sum dy (x - mean))
  backward_from_sums       1 or 2 kernels: dscale, dbias (global; times
                           `out_scale`, 1 / ranks under data parallelism) and the
                           dx coefficients from the global sums (global n), then dx
batch_norm_relu's sync variant passes `relu` forward and its output `y` backward
(dy counts where y > 0).

The kernels, their signatures and the single-device entry points are in
kernels/cuda/batch_norm.py; these reuse its checks, plans and launch helpers.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import batch_norm as bn
from minigraph.kernels.cuda import batch_norm_grad as bn_grad
from minigraph.kernels.cuda import launch, loader


def local_stats(x, layout="NCHW"):
    """This device's share of synchronized batch statistics: a new float64
    device vector of 2C+1 numbers (n, mean_c..., M2_c...), from the same stable
    per-channel statistics as forward_train. Merged over ranks with Chan's
    formula (merge_stats, or the communicator's allreduce_stats) it gives
    forward_train_from_sums its input. x with no values gives zeros (a rank
    holding no rows)."""
    pre, channels, post = bn.geometry(x, layout)
    xp = loader.ptr(x, "batch_norm: x")
    sums = loader.empty((2 * channels + 1,), np.float64)
    if pre * post == 0:
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(sums, 0)
    plan, stats = bn.reduce_plan("bn_local_stats", x, bn.aligned(xp), pre, channels, post)
    partial = loader.scratch(3 * channels * plan.splits, x.dtype)
    stats(xp, pre, channels, *plan.split_args, partial,
          loader.ptr(loader.tickets(plan.tickets)), loader.ptr(sums))
    return sums

def merge_stats(rows):
    """The whole batch's (N, mean, M2) vector from `rows`, a (K, 2C+1) float64
    device array of K ranks' local_stats vectors: merged in rank order with
    Chan's formula on the device (ranks with n = 0 add nothing). A new vector."""
    if len(rows.shape) != 2 or rows.shape[1] % 2 != 1 or np.dtype(rows.dtype) != np.float64:
        raise ValueError(f"batch_norm merge_stats: rows must be float64 of shape (K, 2C+1), "
                         f"got {np.dtype(rows.dtype)}{tuple(rows.shape)}")
    ranks, width = (int(d) for d in rows.shape)
    channels = (width - 1) // 2
    out = loader.empty((width,), np.float64)
    # one thread per channel, no loop: at least `channels` threads, past one wave too
    bn.flat_launch("bn_merge_stats", max(channels, 1), 1, max(channels, 1),
                   loader.ptr(rows, "merge_stats: rows"), ranks, channels, loader.ptr(out))
    return out

def forward_train_from_sums(x, sums, scale, bias, est_mean, est_var, counter, momentum, eps,
                            layout="NCHW", out=None, guard=None, first_batch=True,
                            relu=False):
    """forward_train with the batch statistics taken from `sums`: the whole
    batch's (N, mean_c..., M2_c...) (float64, 2C+1, on the device; local_stats
    vectors merged over every rank). Each channel gets var = M2 / N; the
    estimates and the counter are updated as in forward_train (same rules,
    same guard) and x is normalised with the global statistics. x may have no
    rows.

    The global n = sums[0] must be at least 2: the caller checks it (only it
    knows whether that needs reading the device). Returns (y, batch_mean,
    batch_var) as forward_train does."""
    _, channels, post, xp, params = bn.check_train(x, scale, bias, est_mean, est_var, counter,
                                                    momentum, layout)
    launch.check_array("batch_norm: sums", sums, (2 * channels + 1,), np.float64)
    run = bn._Training(x, xp, channels, post, params, momentum, eps, out, guard,
                       first_batch=first_batch)
    bn.flat_launch(f"bn_stats_from_sums_{loader.suffix(x.dtype)}", channels, 1, channels,
                 loader.ptr(sums), channels, *run.stats_args)
    return run.normalize(relu)

def backward_sums(x, dy, mean, layout="NCHW", y=None):
    """This device's share of synchronized batch-norm gradients: a new float64
    device vector of 2C+1 numbers (n, sum dy_c..., sum dy (x - mean_c)...),
    `mean` the (global) batch mean the forward used. Summed over ranks it gives
    backward_from_sums its input. x with no values gives zeros. `y`: batch_norm_relu's
    output (dy counts where y > 0)."""
    pre, channels, post, xp, dyp, (mp,) = bn_grad.check_grad(x, dy, layout, [("mean", mean)])
    sums = loader.empty((2 * channels + 1,), np.float64)
    n = pre * post
    if n == 0:
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(sums, 0)
    bn_grad.grad_reduce("bn_grad_sums", x, xp, dyp, pre, channels, post,
                        (mp, float(n), loader.ptr(sums)), yp=bn_grad.relu_pointer(x, y))
    return sums

def backward_from_sums(x, dy, scale, mean, var, sums, eps, layout="NCHW", need_dx=True,
                       need_dscale=True, need_dbias=True, y=None, out_scale=1.0):
    """backward (batch statistics) with the sums over every rank: `sums` is
    backward_sums summed over ranks (float64, 2C+1, on the device), its n the
    global count. dscale and dbias are those of the whole batch, times `out_scale`
    (1 / ranks folds data parallelism's average in); dx is this device's rows (dy
    masked by y > 0 when `y`, batch_norm_relu's output, is given). Returns
    (dx, dscale, dbias), None for those not needed."""
    _, channels, post, xp, dyp, (sp, mp, vp) = bn_grad.check_grad(
        x, dy, layout, [("scale", scale), ("mean", mean), ("var", var)])
    launch.check_array("batch_norm_grad: sums", sums, (2 * channels + 1,), np.float64)
    dx, dscale, dbias = bn_grad.grad_outputs(x, channels, need_dx, need_dscale, need_dbias)
    coef = loader.scratch(4 * channels, x.dtype)
    bn.flat_launch(f"bn_grad_from_sums_{loader.suffix(x.dtype)}", channels, 1, channels,
                    loader.ptr(sums), channels, sp, mp, vp, float(eps), loader.ptr(dscale),
                    loader.ptr(dbias), coef, float(out_scale))
    if dx is not None:
        bn_grad.grad_dx(x, xp, dyp, dx, channels, post, coef, False, bn_grad.relu_pointer(x, y))
    return dx, dscale, dbias
