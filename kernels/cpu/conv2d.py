"""CPU kernels of conv2d (ops/conv2d.py): where the native kernels take the conv
(float32, one group, where a C compiler works: conv_native for NCHW, conv_native_nhwc
for NHWC), the fastest on this machine of Winograd's kernel, the direct kernel and
the im2col engine (timed at first use and kept per machine: choices.py); for
depthwise convs (float32, each group one input channel: conv_depthwise, either
layout) the faster of the depthwise kernel and the im2col engine; else
the im2col engine of the
layout (conv_im2col and conv_im2col_grad, conv_im2col_nhwc),
with lean work arrays, or up to the room a training step leaves them
(KernelContext.room, OpSchema.work_room; the room also lets Winograd's kernel
take a conv whose scratch outgrows its output: winograd_bound); and of
fused_conv2d (ops/fused_conv2d.py), whose bias, residual and relu are applied to
each tile or chunk of the convolution's output while it is in cache (and its 2x2 max
pooling by the native NCHW kernels, on each image's outputs in cache; by pool2d's
kernel after the other engines), and whose bound form (bind_fused_conv2d) runs a
checked inference plan's native convs as prepared calls.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cpu import (
    blocks,
    choices,
    conv_depthwise,
    conv_im2col,
    conv_im2col_grad,
    conv_im2col_nhwc,
    conv_native,
    conv_native_nhwc,
    native,
    pool2d,
    prepared,
)
from minigraph.kernels.layout import nchw_sizes

# convs of fewer multiply-adds run their default kernel untimed: timing them would
# cost more than a choice could gain, and their times are mostly noise
MIN_CHOICE_WORK = 1 << 20


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


def depthwise_kernels(layout):
    """(forward, input_grad, filter_grad) of conv_depthwise for `layout` (channels last:
    the *_nhwc entry points); looked up at each call."""
    if layout == "NHWC":
        return (conv_depthwise.forward_nhwc, conv_depthwise.input_grad_nhwc,
                conv_depthwise.filter_grad_nhwc)
    return conv_depthwise.forward, conv_depthwise.input_grad, conv_depthwise.filter_grad


def cpu_geometry(op, x, w):
    """The CPU engine's Geometry of this op on x and filter (either layout)."""
    a = op.attrs
    return conv_im2col.geometry(nchw_sizes(a["data_layout"], x.shape), w.shape, a["strides"],
                                a["paddings"], a["dilations"], a["groups"])


def conv2d_cpu(op, ins, ctx):
    """out[n, o] = sum over the group's channels and taps of filter * window: for a
    depthwise conv (conv_depthwise.supports), the faster of its kernel and the im2col engine; where
    the native kernels take the conv (conv_native, conv_native_nhwc: float32, one group),
    Winograd's kernel (where its scratch memory stays within the output's), the direct
    kernel or the im2col engine, whichever was the fastest for the shape on this
    machine (choose); else the im2col engine. The im2col engine runs with lean work
    arrays, like its gradient's (conv2d is the op training steps run, and their peak
    memory comes from these; fused_conv2d, for inference, takes full chunks), or up
    to `ctx.room` bytes of them (OpSchema.work_room)."""
    x, w = ins["x"], ins["filter"]
    g, run = cpu_geometry(op, x, w), ENGINES[op.attrs["data_layout"]]

    def im2col():
        return run.numpy_forward(x, w, g, lean=True, room=ctx.room)

    threads = blocks.get_num_threads()
    if conv_depthwise.supports(g, x.dtype):
        forward = depthwise_kernels(op.attrs["data_layout"])[0]
        options = {"depthwise": lambda: forward(x, w, g, threads), "im2col": im2col}
        return {"out": choose("conv2d", op, g, threads, options)}
    if not conv_native.supports(g, x.dtype):
        return {"out": im2col()}
    options = {"direct": lambda: run.forward(x, w, g, threads, max_scratch=conv_native.DIRECT),
               "im2col": im2col}
    bound, extra = winograd_bound(conv_native.forward_winograd, g, threads,
                                  None if ctx is None else ctx.room, g.n * g.o * g.ho * g.wo)
    if bound is not None:
        options["winograd"] = lambda: run.forward(x, w, g, threads, max_scratch=bound)
    return {"out": choose("conv2d", op, g, threads, options, extra)}


def winograd_bound(takes, g, threads, room, out_floats):
    """(max_scratch, key extra) for a training conv pass: Winograd's kernel takes it
    (takes(g, threads, max_scratch): conv_native.forward_winograd or
    input_grad_winograd) within the default scratch bound (WINOGRAD_MAX_SCRATCH, ""),
    or within the `room` bytes the step leaves the op (the room over the pass's
    output's bytes, "room": a choice of its own, since more kernels compete), else
    (None, "") and no Winograd.
    A conv of many channels on small images (a ResNet's last stage) needs scratch
    larger than its output: where the step's values are below their peak, it fits."""
    if takes(g, threads):
        return conv_native.WINOGRAD_MAX_SCRATCH, ""
    if room and out_floats:
        bound = room / (4 * out_floats)
        if bound > conv_native.WINOGRAD_MAX_SCRATCH and takes(g, threads, bound):
            return bound, "room"
    return None, ""


def conv2d_grad_cpu(op, ins, ctx):
    """dx and dfilter (each only when bound): for a depthwise conv, _depthwise_grad's;
    where the native kernels take the conv,
    each the fastest on this machine (choose) of the native kernels (dfilter; dx as
    forward passes over dout, one per phase of the stride: Winograd's for a 3x3 conv
    of stride 1, or the direct kernel) and the layout's numpy engine; else that
    engine (NCHW: dx of a stride-1 conv as the conv of dout with the flipped filter,
    dfilter from the same columns, else products with the columns and col2im); lean
    work arrays, or up to `ctx.room` bytes of them."""
    x, w, d = ins["x"], ins["filter"], ins["dout"]
    g, run = cpu_geometry(op, x, w), ENGINES[op.attrs["data_layout"]]
    need_dx, need_dw = op.wants("dx"), op.wants("dfilter")
    if conv_depthwise.supports(g, x.dtype):
        return _depthwise_grad(op, run, x, w, d, g, ctx, need_dx, need_dw)
    if not conv_native.supports(g, x.dtype):
        dx, dw = run.numpy_backward(x, w, d, g, need_dx=need_dx, need_dw=need_dw,
                                    room=ctx.room)
        return present(dx=dx, dfilter=dw)
    threads = blocks.get_num_threads()
    dx = dw = None
    if need_dx:
        options = {"direct": lambda: run.input_grad(w, d, g, threads,
                                                    max_scratch=conv_native.DIRECT),
                   "im2col": lambda: run.numpy_backward(x, w, d, g, need_dx=True,
                                                        need_dw=False, room=ctx.room)[0]}
        bound, extra = winograd_bound(conv_native.input_grad_winograd, g, threads,
                                      None if ctx is None else ctx.room, g.n * g.c * g.h * g.w)
        if bound is not None:
            options["winograd"] = lambda: run.input_grad(w, d, g, threads, max_scratch=bound)
        dx = choose("conv2d_dx", op, g, threads, options, extra)
    if need_dw:
        options = {"direct": lambda: run.filter_grad(x, d, g, threads),
                   "im2col": lambda: run.numpy_backward(x, w, d, g, need_dx=False,
                                                        need_dw=True, room=ctx.room)[1]}
        dw = choose("conv2d_dw", op, g, threads, options)
    return present(dx=dx, dfilter=dw)


def _depthwise_grad(op, run, x, w, d, g, ctx, need_dx, need_dw):
    """conv2d_grad_cpu's outputs for a depthwise conv (conv_depthwise.supports): each the
    faster on this machine of the depthwise kernel and the im2col engine of the layout
    (`run`: its Engines)."""
    threads, dx, dw = blocks.get_num_threads(), None, None
    _, input_grad, filter_grad = depthwise_kernels(op.attrs["data_layout"])

    def numpy(dx, dw):
        return lambda: run.numpy_backward(x, w, d, g, need_dx=dx, need_dw=dw,
                                          room=ctx.room)[int(dw)]
    if need_dx:
        dx = choose("conv2d_dx", op, g, threads,
                    {"depthwise": lambda: input_grad(w, d, g, threads),
                     "im2col": numpy(True, False)})
    if need_dw:
        dw = choose("conv2d_dw", op, g, threads,
                    {"depthwise": lambda: filter_grad(x, d, g, threads),
                     "im2col": numpy(False, True)})
    return present(dx=dx, dfilter=dw)


def fused_conv2d_cpu(op, ins, ctx):
    """out = act(conv2d(x, filter) + bias + residual): as conv2d's kernel (the fastest
    of Winograd's, the direct and the im2col engine where the native kernels take the
    conv; of the depthwise kernel and the im2col engine for a depthwise conv),
    Winograd's with a larger scratch bound than conv2d's and its transform of the
    filter kept (this op runs in inference nets only: no op writes its filter, which
    is made read-only) and the im2col engine with full chunks."""
    x, w = ins["x"], ins["filter"]
    epilogue = {"bias": ins.get("bias"), "residual": ins.get("residual")}
    g, threads, options = _fused_options(op, x, w, epilogue)
    if threads is None:
        return {"out": options["im2col"]()}
    return {"out": choose("fused_conv2d", op, g, threads, options, _extra(op, epilogue))}


def _fused_options(op, x, w, epilogue):
    """(g, threads, options) of fused_conv2d_cpu: threads None where only the im2col
    engine takes the conv."""
    g, layout = cpu_geometry(op, x, w), op.attrs["data_layout"]
    run, relu, pool = ENGINES[layout], op.attrs["activation"] == "relu", _pools(op)
    options = {"im2col": _pooled(lambda: run.numpy_forward(x, w, g, **epilogue, relu=relu),
                                 pool, layout)}
    if conv_depthwise.supports(g, x.dtype):
        threads = blocks.get_num_threads()
        forward = depthwise_kernels(layout)[0]
        options["depthwise"] = _pooled(lambda: forward(
            x, w, g, threads, **epilogue, relu=relu), pool, layout)
        return g, threads, options
    if not conv_native.supports(g, x.dtype):
        return g, None, options
    threads, bound = blocks.get_num_threads(), conv_native.WINOGRAD_MAX_SCRATCH_INFERENCE
    native_pool = {"pool": True} if pool and layout == "NCHW" else {}
    after = pool and not native_pool              # channels last: pool2d's kernel after
    options["direct"] = _pooled(lambda: run.forward(x, w, g, threads, **epilogue, relu=relu,
                                                    max_scratch=conv_native.DIRECT,
                                                    **native_pool), after, layout)
    if conv_native.forward_winograd(g, threads, bound):
        options["winograd"] = _pooled(
            lambda: run.forward(x, w, g, threads, **epilogue, relu=relu, max_scratch=bound,
                                fixed=True, **native_pool), after, layout)
    return g, threads, options


def _pools(op):
    """Whether the fused op max-pools its outputs (attribute pool)."""
    return op.attrs.get("pool") == "max2x2"


def _pooled(compute, pool, layout):
    """compute, or (pool) a function of the max of each 2x2 window at stride 2 of its
    result, as pool2d's kernel takes it."""
    if not pool:
        return compute
    attrs = {"ksize": (2, 2), "strides": (2, 2), "paddings": (0, 0), "data_layout": layout}

    def pooled():
        out = compute()
        return pool2d.window_max(out, attrs, pool2d.out_hw(out.shape, attrs))
    return pooled


def bind_fused_conv2d(op):
    """fused_conv2d_cpu's bound form (minigraph.bound_run) for NCHW: the native kernel
    the op's choice names (Winograd's on the filter's kept transform, the direct kernel,
    pooling its outputs where the op does, or the depthwise kernel where it does not)
    into the same output array every run, its C call prepared again only when
    the filter or bias is another array, x or the residual of another shape or layout,
    the filter was made writeable (its transform is made anew) or the thread count
    changed. None (the kernel runs) where the arrays are not C-contiguous float32 or
    the choice is the im2col engine."""
    if op.attrs["data_layout"] != "NCHW":
        return None
    relu, pool = op.attrs["activation"] == "relu", _pools(op)
    kept = {"arrays": None, "call": None, "out": None}

    def prepare(x, w, bias, residual, threads):
        if not all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous)
                   for a in (x, w, bias, residual)):
            return None
        epilogue = {"bias": bias, "residual": residual}
        g, threads, options = _fused_options(op, x, w, epilogue)
        shape = conv_native.pooled_shape(g) if pool else (g.n, g.o, g.ho, g.wo)
        if threads is None or 0 in shape:
            return None
        name = pick("fused_conv2d", op, g, threads, options, _extra(op, epilogue))
        if name == "im2col" or (name == "depthwise" and pool):
            return None
        out = prepared.output(kept, shape, np.float32)
        if name == "depthwise":
            return conv_depthwise.prepared_forward(w, g, threads, bias, relu, out)
        return conv_native.prepared_forward(w, g, threads, bias, relu, out,
                                            name == "winograd", pool=pool)

    def run(ins):
        threads = blocks.get_num_threads()
        now = (ins["x"], ins["filter"], ins.get("bias"), ins.get("residual"), threads)
        held = kept["arrays"]
        if (held is None or now[1] is not held[1] or now[2] is not held[2]
                or threads != held[4] or not _like(now[0], held[0])
                or not _like(now[3], held[3])
                or (kept["call"] is not None and kept["call"].transform is not None
                    and now[1].flags.writeable)):     # made writeable since its transform
            kept["arrays"], kept["call"] = now, prepare(*now)
        if kept["call"] is None:
            return None
        kept["call"](now[0], now[3])
        return {"out": kept["out"]}
    return run


def _like(x, held):
    """True when the prepared call of a conv on `held` (its x or residual, or None) runs
    on x too: the same array (or None), or a C-contiguous one of its shape and dtype (a
    fed batch: a new array every run)."""
    return x is held or (x is not None and held is not None and x.shape == held.shape
                         and x.dtype == held.dtype and x.flags.c_contiguous
                         and held.flags.c_contiguous)


def _extra(op, epilogue):
    """The epilogue's part of a fused conv's choice key."""
    return "|".join([k for k in ("bias", "residual") if epilogue[k] is not None]
                    + (["pool"] if _pools(op) else []))


def choose(kind, op, g, threads, options, extra=""):
    """The result of the option chosen for this conv on this machine (pick)."""
    return options[pick(kind, op, g, threads, options, extra)]()


def pick(kind, op, g, threads, options, extra=""):
    """The name of the option chosen for this conv on this machine (choices.pick: timed
    at its first use, kept per machine, keyed by the shapes and the native library's
    build; Winograd's where it is an option, else the direct kernel, else the depthwise
    kernel, where nothing is timed or the conv makes fewer than MIN_CHOICE_WORK
    multiply-adds; the option choices.forcing names, where it is one)."""
    default = next(k for k in ("winograd", "direct", "depthwise") if k in options)
    if g.n * g.o * (g.c // g.groups) * g.kh * g.kw * g.ho * g.wo < MIN_CHOICE_WORK:
        return choices.forced(kind, options) or default
    library = "conv_depthwise" if "depthwise" in options else "conv_native"
    key = (f"{op.attrs['data_layout']}|{g.n}x{g.c}x{g.h}x{g.w}|{g.o}x{g.kh}x{g.kw}"
           f"|s{g.sh}x{g.sw}|p{g.ph}x{g.pw}|d{g.dh}x{g.dw}|{extra}|t{threads}"
           f"|b{native.build_key(library)}")
    return choices.pick(kind, key, options, default)
