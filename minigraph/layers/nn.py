"""Layers with parameters or modes: data, fc, conv2d, pool2d, dropout (the normalisations:
minigraph.layers.norm).

Each returns its output Variable (the train copy once the net has forked;
the infer branch has its own copy, `net.twin(var)`). Parameters get their
initial values at once.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from minigraph.initializer import Constant, Xavier
from minigraph.layers.base import (
    float_arg,
    int_arg,
    known_dims,
    layer,
    pair_arg,
    tensor,
)


def data(net, name, shape, dtype="float32"):
    """A fed input; -1 marks a size given by each feed (usually the batch)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"data: name must be a non-empty str, got {name!r}")
    if net.name_taken(name):
        raise ValueError(f"data: the name {name!r} is already used in this net")
    try:
        shape = tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"data {name!r}: shape must be a tuple of ints and dtype a numpy dtype "
                        f"({e})") from e
    if any(d < -1 for d in shape):
        raise ValueError(f"data {name!r}: every size must be >= 0, or -1 for a size each feed "
                         f"gives, got {shape}")
    return net.add_data(name, shape, dtype)


def _bias(net, out, name, size, dtype, b_init, out_name):
    b = net.create_parameter(f"{name}.b", (size,), dtype, b_init or Constant(0.0))
    return net.append("elementwise_add", {"x": out, "y": b}, {"out": out_name},
                      {"axis": 1})["out"]


@layer("fc")
def fc(net, x, size, name=None, w_init=None, b_init=None, bias=True):
    """y = flatten(x) @ w + b; w: `name.w` (in_features, size), b: `name.b` (size,).
    Every axis after the first is flattened."""
    tensor(net, "fc", "x", x, float_only=True)
    size = int_arg("fc", "size", size)
    shape = known_dims("fc", "x", x, range(1, len(x.shape or ())))
    if len(shape) < 2:
        raise ValueError(f"fc: argument 'x' ({x.name!r}) needs a batch axis and at least one "
                         f"feature axis, got shape {shape}")
    in_features = math.prod(shape[1:])
    w = net.create_parameter(f"{name}.w", (in_features, size), x.dtype, w_init or Xavier(),
                             fan_in=in_features, fan_out=size)
    out = net.append("mul", {"x": x, "y": w}, {"out": f"{name}.mul" if bias else f"{name}.out"},
                     {"x_num_col_dims": 1})["out"]
    return _bias(net, out, name, size, x.dtype, b_init, f"{name}.out") if bias else out


@layer("conv2d")
def conv2d(net, x, num_filters, filter_size, stride=1, padding=0, dilation=1, groups=1,
           name=None, w_init=None, b_init=None, bias=True):
    """2-D convolution on NCHW input; w: `name.w` (out, in/groups, kh, kw), b: `name.b`."""
    tensor(net, "conv2d", "x", x, float_only=True)
    num_filters = int_arg("conv2d", "num_filters", num_filters)
    groups = int_arg("conv2d", "groups", groups)
    kh, kw = pair_arg("conv2d", "filter_size", filter_size)
    attrs = {"strides": pair_arg("conv2d", "stride", stride),
             "paddings": pair_arg("conv2d", "padding", padding, minimum=0),
             "dilations": pair_arg("conv2d", "dilation", dilation), "groups": groups}
    if x.shape is None or len(x.shape) != 4:
        raise ValueError(f"conv2d: argument 'x' ({x.name!r}) must be NCHW (rank 4), got shape "
                         f"{x.shape}")
    channels = known_dims("conv2d", "x", x, (1,))[1]
    if channels % groups or num_filters % groups:
        raise ValueError(f"conv2d: argument 'groups' ({groups}) must divide the {channels} "
                         f"input channels and num_filters ({num_filters})")
    w = net.create_parameter(f"{name}.w", (num_filters, channels // groups, kh, kw), x.dtype,
                             w_init or Xavier(), fan_in=channels // groups * kh * kw,
                             fan_out=num_filters // groups * kh * kw)
    out = net.append("conv2d", {"x": x, "filter": w},
                     {"out": f"{name}.conv" if bias else f"{name}.out"}, attrs)["out"]
    return _bias(net, out, name, num_filters, x.dtype, b_init, f"{name}.out") if bias else out


@layer("pool2d")
def pool2d(net, x, pool_size=2, pool_type="max", pool_stride=None, pool_padding=0,
           global_pooling=False, name=None):
    """Max or average pooling on NCHW input; "avg" excludes padding from the divisor.
    The stride defaults to the pool size. global_pooling=True pools each whole
    H x W plane to 1 x 1 (output (N, C, 1, 1); pool_size, stride and padding
    are then ignored): global average pooling is pool_type="avg"."""
    tensor(net, "pool2d", "x", x, float_only=True)
    if pool_type not in ("max", "avg"):
        raise ValueError(f"pool2d: argument 'pool_type' must be 'max' or 'avg', got "
                         f"{pool_type!r}")
    ksize = pair_arg("pool2d", "pool_size", pool_size)
    strides = ksize if pool_stride is None else pair_arg("pool2d", "pool_stride", pool_stride)
    paddings = pair_arg("pool2d", "pool_padding", pool_padding, minimum=0)
    return net.append("pool2d", {"x": x}, {"out": f"{name}.out"},
                      {"pool_type": pool_type, "ksize": ksize, "strides": strides,
                       "paddings": paddings, "global_pooling": bool(global_pooling)})["out"]


@layer("dropout")
def dropout(net, x, p=0.5, name=None):
    """Inverted dropout in training (each value kept with probability 1 - p and
    scaled by 1 / (1 - p)); the identity in inference. Forks the net, like
    batch_norm. Masks come from the net's seed, the layer's name and the
    layer's step counter (the persistable `name.step`), so a seeded run
    repeats exactly and a checkpoint resumes the same masks."""
    tensor(net, "dropout", "x", x, float_only=True)
    p = float_arg("dropout", "p", p, 0.0, 1.0, high_open=True)
    step = net.create_parameter(f"{name}.step", (), "int64", Constant(0), trainable=False)
    seed = (net.seed ^ zlib.crc32(name.encode())) % 2 ** 32
    outs = net.append("dropout", {"x": x, "step": step},
                      {"out": f"{name}.out", "mask": f"{name}.mask", "step_out": step},
                      {"p": p, "seed": seed})
    return outs["out"]
