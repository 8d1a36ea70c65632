"""CPU kernels of sigmoid_cross_entropy_with_logits (ops/loss.py): the stable form
max(x, 0) - x y + log(1 + exp(-|x|)) in float64, and its gradients."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu.activation import sigmoid64, work


def sigmoid_cross_entropy_with_logits_cpu(op, ins, ctx):
    """out = max(x, 0) - x * label + log1p(exp(-|x|)), elementwise."""
    x, y = ins["x"], ins["label"]
    xw, yw = work(x), work(y)
    return {"out": (np.maximum(xw, 0) - xw * yw + np.log1p(np.exp(-np.abs(xw)))).astype(x.dtype)}


def sigmoid_cross_entropy_with_logits_grad_cpu(op, ins, ctx):
    """dx = dout * (sigmoid(x) - label); dlabel = -dout * x."""
    x, y, d = work(ins["x"]), work(ins["label"]), ins["dout"]
    out = {}
    if op.wants("dx"):
        out["dx"] = (work(d) * (sigmoid64(x) - y)).astype(d.dtype)
    if op.wants("dlabel"):
        out["dlabel"] = (-work(d) * x).astype(d.dtype)
    return out
