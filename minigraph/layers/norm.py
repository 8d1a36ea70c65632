"""Normalisation layers: batch_norm (forks the net) and layer_norm; group_norm and
instance_norm live in channel_norm.py. The shared argument checks are here.

Each creates its persistables under its name: `name.scale` (ones) and
`name.bias` (zeros), trainable; batch_norm also its running estimates
`name.estimated_mean` (zeros), `name.estimated_var` (ones) and the int64
counter `name.num_batches`. docs/batch_norm.md says which to pick when;
docs/porting_from_pytorch.md maps PyTorch's norm modules onto these.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.initializer import Constant
from minigraph.layers.base import float_arg, int_arg, known_rank, layer, tensor

LAYOUTS = ("NCHW", "NHWC")


def affine_params(net, name, shape, dtype, scale=True, shift=True):
    """(scale, bias) parameters of `shape` (ones, zeros), or None where not wanted."""
    def make(suffix, value, wanted):
        if not wanted:
            return None
        return net.create_parameter(f"{name}.{suffix}", shape, dtype, Constant(value))
    return make("scale", 1.0, scale), make("bias", 0.0, shift)


def running_estimates(net, name, channels, dtype):
    """`name.estimated_mean` (zeros), `name.estimated_var` (ones) and the int64 counter
    `name.num_batches` (0), none of them trainable."""
    def persist(suffix, value, shape=channels, dt=dtype):
        return net.create_parameter(f"{name}.{suffix}", shape, dt, Constant(value),
                                    trainable=False)
    return (persist("estimated_mean", 0.0), persist("estimated_var", 1.0),
            persist("num_batches", 0.0, shape=(), dt=np.dtype("int64")))


def bool_arg(kind, arg, value):
    """`value` as a bool, else an error naming the layer and the argument."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{kind}: argument '{arg}' must be True or False, got {value!r}")
    return bool(value)


def layout_arg(kind, value):
    """data_layout checked: "NCHW" or "NHWC"."""
    if value not in LAYOUTS:
        raise ValueError(f"{kind}: argument 'data_layout' must be 'NCHW' or 'NHWC', got "
                         f"{value!r}")
    return value


def momentum_arg(kind, value):
    """A momentum in OUR convention (the weight of the old estimate) in [0, 1], or None
    for the cumulative average."""
    if value is None:
        return None
    return float_arg(kind, "momentum", value, 0.0, 1.0)


@layer("batch_norm")
def batch_norm(net, x, epsilon=1e-5, momentum=0.9, data_layout="NCHW", use_global_est=False,
               name=None, sync=False, affine=True, track_running_stats=True, bias=True,
               first_batch_sets_estimates=True):
    """Batch normalisation; forks the net into train and infer branches.

    Persistables: `name.scale` (ones) and `name.bias` (zeros) unless
    affine=False (bias=False: the scale alone, PyTorch's BatchNorm(bias=False));
    `name.estimated_mean` (zeros), `name.estimated_var` (ones) and the int64 counter
    `name.num_batches` unless track_running_stats=False, which makes both branches
    normalise with the batch's statistics (PyTorch's eval mode then does too).
    momentum weights the OLD estimate (PyTorch's momentum m is 1 - m here); None makes
    the estimates a cumulative average. The first training batch sets the estimates
    (the design's rule); first_batch_sets_estimates=False starts them at mean 0 and
    variance 1 and blends from the first batch on, as PyTorch's _NormBase. epsilon
    must be > 0 (as PyTorch's BatchNorm). sync=True builds `sync_batch_norm`
    (statistics over every rank's batch).
    """
    kind = "batch_norm"
    tensor(net, kind, "x", x, float_only=True)
    data_layout = layout_arg(kind, data_layout)
    affine, bias = bool_arg(kind, "affine", affine), bool_arg(kind, "bias", bias)
    tracked = bool_arg(kind, "track_running_stats", track_running_stats)
    first = bool_arg(kind, "first_batch_sets_estimates", first_batch_sets_estimates)
    use_global_est = bool_arg(kind, "use_global_est", use_global_est)
    epsilon = float_arg(kind, "epsilon", epsilon, 0.0)
    if epsilon <= 0:
        raise ValueError(f"{kind}: argument 'epsilon' must be > 0 (as PyTorch's BatchNorm), "
                         f"got {epsilon!r}")
    momentum = momentum_arg(kind, momentum)
    if use_global_est and not tracked:
        raise ValueError("batch_norm: use_global_est=True needs the running estimates "
                         "(track_running_stats=True)")
    shape = x.shape
    axis = 1 if data_layout == "NCHW" else -1
    if shape is None or len(shape) < 2 or shape[axis] < 0:
        raise ValueError(f"batch_norm: argument 'x' ({x.name!r}) needs a known channel axis "
                         f"({data_layout}), got shape {shape}")
    channels = (shape[axis],)
    scale, shift = affine_params(net, name, channels, x.dtype, affine, affine and bias)
    inputs = {"x": x, "scale": scale, "bias": shift}
    outputs = {"y": f"{name}.y", "batch_mean": f"{name}.batch_mean",
               "batch_var": f"{name}.batch_var"}
    if tracked:
        mean, var, counter = running_estimates(net, name, channels, x.dtype)
        inputs.update(estimated_mean=mean, estimated_var=var, num_batches=counter)
        outputs.update(saved_mean=mean, saved_var=var, saved_num_batches=counter)
    outs = net.append("sync_batch_norm" if sync else "batch_norm",
                      {k: v for k, v in inputs.items() if v is not None}, outputs,
                      {"epsilon": epsilon, "momentum": momentum, "data_layout": data_layout,
                       "use_global_est": use_global_est, "first_batch_sets_estimates": first})
    return outs["y"]


@layer("layer_norm")
def layer_norm(net, x, begin_norm_axis=1, epsilon=1e-5, scale=True, shift=True, name=None):
    """Normalisation over axes begin_norm_axis.. of each sample (torch's
    F.layer_norm(x, x.shape[begin_norm_axis:], weight, bias, eps)): `name.scale`
    (ones) and `name.bias` (zeros) hold one value per position of those axes,
    flattened, unless scale=False / shift=False (each on its own: torch's
    LayerNorm(elementwise_affine=False) is both False, LayerNorm(bias=False)
    shift=False). epsilon may be 0 (a row of equal values is then an error). Not
    mode-dependent."""
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
    params = affine_params(net, name, (math.prod(tail),), x.dtype,
                           bool_arg("layer_norm", "scale", scale),
                           bool_arg("layer_norm", "shift", shift))
    return append_norm(net, "layer_norm", x, params, name,
                       {"begin_norm_axis": begin, "epsilon": epsilon})["y"]


def append_norm(net, op_type, x, params, name, attrs, extra_inputs=None, extra_outputs=None):
    """Append a normalisation op (x, scale, bias -> y, mean, variance); returns its
    outputs {slot: Variable}."""
    scale, bias = params
    inputs = {k: v for k, v in (("x", x), ("scale", scale), ("bias", bias)) if v is not None}
    outputs = {"y": f"{name}.y", "mean": f"{name}.mean", "variance": f"{name}.variance"}
    return net.append(op_type, {**inputs, **(extra_inputs or {})},
                      {**outputs, **(extra_outputs or {})}, attrs)
