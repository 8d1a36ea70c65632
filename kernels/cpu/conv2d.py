"""CPU kernels of conv2d (ops/conv2d.py): the native kernels (conv_native: float32,
one group, where a C compiler works) where they take the conv, else the im2col
engine (conv_im2col, conv_im2col_grad) with lean work arrays, or up to the room a
training step leaves them (KernelContext.room, OpSchema.work_room); and of
fused_conv2d (ops/fused_conv2d.py), whose bias, residual and relu are applied to
each tile or chunk of the convolution's output while it is in cache.
"""
from __future__ import annotations

from minigraph.kernels import present
from minigraph.kernels.cpu import blocks, conv_im2col, conv_im2col_grad, conv_native


def cpu_geometry(op, x, w):
    """The CPU engine's Geometry of this op on x and filter."""
    a = op.attrs
    return conv_im2col.geometry(x.shape, w.shape, a["strides"], a["paddings"], a["dilations"],
                             a["groups"])


def conv2d_cpu(op, ins, ctx):
    """out[n, o] = sum over the group's channels and taps of filter * window: the
    native kernel where it takes the conv (conv_native: float32, one group),
    else the im2col engine with lean work arrays, like its gradient's (conv2d is
    the op training steps run, and their peak memory comes from these;
    fused_conv2d, for inference, takes full chunks), or up to `ctx.room` bytes of them
    (OpSchema.work_room)."""
    x, w = ins["x"], ins["filter"]
    g = cpu_geometry(op, x, w)
    if conv_native.supports(g, x.dtype):
        return {"out": conv_native.forward(x, w, g, blocks.get_num_threads())}
    return {"out": conv_im2col.forward(x, w, g, lean=True, room=ctx.room)}


def conv2d_grad_cpu(op, ins, ctx):
    """dx and dfilter (each only when bound): the native kernels where they take the
    conv (dfilter; dx as forward passes over dout, one per phase of the stride),
    else conv_im2col_grad: dx of a stride-1 conv as the conv of dout with the flipped
    filter, dfilter from the same columns, else products with the columns and
    col2im; lean work arrays, or up to `ctx.room` bytes of them."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    g = cpu_geometry(op, x, w)
    need_dx, need_dw = op.wants("dx"), op.wants("dfilter")
    if conv_native.supports(g, x.dtype):
        threads = blocks.get_num_threads()
        return present(dx=conv_native.input_grad(w, d, g, threads) if need_dx else None,
                       dfilter=conv_native.filter_grad(x, d, g, threads) if need_dw else None)
    dx, dw = conv_im2col_grad.backward(x, w, d, g, need_dx=need_dx, need_dw=need_dw, room=ctx.room)
    return present(dx=dx, dfilter=dw)


def fused_conv2d_cpu(op, ins, ctx):
    """out = act(conv2d(x, filter) + bias + residual): the native kernel where it
    takes the conv (Winograd's with a larger scratch bound than conv2d's: this op
    runs in inference nets only), else the im2col engine."""
    x, w = ins["x"], ins["filter"]
    g = cpu_geometry(op, x, w)
    epilogue = {"bias": ins.get("bias"), "residual": ins.get("residual"),
                "relu": op.attrs["activation"] == "relu"}
    if conv_native.supports(g, x.dtype):
        return {"out": conv_native.forward(x, w, g, blocks.get_num_threads(), **epilogue,
                                           max_scratch=conv_native.WINOGRAD_MAX_SCRATCH_INFERENCE)}
    return {"out": conv_im2col.forward(x, w, g, **epilogue)}
