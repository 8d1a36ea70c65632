"""Launchers for kernels/cuda/loss.cu: sigmoid_cross_entropy_with_logits and its
gradients on device arrays (computed in double, rounded to the dtype); the op
kernels of ops/loss.py."""
from __future__ import annotations

from minigraph.kernels import present
from minigraph.kernels.cuda import launch, loader
from minigraph.kernels.cuda import map as maps

MODULE = "loss"
SIGNATURES = {f"bce_grad_x_{t}": "PPPPq" for t in ("f32", "f64")}


def sigmoid_cross_entropy(x, label):
    """out = max(x, 0) - x * label + log1p(exp(-|x|)) elementwise (x and label of one
    shape and float dtype), a new array."""
    return maps.binary(MODULE, "bce", x, label)


def sigmoid_cross_entropy_grad(x, label, dout, need_dx=True, need_dlabel=True):
    """(dx, dlabel) = (dout * (sigmoid(x) - label), -dout * x), None for the ones not
    needed."""
    dx = dlabel = None
    if need_dx:
        what = "sigmoid_cross_entropy_with_logits_grad"
        launch.check_contiguous(f"{what}: x", x)
        launch.check_array(f"{what}: label", label, x.shape, x.dtype)
        launch.check_array(f"{what}: dout", dout, x.shape, x.dtype)
        dx = loader.empty(tuple(x.shape), x.dtype)
        if dx.size:
            name = f"bce_grad_x_{loader.suffix(x.dtype)}"
            loader.flat_go(MODULE, name, SIGNATURES[name], dx.size)(
                loader.ptr(x), loader.ptr(label), loader.ptr(dout), loader.address(dx), dx.size)
    if need_dlabel:
        dlabel = maps.binary(MODULE, "bce_grad_label", x, dout)
    return dx, dlabel


# ---- op kernels -------------------------------------------------------------------

def sigmoid_cross_entropy_with_logits_gpu(op, ins, ctx):
    """out = max(x, 0) - x * label + log1p(exp(-|x|)) on the device, in double."""
    return {"out": sigmoid_cross_entropy(ins["x"], ins["label"])}


def sigmoid_cross_entropy_with_logits_grad_gpu(op, ins, ctx):
    """dx = dout * (sigmoid(x) - label), dlabel = -dout * x on the device, each when
    bound."""
    dx, dlabel = sigmoid_cross_entropy_grad(ins["x"], ins["label"], ins["dout"],
                                            need_dx=op.wants("dx"),
                                            need_dlabel=op.wants("dlabel"))
    return present(dx=dx, dlabel=dlabel)
