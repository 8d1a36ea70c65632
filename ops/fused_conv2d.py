"""fused_conv2d: conv2d, a per-channel bias, a residual and relu as one op (inference).

out = act(conv2d(x, filter) + bias[o] + residual), act = relu or the identity;
`bias` (O,) and `residual` (out's shape) are optional. The attributes are
conv2d's (strides, paddings, dilations, groups) and `activation` ("relu" or
"none"). mg.passes.fuse_conv2d builds it from conv2d -> elementwise_add (the
layer's bias, axis 1) -> add (a residual of the same shape) -> relu chains of
an inference net, so the bias, the residual and relu are applied to each chunk
of the convolution's output while it is in cache, with no array in between.

It is an inference-only op: it has no gradient, and backward through it is an
error (train the net with conv2d and fuse its inference copy).
CPU: the native kernel (kernels/conv2d_cpu: float32, one group, where a C
compiler built it) with the epilogue on each tile of outputs in registers,
else minigraph.ops.conv_cpu.forward with its epilogue on each chunk. GPU: the
conv2d launcher, then the bias, residual and relu launchers in place on its
output.
"""
from __future__ import annotations

from minigraph import cpu_blocks
from minigraph.kernels import activation as gpu_activation
from minigraph.kernels import broadcast as gpu_broadcast
from minigraph.kernels import conv2d as gpu_conv
from minigraph.kernels import conv2d_cpu as native_conv
from minigraph.kernels import elementwise as gpu_elementwise
from minigraph.ops import conv_cpu
from minigraph.ops.conv2d import conv_attrs, conv_geometry, cpu_geometry, infer_conv, resolve
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import OpError, OpSchema, Slot, kernel, register
from minigraph.validators import check_same_dtype, check_shape, one_of, str_attr

TYPE = "fused_conv2d"


def infer_fused(ins, attrs):
    try:
        out = infer_conv(ins, attrs)["out"]
    except OpError as e:
        raise OpError(str(e).replace("conv2d:", f"{TYPE}:", 1)) from None
    bias, residual = ins.get("bias"), ins.get("residual")
    if bias is not None:
        check_same_dtype(TYPE, "bias", bias, "x", ins["x"])
        check_shape(TYPE, "bias", bias, (out.shape[1],), " (one value per output channel)")
    if residual is not None:
        check_same_dtype(TYPE, "residual", residual, "x", ins["x"])
        check_shape(TYPE, "residual", residual, out.shape, " (the convolution's output shape)")
    return {"out": out}


def no_grad(op, dout, make_grad):
    raise OpError(f"{TYPE}: an inference-only op, it has no gradient; train the net with "
                  "conv2d (and its bias add and relu) and fuse its inference copy "
                  "(mg.passes.optimize_for_inference)")


register(OpSchema(
    type=TYPE,
    inputs=(Slot("x"), Slot("filter"), Slot("bias", optional=True),
            Slot("residual", optional=True)),
    outputs=(Slot("out"),),
    attrs=conv_attrs() + (str_attr("activation", "none", one_of("none", "relu")),),
    infer=infer_fused, resolve_attrs=resolve, grad=no_grad, doc=__doc__))


@kernel(TYPE, "cpu")
def fused_conv2d_cpu(op, ins, ctx):
    """out = act(conv2d(x, filter) + bias + residual): the native kernel where it
    takes the conv, else conv_cpu's engine."""
    x, w = ins["x"], ins["filter"]
    g = cpu_geometry(op, x, w)
    epilogue = {"bias": ins.get("bias"), "residual": ins.get("residual"),
                "relu": op.attrs["activation"] == "relu"}
    if native_conv.supports(g, x.dtype):
        return {"out": native_conv.forward(x, w, g, cpu_blocks.get_num_threads(), **epilogue)}
    return {"out": conv_cpu.forward(x, w, g, **epilogue)}


@kernel(TYPE, "gpu", dtypes=GPU_FLOATS)
def fused_conv2d_gpu(op, ins, ctx):
    """The conv2d launcher, then bias, residual and relu in place on its output."""
    out = gpu_conv.conv2d(ins["x"], ins["filter"], **conv_geometry(op))
    if ins.get("bias") is not None:
        gpu_elementwise.add(out, ins["bias"], axis=1, out=out)
    if ins.get("residual") is not None:
        gpu_broadcast.add(out, ins["residual"], out=out)
    if op.attrs["activation"] == "relu":
        gpu_activation.relu(out, out=out)
    return {"out": out}
