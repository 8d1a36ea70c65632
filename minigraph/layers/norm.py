"""Normalisation layers: batch_norm (forks the net), layer_norm, group_norm and
instance_norm (the same in both modes, and fine with a batch of one).

Each creates its persistables under its name: `name.scale` (ones) and
`name.bias` (zeros), trainable; batch_norm also its running estimates
`name.estimated_mean` (zeros), `name.estimated_var` (ones) and the int64
counter `name.num_batches`. docs/batch_norm.md says which to pick when.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.initializer import Constant
from minigraph.layers.base import float_arg, int_arg, known_rank, layer, tensor


def _affine(net, name, shape, dtype, scale=True, shift=True):
    """(scale, bias) parameters of `shape` (ones, zeros), or None where not wanted."""
    def make(suffix, value, wanted):
        if not wanted:
            return None
        return net.create_parameter(f"{name}.{suffix}", shape, dtype, Constant(value))
    return make("scale", 1.0, scale), make("bias", 0.0, shift)


def _bool(kind, arg, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{kind}: argument '{arg}' must be True or False, got {value!r}")
    return bool(value)


@layer("batch_norm")
def batch_norm(net, x, epsilon=1e-5, momentum=0.9, data_layout="NCHW", use_global_est=False,
               name=None, sync=False, affine=True, track_running_stats=True):
    """Batch normalisation; forks the net into train and infer branches.

    Persistables: `name.scale` (ones) and `name.bias` (zeros) unless
    affine=False; `name.estimated_mean` (zeros), `name.estimated_var` (ones) and
    the int64 counter `name.num_batches` unless track_running_stats=False, which
    makes both branches normalise with the batch's statistics (PyTorch's eval mode
    then does too). momentum weights the OLD estimate (PyTorch's momentum m is
    1 - m here); None makes the estimates a cumulative average. sync=True builds
    `sync_batch_norm` (statistics over every rank's batch).
    """
    tensor(net, "batch_norm", "x", x, float_only=True)
    if data_layout not in ("NCHW", "NHWC"):
        raise ValueError(f"batch_norm: argument 'data_layout' must be 'NCHW' or 'NHWC', got "
                         f"{data_layout!r}")
    affine = _bool("batch_norm", "affine", affine)
    tracked = _bool("batch_norm", "track_running_stats", track_running_stats)
    if use_global_est and not tracked:
        raise ValueError("batch_norm: use_global_est=True needs the running estimates "
                         "(track_running_stats=True)")
    shape = x.shape
    axis = 1 if data_layout == "NCHW" else -1
    if shape is None or len(shape) < 2 or shape[axis] < 0:
        raise ValueError(f"batch_norm: argument 'x' ({x.name!r}) needs a known channel axis "
                         f"({data_layout}), got shape {shape}")
    channels = (shape[axis],)
    scale, bias = _affine(net, name, channels, x.dtype, affine, affine)
    inputs = {"x": x, "scale": scale, "bias": bias}
    outputs = {"y": f"{name}.y", "batch_mean": f"{name}.batch_mean",
               "batch_var": f"{name}.batch_var"}
    if tracked:
        def persist(suffix, value, shape=channels, dt=x.dtype):
            return net.create_parameter(f"{name}.{suffix}", shape, dt, Constant(value),
                                        trainable=False)

        mean, var = persist("estimated_mean", 0.0), persist("estimated_var", 1.0)
        counter = persist("num_batches", 0.0, shape=(), dt=np.dtype("int64"))
        inputs.update(estimated_mean=mean, estimated_var=var, num_batches=counter)
        outputs.update(saved_mean=mean, saved_var=var, saved_num_batches=counter)
    outs = net.append("sync_batch_norm" if sync else "batch_norm",
                      {k: v for k, v in inputs.items() if v is not None}, outputs,
                      {"epsilon": epsilon, "momentum": momentum, "data_layout": data_layout,
                       "use_global_est": use_global_est})
    return outs["y"]


@layer("layer_norm")
def layer_norm(net, x, begin_norm_axis=1, epsilon=1e-5, scale=True, shift=True, name=None):
    """Normalisation over axes begin_norm_axis.. of each sample (torch's
    F.layer_norm(x, x.shape[begin_norm_axis:], weight, bias, eps)): `name.scale`
    (ones) and `name.bias` (zeros) hold one value per position of those axes,
    flattened, unless scale=False / shift=False. Not mode-dependent."""
    tensor(net, "layer_norm", "x", x, float_only=True)
    shape = known_rank("layer_norm", x)
    rank = len(shape)
    if rank < 2:
        raise ValueError(f"layer_norm: argument 'x' ({x.name!r}) needs rank >= 2 (a batch "
                         f"axis, then the normalised ones), got shape {shape}")
    begin = int_arg("layer_norm", "begin_norm_axis", begin_norm_axis)
    if begin >= rank:
        raise ValueError(f"layer_norm: argument 'begin_norm_axis' must be in [1, {rank}) for "
                         f"a rank-{rank} input, got {begin_norm_axis!r}")
    tail = shape[begin:]
    if min(tail) < 0:
        raise ValueError(f"layer_norm: argument 'x' ({x.name!r}) needs known sizes on axes "
                         f"{begin}.., got shape {shape}")
    epsilon = float_arg("layer_norm", "epsilon", epsilon, 0.0)
    params = _affine(net, name, (math.prod(tail),), x.dtype,
                     _bool("layer_norm", "scale", scale), _bool("layer_norm", "shift", shift))
    return _append(net, "layer_norm", x, params, name,
                   {"begin_norm_axis": begin, "epsilon": epsilon})


@layer("group_norm")
def group_norm(net, x, groups, epsilon=1e-5, name=None):
    """Normalisation of each sample over `groups` groups of C / groups channels and
    their spatial positions (torch.nn.GroupNorm(groups, C)), NCHW; `name.scale`
    (ones) and `name.bias` (zeros) per channel. groups must divide C. Not
    mode-dependent."""
    return _channel_norm(net, "group_norm", x, groups, epsilon, name)


@layer("instance_norm")
def instance_norm(net, x, epsilon=1e-5, name=None):
    """Normalisation of each channel of each sample over its spatial positions
    (torch F.instance_norm(x, weight=scale, bias=bias), no running estimates), NCHW;
    `name.scale` (ones) and `name.bias` (zeros) per channel. Not mode-dependent."""
    return _channel_norm(net, "instance_norm", x, None, epsilon, name)


def _channel_norm(net, kind, x, groups, epsilon, name):
    tensor(net, kind, "x", x, float_only=True)
    shape = known_rank(kind, x)
    low = 2 if kind == "group_norm" else 3
    if not low <= len(shape) <= 5 or shape[1] < 0:
        raise ValueError(f"{kind}: argument 'x' ({x.name!r}) must be (N, C, ...) of rank "
                         f"{low} to 5 with C known, got shape {shape}")
    c = shape[1]
    attrs = {"epsilon": float_arg(kind, "epsilon", epsilon, 0.0)}
    if kind == "group_norm":
        groups = int_arg(kind, "groups", groups)
        if c % groups:
            raise ValueError(f"group_norm: argument 'groups' ({groups}) must divide the {c} "
                             f"channels of {x.name!r} (shape {shape})")
        attrs["groups"] = groups
    elif min(shape[2:]) >= 0 and math.prod(shape[2:]) == 1:
        raise ValueError(f"instance_norm: argument 'x' ({x.name!r}) needs more than one "
                         f"spatial value per channel, got shape {shape}")
    return _append(net, kind, x, _affine(net, name, (c,), x.dtype), name, attrs)


def _append(net, op_type, x, params, name, attrs):
    scale, bias = params
    inputs = {k: v for k, v in (("x", x), ("scale", scale), ("bias", bias)) if v is not None}
    return net.append(op_type, inputs, {"y": f"{name}.y", "mean": f"{name}.mean",
                                        "variance": f"{name}.variance"}, attrs)["y"]
