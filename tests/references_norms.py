"""Float64 references of layer, group and instance norm (tracked instance norm's
estimates too), as tests/references.py's: torch's definitions, not the kernels'
code."""
from __future__ import annotations

import numpy as np
from references import blend_estimates, bn_normalize


def layer_norm(x, scale=None, bias=None, begin_norm_axis=1, epsilon=1e-5):
    """torch's F.layer_norm(x, x.shape[begin:], scale, bias, eps) in float64, with the
    rows' mean and biased variance; scale and bias flattened over the normalised axes."""
    rows = int(np.prod(x.shape[:begin_norm_axis]))
    x2 = np.asarray(x, np.float64).reshape(rows, -1)
    mean = x2.mean(axis=1, keepdims=True)
    var = ((x2 - mean) ** 2).mean(axis=1, keepdims=True)
    y = (x2 - mean) / np.sqrt(var + epsilon)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    stat = x.shape[:begin_norm_axis]
    return {"y": y.reshape(x.shape), "mean": mean.reshape(stat), "variance": var.reshape(stat)}


def to_nchw(x, layout):
    """x with its channel axis second (a copy of an NHWC array transposed)."""
    x = np.asarray(x, np.float64)
    return x if layout == "NCHW" else np.moveaxis(x, -1, 1)


def group_norm(x, scale=None, bias=None, groups=1, epsilon=1e-5, data_layout="NCHW"):
    """torch.nn.GroupNorm(groups, C) in float64 with the groups' mean and biased
    variance (N, groups); scale and bias per channel; x (N, C, *) or, "NHWC", (N, *, C)."""
    xc = to_nchw(x, data_layout)
    n, c = xc.shape[:2]
    xg = xc.reshape(n, groups, (c // groups) * int(np.prod(xc.shape[2:])))
    mean = xg.mean(axis=2, keepdims=True)
    var = ((xg - mean) ** 2).mean(axis=2, keepdims=True)
    y = ((xg - mean) / np.sqrt(var + epsilon)).reshape(xc.shape)
    per = (1, c) + (1,) * (xc.ndim - 2)
    if scale is not None:
        y = y * np.reshape(scale, per)
    if bias is not None:
        y = y + np.reshape(bias, per)
    if data_layout == "NHWC":
        y = np.moveaxis(y, 1, -1)
    return {"y": y, "mean": mean.reshape(n, groups), "variance": var.reshape(n, groups)}


def instance_norm(x, scale=None, bias=None, epsilon=1e-5, data_layout="NCHW"):
    """torch's F.instance_norm(x, weight=scale, bias=bias, eps) in float64: group_norm
    with a group per channel."""
    c = x.shape[1] if data_layout == "NCHW" else x.shape[-1]
    return group_norm(x, scale, bias, c, epsilon, data_layout)


def tracked_instance_norm(x, estimated_mean, estimated_var, scale=None, bias=None,
                          num_batches=None, is_infer=False, epsilon=1e-5, momentum=0.9,
                          first_batch_sets_estimates=True, data_layout="NCHW"):
    """torch.nn.InstanceNormNd(track_running_stats=True) in float64, momentum in our
    convention: training normalises each instance on its own and blends into the
    estimates the mean of the instances' means and of their unbiased variances (the
    first batch sets them when first_batch_sets_estimates); inference normalises with
    the estimates. Returns y, mean, variance and the estimates and counter after."""
    xc = to_nchw(x, data_layout)
    n, c = xc.shape[:2]
    if is_infer:
        y = bn_normalize(xc, 1.0 if scale is None else scale, 0.0 if bias is None else bias,
                         estimated_mean, estimated_var, epsilon, "NCHW")
        return {"y": y if data_layout == "NCHW" else np.moveaxis(y, 1, -1),
                "mean": np.tile(np.float64(estimated_mean), (n, 1)),
                "variance": np.tile(np.float64(estimated_var), (n, 1)),
                "saved_mean": np.float64(estimated_mean),
                "saved_var": np.float64(estimated_var),
                **({} if num_batches is None else {"saved_num_batches": num_batches})}
    out = instance_norm(x, scale, bias, epsilon, data_layout)
    s = int(np.prod(xc.shape[2:]))
    if n == 0:
        new_mean, new_var, counter = np.float64(estimated_mean), np.float64(estimated_var), \
            num_batches
    else:
        new_mean, new_var = blend_estimates(
            estimated_mean, estimated_var, out["mean"].mean(axis=0),
            (out["variance"] * s / (s - 1)).mean(axis=0), num_batches, momentum,
            first_batch_sets_estimates)
        counter = None if num_batches is None else num_batches + 1
    out = {**out, "saved_mean": new_mean, "saved_var": new_var, "saved_num_batches": counter}
    return {k: v for k, v in out.items() if v is not None}
