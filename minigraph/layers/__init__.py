"""The layer API: functions that create parameters and append ops to a Net.

Each layer takes the net and its input Variable(s) and returns the output
Variable (the train copy once the net has forked). Unnamed layers get
unique names such as `fc_0`, skipping names already used. A layer checks its
arguments when it is called (errors name the layer and the argument) and
builds all or nothing. See minigraph.layers.base for writing a new one.
"""
from minigraph.layers.activation import gelu, leaky_relu, relu, sigmoid, silu, softmax, tanh
from minigraph.layers.attention import (
    KVCache,
    multi_head_attention,
    position_embedding,
    scaled_dot_product_attention,
)
from minigraph.layers.base import LayerRecord, layer
from minigraph.layers.channel_norm import group_norm, instance_norm
from minigraph.layers.loss import (
    accuracy,
    argmax,
    binary_cross_entropy_with_logits,
    huber_loss,
    l1_loss,
    mean,
    mse_loss,
    softmax_with_cross_entropy,
)
from minigraph.layers.math import (
    abs,  # noqa: A004  (the layer API's name, like torch.abs)
    clip,
    divide,
    exp,
    log,
    matmul,
    pow,  # noqa: A004
    reduce_max,
    reduce_mean,
    reduce_sum,
    scale,
    sqrt,
    square,
    subtract,
)
from minigraph.layers.nn import conv2d, data, dropout, embedding, fc, linear, pool2d
from minigraph.layers.norm import batch_norm, layer_norm
from minigraph.layers.tensor import add, concat, flatten, multiply, reshape, transpose

__all__ = ["KVCache", "LayerRecord", "abs", "accuracy", "add", "argmax", "batch_norm",
           "binary_cross_entropy_with_logits", "clip", "concat", "conv2d", "data", "divide",
           "dropout", "embedding", "exp", "fc", "flatten", "gelu", "group_norm", "huber_loss",
           "instance_norm", "l1_loss", "layer", "layer_norm", "leaky_relu", "linear", "log",
           "matmul", "mean", "mse_loss", "multi_head_attention", "multiply", "pool2d",
           "position_embedding", "pow", "reduce_max", "reduce_mean", "reduce_sum", "relu",
           "reshape", "scale", "scaled_dot_product_attention", "sigmoid", "silu", "softmax",
           "softmax_with_cross_entropy", "sqrt", "square", "subtract", "tanh", "transpose"]
