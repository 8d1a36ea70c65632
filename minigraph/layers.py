"""The layer API: functions that create parameters and append ops to a Net.

Each layer takes the net and its input Variable(s) and returns the output
Variable (the train copy once the net has forked; the infer branch finds its
own copy by name). Unnamed layers get unique names such as `fc_0`.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.initializer import Constant, Xavier


def _pair(v, what):
    if isinstance(v, int):
        return (v, v)
    if len(v) == 2:
        return tuple(int(x) for x in v)
    raise ValueError(f"{what} must be an int or a pair of ints, got {v!r}")


def _known(x, layer, dims):
    shape = x.shape
    if shape is None or any(shape[d] < 0 for d in dims):
        raise ValueError(f"{layer}: the input {x.name!r} needs known sizes on axes {dims}, "
                         f"got shape {shape}")
    return shape


def data(net, name, shape, dtype="float32"):
    """A fed input; -1 marks a size given by each feed (usually the batch)."""
    return net.add_data(name, shape, dtype)


def fc(net, x, size, name=None, w_init=None, b_init=None, bias=True):
    """y = flatten(x) @ w + b; w: `name.w` (in_features, size), b: `name.b` (size,).
    Every axis after the first is flattened."""
    name = name or net.unique_name("fc")
    shape = _known(x, "fc", range(1, len(x.shape)))
    in_features = math.prod(shape[1:])
    w = net.create_parameter(f"{name}.w", (in_features, size), x.dtype, w_init or Xavier(),
                             fan_in=in_features, fan_out=size)
    out = net.append("mul", {"x": x, "y": w}, {"out": f"{name}.mul" if bias else f"{name}.out"},
                     {"x_num_col_dims": 1})["out"]
    if not bias:
        return out
    b = net.create_parameter(f"{name}.b", (size,), x.dtype, b_init or Constant(0.0))
    return net.append("elementwise_add", {"x": out, "y": b}, {"out": f"{name}.out"},
                      {"axis": 1})["out"]


def conv2d(net, x, num_filters, filter_size, stride=1, padding=0, dilation=1, groups=1,
           name=None, w_init=None, b_init=None, bias=True):
    """2-D convolution on NCHW input; w: `name.w` (out, in/groups, kh, kw), b: `name.b`."""
    name = name or net.unique_name("conv2d")
    shape = _known(x, "conv2d", (1,))
    channels = shape[1]
    if channels % groups:
        raise ValueError(f"conv2d: {channels} input channels are not divisible by "
                         f"groups={groups}")
    kh, kw = _pair(filter_size, "filter_size")
    wshape = (num_filters, channels // groups, kh, kw)
    w = net.create_parameter(f"{name}.w", wshape, x.dtype, w_init or Xavier(),
                             fan_in=channels // groups * kh * kw,
                             fan_out=num_filters // groups * kh * kw)
    attrs = {"strides": _pair(stride, "stride"), "paddings": _pair(padding, "padding"),
             "dilations": _pair(dilation, "dilation"), "groups": groups}
    out = net.append("conv2d", {"x": x, "filter": w},
                     {"out": f"{name}.conv" if bias else f"{name}.out"}, attrs)["out"]
    if not bias:
        return out
    b = net.create_parameter(f"{name}.b", (num_filters,), x.dtype, b_init or Constant(0.0))
    return net.append("elementwise_add", {"x": out, "y": b}, {"out": f"{name}.out"},
                      {"axis": 1})["out"]


def pool2d(net, x, pool_size=2, pool_type="max", pool_stride=None, pool_padding=0,
           global_pooling=False, name=None):
    """Max or average pooling on NCHW input; "avg" excludes padding from the divisor.
    The stride defaults to the pool size."""
    name = name or net.unique_name("pool2d")
    ksize = _pair(pool_size, "pool_size")
    strides = ksize if pool_stride is None else _pair(pool_stride, "pool_stride")
    return net.append("pool2d", {"x": x}, {"out": f"{name}.out"},
                      {"pool_type": pool_type, "ksize": ksize, "strides": strides,
                       "paddings": _pair(pool_padding, "pool_padding"),
                       "global_pooling": global_pooling})["out"]


def batch_norm(net, x, epsilon=1e-5, momentum=0.9, data_layout="NCHW", use_global_est=False,
               name=None, sync=False):
    """Batch normalisation; forks the net into train and infer branches.

    Persistables: `name.scale` (ones), `name.bias` (zeros), `name.estimated_mean`
    (zeros), `name.estimated_var` (ones) and the int64 counter `name.num_batches`.
    momentum weights the OLD estimate (PyTorch's momentum m is 1 - m here);
    None makes the estimates a cumulative average. sync=True builds
    `sync_batch_norm` (statistics over every rank's batch).
    """
    name = name or net.unique_name("batch_norm")
    shape = x.shape
    axis = 1 if data_layout == "NCHW" else -1
    if shape is None or len(shape) < 2 or shape[axis] < 0:
        raise ValueError(f"batch_norm: input {x.name!r} needs a known channel axis "
                         f"({data_layout}), got shape {shape}")
    channels = (shape[axis],)
    dtype = x.dtype

    def persist(suffix, init, trainable=False, shape=channels, dt=dtype):
        return net.create_parameter(f"{name}.{suffix}", shape, dt, init, trainable=trainable)

    scale = persist("scale", Constant(1.0), trainable=True)
    bias = persist("bias", Constant(0.0), trainable=True)
    mean = persist("estimated_mean", Constant(0.0))
    var = persist("estimated_var", Constant(1.0))
    counter = persist("num_batches", Constant(0.0), shape=(), dt=np.dtype("int64"))
    outs = net.append(
        "sync_batch_norm" if sync else "batch_norm",
        {"x": x, "estimated_mean": mean, "estimated_var": var, "scale": scale, "bias": bias,
         "num_batches": counter},
        {"y": f"{name}.y", "batch_mean": f"{name}.batch_mean", "batch_var": f"{name}.batch_var",
         "saved_mean": mean, "saved_var": var, "saved_num_batches": counter},
        {"epsilon": epsilon, "momentum": momentum, "data_layout": data_layout,
         "use_global_est": use_global_est})
    return outs["y"]


def relu(net, x, name=None):
    """max(x, 0)."""
    name = name or net.unique_name("relu")
    return net.append("relu", {"x": x}, {"out": f"{name}.out"})["out"]


def softmax_with_cross_entropy(net, logits, label, name=None):
    """Per-row cross entropy of softmax(logits) against int64 class labels; shape (N,)."""
    name = name or net.unique_name("softmax_with_cross_entropy")
    return net.append("softmax_with_cross_entropy", {"logits": logits, "label": label},
                      {"softmax": f"{name}.softmax", "loss": f"{name}.loss"})["loss"]


def mean(net, x, name=None):
    """The mean of every element: a scalar of shape ()."""
    name = name or net.unique_name("mean")
    return net.append("mean", {"x": x}, {"out": f"{name}.out"})["out"]
