"""The layer API: functions that create parameters and append ops to a Net.

Each layer takes the net and its input Variable(s) and returns the output
Variable (the train copy once the net has forked). Unnamed layers get
unique names such as `fc_0`, skipping names already used. A layer checks its
arguments when it is called (errors name the layer and the argument) and
builds all or nothing. See minigraph.layers.base for writing a new one.
"""
from minigraph.layers.activation import gelu, leaky_relu, relu, sigmoid, silu, softmax, tanh
from minigraph.layers.base import LayerRecord, layer
from minigraph.layers.loss import accuracy, argmax, mean, softmax_with_cross_entropy
from minigraph.layers.nn import conv2d, data, dropout, fc, pool2d
from minigraph.layers.norm import batch_norm, group_norm, instance_norm, layer_norm
from minigraph.layers.tensor import add, concat, flatten, multiply, reshape, transpose

__all__ = ["LayerRecord", "accuracy", "add", "argmax", "batch_norm", "concat", "conv2d", "data",
           "dropout", "fc", "flatten", "gelu", "group_norm", "instance_norm", "layer",
           "layer_norm", "leaky_relu", "mean", "multiply", "pool2d", "relu", "reshape",
           "sigmoid", "silu", "softmax", "softmax_with_cross_entropy", "tanh", "transpose"]
