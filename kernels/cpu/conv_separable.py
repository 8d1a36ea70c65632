"""CPU kernel of fused_separable_conv2d (ops/fused_separable_conv2d.py): a depthwise
conv (with its bias and relu) and then a 1x1 conv (with its bias, residual and relu),
MobileNet's block. Where the native kernels take both (float32 NCHW, a depthwise conv
conv_depthwise takes, as many images as threads), conv_native.c's separable kernel
(conv_separable.h) runs them image by image, the depthwise outputs in each thread's
cache and never in memory; else, or where it measured slower on this machine
(choices.py), fused_conv2d's kernel runs the two convs one after the other. The
separable kernel gives the bits of the native depthwise and pointwise kernels run one
after the other.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from minigraph.kernels.cpu import (
    blocks,
    choices,
    conv2d,
    conv_depthwise,
    conv_native,
    native,
    prepared,
)

DEPTHWISE_ATTRS = ("strides", "paddings", "dilations", "groups", "data_layout")
POINTWISE_ATTRS = {"strides": (1, 1), "paddings": (0, 0), "dilations": (1, 1), "groups": 1}


def part_attrs(attrs):
    """(depthwise, pointwise): the attributes of fused_separable_conv2d's two convs as
    fused_conv2d ops (conv2d's, activation, no pooling)."""
    depthwise = {**{k: attrs[k] for k in DEPTHWISE_ATTRS},
                 "activation": attrs["dw_activation"], "pool": "none"}
    pointwise = {**POINTWISE_ATTRS, "data_layout": attrs["data_layout"],
                 "activation": attrs["activation"], "pool": "none"}
    return depthwise, pointwise


def parts(op):
    """(depthwise, pointwise): the op's two convs as views of fused_conv2d ops (type and
    attrs: what fused_conv2d's kernels read)."""
    return tuple(SimpleNamespace(type="fused_conv2d", attrs=a) for a in part_attrs(op.attrs))


def forward(x, dw_filter, w, g, threads, dw_bias=None, dw_relu=False, bias=None,
            residual=None, relu=False):
    """out (N, O, Ho, Wo) float32 = the 1x1 conv with w (O, C m, 1, 1) (+ bias[o])
    (+ residual) (then max(., 0)) of the depthwise conv `g` (conv_im2col.Geometry, C m
    output channels) of x with dw_filter (C m, 1, kh, kw) (+ dw_bias) (then max(., 0)
    where dw_relu), on up to `threads` threads (at most one an image)."""
    def f32(array, shape, name):
        return conv_depthwise._float32(array, shape, name, "conv_separable.forward")
    x = f32(x, (g.n, g.c, g.h, g.w), "x")
    dw_filter = f32(dw_filter, (g.o, 1, g.kh, g.kw), "dw_filter")
    dw_bias = None if dw_bias is None else f32(dw_bias, (g.o,), "dw_bias")
    o = w.shape[0]
    w = f32(w, (o, g.o, 1, 1), "filter")
    bias = None if bias is None else f32(bias, (o,), "bias")
    shape = (g.n, o, g.ho, g.wo)
    residual = None if residual is None else f32(residual, shape, "residual")
    out = np.empty(shape, np.float32)
    if out.size:
        _call(x, dw_filter, dw_bias, w, bias, residual, out, conv_depthwise._dims(g, dw_relu),
              relu, threads)
    return out


def _call(x, dw_filter, dw_bias, w, bias, residual, out, dims, relu, threads):
    p = native.address
    if conv_native._lib().conv_separable_forward(
            p(x), p(dw_filter), p(dw_bias), p(w), p(bias), p(residual), p(out), p(dims),
            out.shape[1], int(bool(relu)), max(1, int(threads))):
        raise MemoryError("conv_separable.forward: the kernel's buffers could not be allocated")


def takes(op, g, x, w, threads):
    """Whether the separable kernel takes this op's convs: NCHW float32, a depthwise conv
    conv_depthwise takes, a 1x1 filter of float32, at least as many images as threads
    (it splits the images; fewer run better as two kernels that split channels)."""
    return (op.attrs["data_layout"] == "NCHW" and conv_depthwise.supports(g, x.dtype)
            and np.dtype(w.dtype) == np.float32 and conv_native.available()
            and g.n >= threads and g.ho * g.wo > 0)


def fused_separable_conv2d_cpu(op, ins, ctx):
    """out = act(conv1x1(act_dw(depthwise(x) + dw_bias)) + bias + residual): the
    separable kernel where it takes the op and measured the faster (choices.py, per
    shape and machine), else fused_conv2d's kernel on each conv in turn."""
    g, threads, options = _options(op, ins, ctx)
    if "separable" not in options:
        return {"out": options["two"]()}
    return {"out": options[_pick(g, ins, threads, options)]()}


def _options(op, ins, ctx):
    """(g, threads, {name: function computing out}): "two" always, "separable" where
    the separable kernel takes the op (takes); g is the depthwise conv's geometry."""
    x, w = ins["x"], ins["filter"]
    depthwise, pointwise = parts(op)
    g = conv2d.cpu_geometry(depthwise, x, ins["dw_filter"])
    threads = blocks.get_num_threads()

    def two():
        mid = conv2d.fused_conv2d_cpu(depthwise, {"x": x, "filter": ins["dw_filter"],
                                                  "bias": ins.get("dw_bias")}, ctx)["out"]
        return conv2d.fused_conv2d_cpu(pointwise, {"x": mid, "filter": w,
                                                   "bias": ins.get("bias"),
                                                   "residual": ins.get("residual")}, ctx)["out"]
    options = {"two": two}
    if takes(op, g, x, w, threads):
        options["separable"] = lambda: forward(
            x, ins["dw_filter"], w, g, threads, ins.get("dw_bias"),
            op.attrs["dw_activation"] == "relu", ins.get("bias"), ins.get("residual"),
            op.attrs["activation"] == "relu")
    return g, threads, options


def _pick(g, ins, threads, options):
    """The option chosen for these shapes on this machine (choices.pick; the separable
    kernel untimed where the two convs make fewer than conv2d.MIN_CHOICE_WORK
    multiply-adds)."""
    o = ins["filter"].shape[0]
    if g.n * g.ho * g.wo * g.o * (g.kh * g.kw + o) < conv2d.MIN_CHOICE_WORK:
        return "separable"
    present = "|".join(s for s in ("dw_bias", "bias", "residual") if ins.get(s) is not None)
    key = (f"{g.n}x{g.c}x{g.h}x{g.w}|{g.o}x{g.kh}x{g.kw}|s{g.sh}x{g.sw}|p{g.ph}x{g.pw}"
           f"|d{g.dh}x{g.dw}|{o}|{present}|t{threads}"
           f"|b{native.build_key('conv_native')}|{native.build_key('conv_depthwise')}")
    return choices.pick("fused_separable_conv2d", key, options, "separable")


def bind_fused_separable_conv2d(op):
    """fused_separable_conv2d_cpu's bound form (minigraph.bound_run): the separable
    kernel into the same output array every run, prepared again only when a filter or
    bias is another array, x or the residual of another shape, or the thread count
    changed. None (the kernel runs) where the separable kernel does not take the op or
    was not chosen, or an array is not C-contiguous float32."""
    kept = {"arrays": None, "call": None, "out": None}
    weights = ("dw_filter", "dw_bias", "filter", "bias")

    def prepare(ins):
        x, w = ins["x"], ins["filter"]
        arrays = [x, ins.get("residual")] + [ins.get(s) for s in weights]
        if not all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous)
                   for a in arrays):
            return None
        g, threads, options = _options(op, ins, None)
        if "separable" not in options or _pick(g, ins, threads, options) != "separable":
            return None
        out = prepared.output(kept, (g.n, w.shape[0], g.ho, g.wo), np.float32)
        dims = conv_depthwise._dims(g, op.attrs["dw_activation"] == "relu")
        relu = op.attrs["activation"] == "relu"
        dw_filter, dw_bias, bias = ins["dw_filter"], ins.get("dw_bias"), ins.get("bias")

        def call(x, residual):
            _call(x, dw_filter, dw_bias, w, bias, residual, out, dims, relu, threads)
        return call

    def run(ins):
        threads = blocks.get_num_threads()
        now = (ins["x"], ins.get("residual"), *(ins.get(s) for s in weights), threads)
        held = kept["arrays"]
        if (held is None or any(a is not b for a, b in zip(now[2:6], held[2:6]))
                or threads != held[6] or not conv2d._like(now[0], held[0])
                or not conv2d._like(now[1], held[1])):
            kept["arrays"], kept["call"] = now, prepare(ins)
        if kept["call"] is None:
            return None
        kept["call"](now[0], now[1])
        return {"out": kept["out"]}
    return run
