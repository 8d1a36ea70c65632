"""CPU kernels of conv2d (ops/conv2d.py): the native kernels (float32, one group, where a
C compiler works: conv_native for NCHW, conv_native_nhwc for NHWC) where they take
the conv, else the im2col engine of the layout (conv_im2col and conv_im2col_grad,
conv_im2col_nhwc) with lean work arrays, or up to the room a training step leaves
them (KernelContext.room, OpSchema.work_room); and of fused_conv2d
(ops/fused_conv2d.py), whose bias, residual and relu are applied to each tile or
chunk of the convolution's output while it is in cache.
"""
from __future__ import annotations

from typing import NamedTuple

from minigraph.kernels import present
from minigraph.kernels.cpu import (
    blocks,
    conv_im2col,
    conv_im2col_grad,
    conv_im2col_nhwc,
    conv_native,
    conv_native_nhwc,
)
from minigraph.kernels.layout import nchw_sizes


class Engines(NamedTuple):
    """The kernels of one layout: native forward, filter and input gradients; numpy
    forward and backward."""

    forward: object
    filter_grad: object
    input_grad: object
    numpy_forward: object
    numpy_backward: object


ENGINES = {
    "NCHW": Engines(conv_native.forward, conv_native.filter_grad, conv_native.input_grad,
                    conv_im2col.forward, conv_im2col_grad.backward),
    "NHWC": Engines(conv_native_nhwc.forward, conv_native_nhwc.filter_grad,
                    conv_native_nhwc.input_grad, conv_im2col_nhwc.forward,
                    conv_im2col_nhwc.backward),
}


def cpu_geometry(op, x, w):
    """The CPU engine's Geometry of this op on x and filter (either layout)."""
    a = op.attrs
    return conv_im2col.geometry(nchw_sizes(a["data_layout"], x.shape), w.shape, a["strides"],
                                a["paddings"], a["dilations"], a["groups"])


def conv2d_cpu(op, ins, ctx):
    """out[n, o] = sum over the group's channels and taps of filter * window: the
    native kernel where it takes the conv (conv_native, conv_native_nhwc: float32, one
    group), else the im2col engine with lean work arrays, like its gradient's (conv2d
    is the op training steps run, and their peak memory comes from these;
    fused_conv2d, for inference, takes full chunks), or up to `ctx.room` bytes of them
    (OpSchema.work_room)."""
    x, w = ins["x"], ins["filter"]
    g, run = cpu_geometry(op, x, w), ENGINES[op.attrs["data_layout"]]
    if conv_native.supports(g, x.dtype):
        return {"out": run.forward(x, w, g, blocks.get_num_threads())}
    return {"out": run.numpy_forward(x, w, g, lean=True, room=ctx.room)}


def conv2d_grad_cpu(op, ins, ctx):
    """dx and dfilter (each only when bound): the native kernels where they take the
    conv (dfilter; dx as forward passes over dout, one per phase of the stride),
    else the layout's numpy engine (NCHW: dx of a stride-1 conv as the conv of dout
    with the flipped filter, dfilter from the same columns, else products with the
    columns and col2im); lean work arrays, or up to `ctx.room` bytes of them."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    g, run = cpu_geometry(op, x, w), ENGINES[op.attrs["data_layout"]]
    need_dx, need_dw = op.wants("dx"), op.wants("dfilter")
    if conv_native.supports(g, x.dtype):
        threads = blocks.get_num_threads()
        return present(dx=run.input_grad(w, d, g, threads) if need_dx else None,
                       dfilter=run.filter_grad(x, d, g, threads) if need_dw else None)
    dx, dw = run.numpy_backward(x, w, d, g, need_dx=need_dx, need_dw=need_dw, room=ctx.room)
    return present(dx=dx, dfilter=dw)


def fused_conv2d_cpu(op, ins, ctx):
    """out = act(conv2d(x, filter) + bias + residual): the native kernel where it
    takes the conv (Winograd's with a larger scratch bound than conv2d's: this op
    runs in inference nets only), else the im2col engine."""
    x, w = ins["x"], ins["filter"]
    g, run = cpu_geometry(op, x, w), ENGINES[op.attrs["data_layout"]]
    epilogue = {"bias": ins.get("bias"), "residual": ins.get("residual"),
                "relu": op.attrs["activation"] == "relu"}
    if conv_native.supports(g, x.dtype):
        return {"out": run.forward(x, w, g, blocks.get_num_threads(), **epilogue,
                                   max_scratch=conv_native.WINOGRAD_MAX_SCRATCH_INFERENCE)}
    return {"out": run.numpy_forward(x, w, g, **epilogue)}
