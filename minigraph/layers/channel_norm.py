"""group_norm and instance_norm: each sample normalised on its own, over groups of
channels (group_norm) or each channel (instance_norm), channels first ("NCHW") or last
("NHWC").

Neither is mode-dependent (train and infer compute the same, a batch of one works)
unless instance_norm keeps running estimates (track_running_stats=True): it then
forks the net like batch_norm, and its infer branch normalises with the estimates.
An input without a batch axis (PyTorch's InstanceNorm1d/2d/3d take one) is given
with `spatial_dims`: it is viewed as a batch of one and its result reshaped back.
"""
from __future__ import annotations

import math

from minigraph.layers.base import float_arg, int_arg, known_rank, layer, tensor
from minigraph.layers.norm import (
    affine_params,
    append_norm,
    bool_arg,
    layout_arg,
    momentum_arg,
    running_estimates,
)


@layer("group_norm")
def group_norm(net, x, groups, epsilon=1e-5, affine=True, data_layout="NCHW", name=None,
               bias=True):
    """Normalisation of each sample over `groups` groups of C / groups channels and
    their spatial positions (torch.nn.GroupNorm(groups, C, eps, affine)), x (N, C, *)
    for "NCHW" or (N, *, C) for "NHWC", of rank 2 to 5; `name.scale` (ones) and
    `name.bias` (zeros) per channel unless affine=False (bias=False: the scale alone).
    groups must divide C. epsilon may be 0 (a group of equal values is then an
    error). A single sample whose groups hold one value each is an error (as
    PyTorch). Not mode-dependent."""
    kind = "group_norm"
    c, _ = _checked(net, kind, x, data_layout, (2, 5), None)
    groups = int_arg(kind, "groups", groups)
    if c % groups:
        raise ValueError(f"group_norm: argument 'groups' ({groups}) must divide the {c} "
                         f"channels of {x.name!r} (shape {x.shape}, {data_layout})")
    attrs = {"groups": groups, "epsilon": float_arg(kind, "epsilon", epsilon, 0.0),
             "data_layout": data_layout}
    params = _params(net, kind, name, c, x.dtype, affine, bias)
    return append_norm(net, kind, x, params, name, attrs)["y"]


@layer("instance_norm")
def instance_norm(net, x, epsilon=1e-5, affine=True, track_running_stats=False, momentum=0.9,
                  data_layout="NCHW", name=None, bias=True, first_batch_sets_estimates=True,
                  spatial_dims=None):
    """Normalisation of each channel of each sample over its spatial positions
    (torch.nn.InstanceNormNd), x (N, C, *) for "NCHW" or (N, *, C) for "NHWC" of rank 3
    to 5; `name.scale` (ones) and `name.bias` (zeros) per channel unless affine=False
    (bias=False: the scale alone). affine defaults to True (minigraph's instance_norm
    always had them; PyTorch's default is affine=False: see
    docs/porting_from_pytorch.md).

    track_running_stats=True keeps `name.estimated_mean`, `name.estimated_var` and
    `name.num_batches` like batch_norm: training updates them from the instances'
    statistics (momentum in OUR convention, weighting the old estimate; None: the
    cumulative average; the first batch sets them unless
    first_batch_sets_estimates=False, PyTorch's rule), inference normalises with them,
    and the net forks here. spatial_dims (1, 2 or 3: InstanceNorm1d/2d/3d) says how
    many spatial axes x has, so that an input with one axis fewer has no batch axis;
    None: x always has one."""
    kind = "instance_norm"
    spatial = None if spatial_dims is None else int_arg(kind, "spatial_dims", spatial_dims)
    if spatial is not None and spatial > 3:
        raise ValueError(f"instance_norm: argument 'spatial_dims' must be 1, 2, 3 or None, got "
                         f"{spatial_dims!r}")
    tracked = bool_arg(kind, "track_running_stats", track_running_stats)
    first = bool_arg(kind, "first_batch_sets_estimates", first_batch_sets_estimates)
    momentum = momentum_arg(kind, momentum)
    c, unbatched = _checked(net, kind, x, data_layout, (3, 5), spatial)
    epsilon = float_arg(kind, "epsilon", epsilon, 0.0)
    params = _params(net, kind, name, c, x.dtype, affine, bias)
    xb = _batched(net, x, name) if unbatched else x
    spatial_sizes = xb.shape[2:] if data_layout == "NCHW" else xb.shape[1:-1]
    if not tracked:
        if min(spatial_sizes) >= 0 and math.prod(spatial_sizes) == 1:
            raise ValueError(f"instance_norm: argument 'x' ({x.name!r}) needs more than one "
                             f"spatial value per channel, got shape {x.shape}")
        y = append_norm(net, kind, xb, params, name,
                        {"epsilon": epsilon, "data_layout": data_layout})["y"]
    else:
        mean, var, counter = running_estimates(net, name, (c,), x.dtype)
        y = append_norm(net, "tracked_instance_norm", xb, params, name,
                        {"epsilon": epsilon, "momentum": momentum, "data_layout": data_layout,
                         "first_batch_sets_estimates": first},
                        extra_inputs={"estimated_mean": mean, "estimated_var": var,
                                      "num_batches": counter},
                        extra_outputs={"saved_mean": mean, "saved_var": var,
                                       "saved_num_batches": counter})["y"]
    return _unbatched(net, y, x.shape, name) if unbatched else y


def _checked(net, kind, x, layout, ranks, spatial_dims):
    """(C, whether x has no batch axis) after checking x: a float tensor of known rank
    and channel count, of rank ranks[0]..ranks[1] (spatial_dims + 1 or + 2 when given)."""
    tensor(net, kind, "x", x, float_only=True)
    layout_arg(kind, layout)
    shape = known_rank(kind, x)
    if spatial_dims is not None:
        allowed = (spatial_dims + 1, spatial_dims + 2)
        if len(shape) not in allowed:
            raise ValueError(f"{kind}: argument 'x' ({x.name!r}) must have rank {allowed[0]} "
                             f"(no batch axis) or {allowed[1]} for spatial_dims={spatial_dims}, "
                             f"got shape {shape}")
        unbatched = len(shape) == allowed[0]
    else:
        unbatched = False
        if not ranks[0] <= len(shape) <= ranks[1]:
            where = "(N, C, ...)" if layout == "NCHW" else "(N, ..., C)"
            raise ValueError(f"{kind}: argument 'x' ({x.name!r}) must be {where} of rank "
                             f"{ranks[0]} to {ranks[1]}, got shape {shape}")
    axis = (0 if unbatched else 1) if layout == "NCHW" else -1
    if shape[axis] < 0:
        raise ValueError(f"{kind}: argument 'x' ({x.name!r}) needs a known channel count "
                         f"({layout}), got shape {shape}")
    return shape[axis], unbatched


def _params(net, kind, name, c, dtype, affine, bias):
    affine, bias = bool_arg(kind, "affine", affine), bool_arg(kind, "bias", bias)
    return affine_params(net, name, (c,), dtype, affine, affine and bias)


def _batched(net, x, name):
    """x without a batch axis viewed as a batch of one (a reshape op)."""
    shape = tuple(x.shape)
    if sum(d < 0 for d in shape) > 1:
        raise ValueError(f"instance_norm: argument 'x' ({x.name!r}) without a batch axis needs "
                         f"at most one unknown size, got shape {shape}")
    return net.append("reshape", {"x": x}, {"out": f"{name}.batched"},
                      {"shape": (1, *shape)})["out"]


def _unbatched(net, y, shape, name):
    """The batch of one `y` reshaped back to the input's `shape`."""
    return net.append("reshape", {"x": y}, {"out": f"{name}.out"},
                      {"shape": tuple(shape)})["out"]
