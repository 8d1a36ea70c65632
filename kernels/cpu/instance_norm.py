"""CPU kernel of tracked_instance_norm (ops/instance_norm.py): instance norm that keeps
running estimates (PyTorch's track_running_stats=True).

Training normalises each (sample, channel) with its own statistics (group_norm's
forward with a group per channel) and updates the estimates from them as PyTorch
does: the batch's per-channel mean is the mean of the instances' means, its
variance the mean of their unbiased variances, blended into the estimates by batch
norm's rule (kernels/cpu/batch_norm.blended_estimates). Everything is computed
before the estimates and the counter are written, in place. Inference normalises
with the estimates, batch norm's inference pass (batch_norm_stats.normalize).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu.batch_norm import affine, blended_estimates
from minigraph.kernels.cpu.batch_norm_stats import as_3d, as_work, normalize
from minigraph.kernels.cpu.group_norm import check_variance, forward, sizes
from minigraph.schema import OpError


def estimate_update(op, mean, var, spatial, est_mean, est_var, counter):
    """The new (mean, var) estimates from the instances' mean and biased variance (N, C)
    over `spatial` values each (see the module doc)."""
    batch_mean = mean.astype(np.float64).mean(axis=0)
    unbiased = (var.astype(np.float64) * (spatial / (spatial - 1))).mean(axis=0)
    return blended_estimates(op, batch_mean, unbiased, est_mean, est_var, counter)


def infer(op, ins):
    """y from the estimates; mean and variance: the estimates for every sample."""
    x, a = ins["x"], op.attrs
    layout, eps = a["data_layout"], a["epsilon"]
    est_mean, est_var = ins["estimated_mean"], ins["estimated_var"]
    if eps == 0 and (est_var == 0).any():
        c = int(np.argmax(est_var == 0))
        raise OpError(f"{op.type}: epsilon is 0 and the estimated variance of channel {c} is "
                      "0: nothing to divide by; use epsilon > 0")
    xw = as_work(x)
    x3 = as_3d(xw, layout)
    scale, bias = affine(ins, x3.shape[1])
    y = np.empty(xw.shape, xw.dtype)
    normalize(x3, est_mean.astype(np.float64), 1.0 / np.sqrt(est_var.astype(np.float64) + eps),
              scale, bias, as_3d(y, layout))
    n = x.shape[0]
    return {"y": y.astype(x.dtype, copy=False),
            "mean": np.broadcast_to(est_mean, (n, est_mean.shape[0])).astype(x.dtype),
            "variance": np.broadcast_to(est_var, (n, est_var.shape[0])).astype(x.dtype)}


def tracked_instance_norm_cpu(op, ins, ctx):
    """Training: y, the instances' statistics, the estimates and the counter updated in
    place; inference: y from the estimates (see the module doc)."""
    x, a = ins["x"], op.attrs
    est_mean, est_var, counter = (ins["estimated_mean"], ins["estimated_var"],
                                  ins.get("num_batches"))
    out = {"saved_mean": est_mean, "saved_var": est_var, "saved_num_batches": counter}
    if a["is_infer"]:
        return {**out, **infer(op, ins)}
    layout = a["data_layout"]
    n, c, _, _, s = sizes(x, est_mean.shape[0], layout)
    if s == 1:
        raise OpError(f"{op.type}: training needs more than one spatial value per channel, "
                      f"got input 'x' of shape {tuple(x.shape)} ({layout}); inference uses the "
                      "running estimates and takes it")
    y, mean, var = forward(x, ins.get("scale"), ins.get("bias"), c, a["epsilon"], layout)
    check_variance(op.type, var, a["epsilon"], per_channel=True)
    if n:                   # an empty batch changes nothing
        new_mean, new_var = estimate_update(op, mean, var, s, est_mean, est_var, counter)
        est_mean[...] = new_mean
        est_var[...] = new_var
        if counter is not None:
            counter[...] = counter + 1
    return {**out, "y": y, "mean": mean, "variance": var}
