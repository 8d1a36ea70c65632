"""Layers with parameters or modes: data, fc, linear, conv2d, pool2d, dropout (the
normalisations: minigraph.layers.norm; attention: minigraph.layers.attention).

Each returns its output Variable (the train copy once the net has forked;
the infer branch has its own copy, `net.twin(var)`). Parameters get their
initial values at once.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

from minigraph.feeds import data_declaration
from minigraph.initializer import Constant, FanInUniform, KaimingUniform, Normal
from minigraph.kernels.layout import LAYOUTS, channel_axis
from minigraph.layers.base import (
    float_arg,
    int_arg,
    known_dims,
    layer,
    pair_arg,
    parameter,
    tensor,
)
from minigraph.validators import is_int


def data(net, name, shape, dtype="float32"):
    """A fed input; -1 marks a size given by each feed (usually the batch)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"data: name must be a non-empty str, got {name!r}")
    if net.name_taken(name):
        raise ValueError(f"data: the name {name!r} is already used in this net")
    shape, dtype = data_declaration(name, shape, dtype)
    return net.add_data(name, shape, dtype)


def _bias(net, kind, out, name, size, dtype, attr, fan_in, out_name, axis=1):
    b = parameter(net, kind, "bias_attr", attr, f"{name}.b", (size,), dtype, FanInUniform(),
                  fan_in=fan_in)
    return net.append("elementwise_add", {"x": out, "y": b}, {"out": out_name},
                      {"axis": axis})["out"]


def _layout(kind, x, data_layout):
    """data_layout checked ("NCHW" or "NHWC") for a rank-4 x: (layout, channel axis)."""
    if data_layout not in LAYOUTS:
        raise ValueError(f"{kind}: argument 'data_layout' must be 'NCHW' or 'NHWC', got "
                         f"{data_layout!r}")
    if x.shape is None or len(x.shape) != 4:
        raise ValueError(f"{kind}: argument 'x' ({x.name!r}) must be {data_layout} (rank 4), "
                         f"got shape {x.shape}")
    return data_layout, channel_axis(data_layout)


@layer("fc")
def fc(net, x, size, name=None, param_attr=None, bias_attr=None, bias=True):
    """y = flatten(x) @ w + b; w: `name.w` (in_features, size), b: `name.b` (size,).
    Every axis after the first is flattened. param_attr / bias_attr: a ParamAttr (or
    the parameter's name: the same name twice shares it); bias_attr=False (or
    bias=False) makes no bias. Default initialisation: PyTorch's nn.Linear's."""
    tensor(net, "fc", "x", x, float_only=True)
    size = int_arg("fc", "size", size)
    shape = known_dims("fc", "x", x, range(1, len(x.shape or ())))
    if len(shape) < 2:
        raise ValueError(f"fc: argument 'x' ({x.name!r}) needs a batch axis and at least one "
                         f"feature axis, got shape {shape}")
    in_features = math.prod(shape[1:])
    if in_features == 0:
        raise ValueError(f"fc: argument 'x' ({x.name!r}, shape {shape}) has no features: every "
                         "axis after the first must be > 0")
    with_bias = bias and bias_attr is not False
    w = parameter(net, "fc", "param_attr", param_attr, f"{name}.w", (in_features, size),
                  x.dtype, KaimingUniform(math.sqrt(5)), fan_in=in_features, fan_out=size)
    out = net.append("mul", {"x": x, "y": w},
                     {"out": f"{name}.mul" if with_bias else f"{name}.out"},
                     {"x_num_col_dims": 1})["out"]
    if not with_bias:
        return out
    return _bias(net, "fc", out, name, size, x.dtype, bias_attr, in_features, f"{name}.out")


@layer("linear")
def linear(net, x, size, param_attr=None, bias_attr=None, name=None):
    """y = x @ w + b on the LAST axis of x of any rank >= 1 (torch.nn.Linear): x (...,
    in_features) -> (..., size); w: `name.w` (in_features, size), b: `name.b` (size,).
    param_attr / bias_attr as fc's (a ParamAttr or a name: the same name twice is one
    shared parameter; bias_attr=False: no bias). Default initialisation: PyTorch's
    nn.Linear's, as fc's. fc flattens every axis after the first (Paddle's fc, for an
    image into a classifier); linear keeps them (a sequence's positions, the heads of
    attention)."""
    tensor(net, "linear", "x", x, float_only=True)
    size = int_arg("linear", "size", size)
    shape = x.shape
    if shape is None or len(shape) < 1 or shape[-1] < 0:
        raise ValueError(f"linear: argument 'x' ({x.name!r}) needs a known last axis (its "
                         f"in_features), got shape {shape}")
    return project(net, "linear", x, size, name, param_attr, bias_attr)


def project(net, kind, x, size, name, param_attr=None, bias_attr=None):
    """The ops of a linear layer `name` on x's last axis (what layers.linear and
    multi_head_attention's projections build): mul (x_num_col_dims = rank - 1) and a
    bias add on the last axis; parameters `name.w` and `name.b`."""
    rank, in_features = len(x.shape), x.shape[-1]
    w = parameter(net, kind, "param_attr", param_attr, f"{name}.w", (in_features, size),
                  x.dtype, KaimingUniform(math.sqrt(5)), fan_in=in_features, fan_out=size)
    flat = x if rank >= 2 else net.append("reshape", {"x": x}, {"out": f"{name}.row"},
                                          {"shape": (1, in_features)})["out"]
    with_bias = bias_attr is not False
    out = net.append("mul", {"x": flat, "y": w},
                     {"out": f"{name}.mul" if with_bias or rank < 2 else f"{name}.out"},
                     {"x_num_col_dims": max(rank - 1, 1)})["out"]
    if with_bias:
        b = parameter(net, kind, "bias_attr", bias_attr, f"{name}.b", (size,), x.dtype,
                      FanInUniform(), fan_in=in_features)
        out = net.append("elementwise_add", {"x": out, "y": b},
                         {"out": f"{name}.out" if rank >= 2 else f"{name}.biased"},
                         {"axis": -1})["out"]
    if rank < 2:
        out = net.append("reshape", {"x": out}, {"out": f"{name}.out"}, {"shape": (size,)})["out"]
    return out


@layer("conv2d")
def conv2d(net, x, num_filters, filter_size, stride=1, padding=0, dilation=1, groups=1,
           name=None, param_attr=None, bias_attr=None, bias=True, data_layout="NCHW"):
    """2-D convolution; w: `name.w` (out, in/groups, kh, kw) in either layout, b: `name.b`
    (out,). data_layout "NCHW" (x (N, C, H, W), out (N, out, Ho, Wo)) or "NHWC"
    (channels last: x (N, H, W, C), out (N, Ho, Wo, out); the bias is added on the
    last axis). param_attr / bias_attr as fc's. Default initialisation: PyTorch's
    nn.Conv2d's."""
    tensor(net, "conv2d", "x", x, float_only=True)
    num_filters = int_arg("conv2d", "num_filters", num_filters)
    groups = int_arg("conv2d", "groups", groups)
    kh, kw = pair_arg("conv2d", "filter_size", filter_size)
    attrs = {"strides": pair_arg("conv2d", "stride", stride),
             "paddings": pair_arg("conv2d", "padding", padding, minimum=0),
             "dilations": pair_arg("conv2d", "dilation", dilation), "groups": groups}
    layout, axis = _layout("conv2d", x, data_layout)
    attrs["data_layout"] = layout
    channels = known_dims("conv2d", "x", x, (axis,))[axis]
    if channels == 0:
        raise ValueError(f"conv2d: argument 'x' ({x.name!r}, shape {x.shape}) has 0 channels "
                         f"({layout}): a convolution needs at least one")
    if channels % groups or num_filters % groups:
        raise ValueError(f"conv2d: argument 'groups' ({groups}) must divide the {channels} "
                         f"input channels and num_filters ({num_filters})")
    fan_in = channels // groups * kh * kw
    with_bias = bias and bias_attr is not False
    w = parameter(net, "conv2d", "param_attr", param_attr, f"{name}.w",
                  (num_filters, channels // groups, kh, kw), x.dtype,
                  KaimingUniform(math.sqrt(5)), fan_in=fan_in,
                  fan_out=num_filters // groups * kh * kw)
    out = net.append("conv2d", {"x": x, "filter": w},
                     {"out": f"{name}.conv" if with_bias else f"{name}.out"}, attrs)["out"]
    if not with_bias:
        return out
    return _bias(net, "conv2d", out, name, num_filters, x.dtype, bias_attr, fan_in,
                 f"{name}.out", axis)


@layer("embedding")
def embedding(net, ids, num_embeddings, embedding_dim, padding_idx=None, param_attr=None,
              dtype="float32", name=None):
    """Rows of a learned table by int64 id (torch.nn.Embedding): `name.w`
    (num_embeddings, embedding_dim), initialised N(0, 1) as torch's with its padding_idx
    row (if any) zero (a param_attr initializer replaces both); the padding row gets no
    gradient. dtype: the table's float dtype. out: ids.shape + (embedding_dim,)."""
    tensor(net, "embedding", "ids", ids)
    if ids.dtype is not None and np.dtype(ids.dtype) != np.int64:
        raise TypeError(f"embedding: argument 'ids' must be int64 row indices, got "
                        f"{ids.name!r} of dtype {ids.dtype}")
    rows = int_arg("embedding", "num_embeddings", num_embeddings)
    dim = int_arg("embedding", "embedding_dim", embedding_dim)
    if padding_idx is not None:
        if not is_int(padding_idx) or not -rows <= padding_idx < rows:
            raise ValueError(f"embedding: argument 'padding_idx' must be None or an int in "
                             f"[{-rows}, {rows}), got {padding_idx!r}")
        padding_idx = int(padding_idx) % rows
    if np.dtype(dtype).kind != "f":
        raise TypeError(f"embedding: argument 'dtype' must be a float dtype, got {dtype!r}")
    w = parameter(net, "embedding", "param_attr", param_attr, f"{name}.w", (rows, dim),
                  dtype, Normal(0.0, 1.0, zero_row=padding_idx))
    return net.append("embedding", {"ids": ids, "w": w}, {"out": f"{name}.out"},
                      {"padding_idx": -1 if padding_idx is None else padding_idx})["out"]


@layer("pool2d")
def pool2d(net, x, pool_size=2, pool_type="max", pool_stride=None, pool_padding=0,
           global_pooling=False, name=None, data_layout="NCHW"):
    """Max or average pooling; "avg" excludes padding from the divisor. The stride
    defaults to the pool size. global_pooling=True pools each whole H x W plane to
    1 x 1 (output (N, C, 1, 1), or (N, 1, 1, C) in NHWC; pool_size, stride and
    padding are then ignored): global average pooling is pool_type="avg".
    data_layout: "NCHW" or "NHWC" (channels last), as conv2d's."""
    tensor(net, "pool2d", "x", x, float_only=True)
    layout, _ = _layout("pool2d", x, data_layout)
    if pool_type not in ("max", "avg"):
        raise ValueError(f"pool2d: argument 'pool_type' must be 'max' or 'avg', got "
                         f"{pool_type!r}")
    ksize = pair_arg("pool2d", "pool_size", pool_size)
    strides = ksize if pool_stride is None else pair_arg("pool2d", "pool_stride", pool_stride)
    paddings = pair_arg("pool2d", "pool_padding", pool_padding, minimum=0)
    return net.append("pool2d", {"x": x}, {"out": f"{name}.out"},
                      {"pool_type": pool_type, "ksize": ksize, "strides": strides,
                       "paddings": paddings, "global_pooling": bool(global_pooling),
                       "data_layout": layout})["out"]


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
