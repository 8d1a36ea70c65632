"""cuDNN through ctypes: conv2d forward, backward-data and backward-filter, and
fused_conv2d's bias + residual + relu fused into the convolution, when the library
loads (kernels/cuda/libraries.py finds it); `forward`, `backward` and
`fused_forward` return None where cuDNN is not used, and kernels/cuda/conv2d.py then
runs its im2col path.

cuDNN 9's legacy convolution API: descriptors per geometry (NCHW, groups,
dilation), made once per shape and device (`_plan`), with the algorithm of each
pass chosen once per shape BY MEASUREMENT (cudnnFind*AlgorithmEx, as PyTorch's
cudnn.benchmark): the fastest deterministic one (results never depend on timing;
the fastest of any kind only where none is deterministic) that fits
FIND_WORKSPACE_BYTES. The search runs on the first call with a new shape (it
synchronises; a CUDA graph capture never sees it: captures come after a step
that ran); every call then works in one workspace per device and thread, grown as
the chosen algorithms need (`_workspace`). Math: float32 with FMA math
only (no TF32) unless minigraph.device.set_tf32(True) (tensor-op math); float64 as
it is. A tensor of 2**31 elements or more runs in chunks of images that fit the
API's int sizes. The C interface (prototypes, structs, enums, loading) is
kernels/cuda/cudnn_api.py.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph import device
from minigraph.kernels.cuda import launch, libraries, loader
from minigraph.kernels.cuda.cudnn_api import (
    ALGO_COUNTS,
    CROSS_CORRELATION,
    DATA,
    DEFAULT_MATH,
    DETERMINISTIC,
    FIND_WORKSPACE_BYTES,
    FMA_MATH,
    MAX_ELEMENTS,
    NCHW,
    NOT_PROPAGATE_NAN,
    NOT_SUPPORTED,
    RELU,
    TENSOR_OP_MATH,
    AlgoPerf,
    library,
)


class Handle:
    """A cuDNN handle of one device context, on its stream."""

    def __init__(self, lib, state):
        self.lib = lib
        made = ctypes.c_void_p()
        lib.call("cuDNN", "cudnnCreate", ctypes.byref(made))
        self.value = made.value
        lib.call("cuDNN", "cudnnSetStream", self.value, state.stream_handle)

    def close(self):
        if self.value is not None:
            value, self.value = self.value, None
            self.lib.call("cuDNN", "cudnnDestroy", value)


def handle():
    """The current device's cuDNN Handle, or None where cuDNN is not loaded."""
    def make(state):
        lib = library()
        return None if lib is None else Handle(lib, state)
    return libraries.handle_of("cudnn", make)


class Descriptor:
    """A cuDNN descriptor made by `create`, set by `setter(value, *args)`, destroyed
    with the object."""

    def __init__(self, lib, what, kind, *args):
        self.lib, self.kind = lib, kind
        made = ctypes.c_void_p()
        lib.call(what, f"cudnnCreate{kind}Descriptor", ctypes.byref(made))
        self.value = made.value
        setter = {"Tensor": "cudnnSetTensor4dDescriptor", "Filter": "cudnnSetFilter4dDescriptor",
                  "Convolution": "cudnnSetConvolution2dDescriptor",
                  "Activation": "cudnnSetActivationDescriptor"}[kind]
        lib.call(what, setter, self.value, *args)

    def __del__(self):
        try:
            self.lib.fn(f"cudnnDestroy{self.kind}Descriptor")(self.value)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Plan:
    """One geometry's descriptors per chunk size of images, and the algorithm chosen for
    each pass (found on first use)."""

    def __init__(self, h, x, w, g, what):
        lib, dtype = h.lib, np.dtype(x.dtype)
        data = DATA[dtype]
        self.h, self.lib, self.what, self.dtype = h, lib, what, dtype
        self.g = g
        per_image = max(g["C"] * g["H"] * g["W"], g["O"] * g["HW"])
        self.step = max(1, min(g["N"], MAX_ELEMENTS // per_image))
        self.chunks = [(n0, min(self.step, g["N"] - n0)) for n0 in range(0, g["N"], self.step)]
        self.filter = Descriptor(lib, what, "Filter", data, NCHW, g["O"], g["C"] // g["G"],
                                 g["kh"], g["kw"])
        self.conv = Descriptor(lib, what, "Convolution", g["ph"], g["pw"], g["sh"], g["sw"],
                               g["dh"], g["dw"], CROSS_CORRELATION, data)
        lib.call(what, "cudnnSetConvolutionGroupCount", self.conv.value, g["G"])
        math = DEFAULT_MATH if dtype == np.float64 else (
            TENSOR_OP_MATH if device.tf32_enabled() else FMA_MATH)
        lib.call(what, "cudnnSetConvolutionMathType", self.conv.value, math)
        self.tensors = {n: (Descriptor(lib, what, "Tensor", NCHW, data, n, g["C"], g["H"],
                                       g["W"]),
                            Descriptor(lib, what, "Tensor", NCHW, data, n, g["O"], g["Ho"],
                                       g["Wo"]))
                        for n in {count for _, count in self.chunks}}
        self.bias = Descriptor(lib, what, "Tensor", NCHW, data, 1, g["O"], 1, 1)
        self.relu = None
        self.algos = {}             # pass -> (algo, workspace bytes), or None: unsupported
        self.fused = None           # None: not tried; False: cuDNN does not fuse this shape
        scalar = ctypes.c_double if dtype == np.float64 else ctypes.c_float
        self.one, self.zero = scalar(1.0), scalar(0.0)

    def ptr(self, value):
        return ctypes.addressof(value)

    def algo(self, kind, count, head):
        """(algo, workspace bytes) of pass `kind` on chunks of `count` images, measured
        on first use: its cudnnFind*AlgorithmEx called with `head` (the handle, the
        descriptors and the buffers it runs on), then its last five arguments."""
        key = (kind, count)
        if key not in self.algos:
            self.algos[key] = self._find(kind, head)
        return self.algos[key]

    def _find(self, kind, head):
        count = ALGO_COUNTS[kind]
        perf = (AlgoPerf * count)()
        got = ctypes.c_int(0)
        ws = loader.empty((FIND_WORKSPACE_BYTES,), np.uint8)
        name = {"forward": "cudnnFindConvolutionForwardAlgorithmEx",
                "backward_data": "cudnnFindConvolutionBackwardDataAlgorithmEx",
                "backward_filter": "cudnnFindConvolutionBackwardFilterAlgorithmEx"}[kind]
        code = self.lib.fn(name)(*head, count, ctypes.byref(got), perf, int(ws.gpudata),
                                 FIND_WORKSPACE_BYTES)
        del ws
        if NOT_SUPPORTED <= code < NOT_SUPPORTED + 1000:
            return None
        if code:
            raise device.GPUError(f"{self.what}: {name} failed with "
                                  f"{self.lib.status_string(code)} (status {code}, "
                                  f"{self.lib.version})")
        ok = [p for p in perf[:got.value] if p.status == 0 and p.memory <= FIND_WORKSPACE_BYTES]
        if not ok:
            return None
        best = next((p for p in ok if p.determinism == DETERMINISTIC), ok[0])
        return int(best.algo), int(best.memory)


def _geometry(x, w, strides, paddings, dilations, groups):
    from minigraph.kernels.cuda.conv2d import geometry

    return geometry(x.shape, w.shape, strides, paddings, dilations, groups)


def plan_for(kind, x, w, strides, paddings, dilations, groups):
    """The Plan of this geometry on the current device, or None where cuDNN is not
    used (not loaded, or a dtype it does not take here)."""
    if np.dtype(x.dtype) not in DATA or np.dtype(w.dtype) != np.dtype(x.dtype):
        return None
    h = handle()
    if h is None:
        return None
    plans = loader.cached("cudnn.plans", dict)
    key = (tuple(x.shape), tuple(w.shape), np.dtype(x.dtype), str(strides), str(paddings),
           str(dilations), groups, libraries.plan_key())
    found = plans.get(key)
    if found is None:
        g = _geometry(x, w, strides, paddings, dilations, groups)
        launch.check_array(f"{kind}: filter", w, w.shape, x.dtype)
        found = loader.cache_put(plans, key, Plan(h, x, w, g, kind))
    return found


def _workspace(nbytes):
    """The address of room for `nbytes` (0 for none): the device's cuDNN workspace for
    this thread (loader.scratch's buffer of owner "cudnn"), so that every call shares
    one (in a CUDA graph too: a graph holds one workspace, not one for each size of
    workspace)."""
    return loader.scratch(nbytes, np.uint8, owner="cudnn") if nbytes else 0


def _check(plan, name, code):
    if code:
        raise device.GPUError(f"{plan.what}: {name} failed with {plan.lib.status_string(code)} "
                              f"(status {code}, {plan.lib.version})")


def forward(x, w, strides=1, paddings=0, dilations=1, groups=1, out=None):
    """conv2d's output through cuDNN (a new array unless `out`), or None where cuDNN
    is not used for it."""
    plan = plan_for("conv2d", x, w, strides, paddings, dilations, groups)
    if plan is None:
        return None
    g = plan.g
    shape = (g["N"], g["O"], g["Ho"], g["Wo"])
    if out is None:
        out = loader.empty(shape, x.dtype)
    else:
        launch.check_array("conv2d: out", out, shape, x.dtype)
    xp, wp, op = loader.ptr(x, "conv2d: x"), loader.ptr(w, "conv2d: filter"), loader.address(out)
    fn = plan.lib.fn("cudnnConvolutionForward")
    item = plan.dtype.itemsize
    for n0, count in plan.chunks:
        xd, yd = plan.tensors[count]
        xs, ys = xp + n0 * g["C"] * g["H"] * g["W"] * item, op + n0 * g["O"] * g["HW"] * item
        found = plan.algo("forward", count, (plan.h.value, xd.value, xs, plan.filter.value, wp,
                                             plan.conv.value, yd.value, ys))
        if found is None:
            return None
        algo, size = found
        wsp = _workspace(size)
        _check(plan, "cudnnConvolutionForward", fn(
            plan.h.value, plan.ptr(plan.one), xd.value, xs, plan.filter.value, wp,
            plan.conv.value, algo, wsp, size, plan.ptr(plan.zero), yd.value, ys))
    return out


def fused_forward(x, w, bias, residual, relu, strides=1, paddings=0, dilations=1, groups=1):
    """act(conv2d(x, w) + bias + residual) in one cuDNN call
    (cudnnConvolutionBiasActivationForward: relu with a bias, the residual optional),
    or None where cuDNN does not do it (then the caller convolves and runs one
    epilogue)."""
    if not relu or bias is None:
        return None
    plan = plan_for("fused_conv2d", x, w, strides, paddings, dilations, groups)
    if plan is None or plan.fused is False or len(plan.chunks) > 1:
        return None
    g = plan.g
    shape = (g["N"], g["O"], g["Ho"], g["Wo"])
    if residual is not None:
        launch.check_array("fused_conv2d: residual", residual, shape, x.dtype)
    out = loader.empty(shape, x.dtype)
    xp, wp, op = loader.ptr(x, "fused_conv2d: x"), loader.ptr(w, "fused_conv2d: filter"), \
        loader.address(out)
    xd, yd = plan.tensors[g["N"]]
    found = plan.algo("forward", g["N"], (plan.h.value, xd.value, xp, plan.filter.value, wp,
                                          plan.conv.value, yd.value, op))
    if found is None:
        plan.fused = False
        return None
    if plan.relu is None:
        plan.relu = Descriptor(plan.lib, "fused_conv2d", "Activation", RELU, NOT_PROPAGATE_NAN,
                               0.0)
    algo, size = found
    wsp = _workspace(size)
    z = loader.ptr(residual, "fused_conv2d: residual") if residual is not None else op
    alpha2 = plan.one if residual is not None else plan.zero
    name = "cudnnConvolutionBiasActivationForward"
    code = plan.lib.fn(name)(
        plan.h.value, plan.ptr(plan.one), xd.value, xp, plan.filter.value, wp, plan.conv.value,
        algo, wsp, size, plan.ptr(alpha2), yd.value, z, plan.bias.value,
        loader.ptr(bias, "fused_conv2d: bias"), plan.relu.value, yd.value, op)
    if NOT_SUPPORTED <= code < NOT_SUPPORTED + 1000:
        plan.fused = False
        return None
    _check(plan, name, code)
    plan.fused = True
    return out


def backward(x, w, dout, strides=1, paddings=0, dilations=1, groups=1, need_dx=True,
             need_dfilter=True):
    """(dx, dfilter) of conv2d through cuDNN (None for those not needed), or None
    where cuDNN is not used for this geometry."""
    plan = plan_for("conv2d_grad", x, w, strides, paddings, dilations, groups)
    if plan is None:
        return None
    g = plan.g
    launch.check_array("conv2d_grad: dout", dout, (g["N"], g["O"], g["Ho"], g["Wo"]), x.dtype)
    xp, wp = loader.ptr(x, "conv2d_grad: x"), loader.ptr(w, "conv2d_grad: filter")
    dp = loader.ptr(dout, "conv2d_grad: dout")
    dx = loader.empty(x.shape, x.dtype) if need_dx else None
    dw = loader.empty(w.shape, w.dtype) if need_dfilter else None
    dxp, dwp, item = loader.address(dx), loader.address(dw), plan.dtype.itemsize
    for i, (n0, count) in enumerate(plan.chunks):
        xd, yd = plan.tensors[count]
        xs, ds = xp + n0 * g["C"] * g["H"] * g["W"] * item, dp + n0 * g["O"] * g["HW"] * item
        if dw is not None:
            searched = ("backward_filter", count) not in plan.algos
            trial = loader.empty(w.shape, w.dtype) if searched else None  # the search's output
            found = plan.algo("backward_filter", count, (
                plan.h.value, xd.value, xs, yd.value, ds, plan.conv.value, plan.filter.value,
                loader.address(trial)))
            if found is None:
                return None
            algo, size = found
            wsp = _workspace(size)
            _check(plan, "cudnnConvolutionBackwardFilter", plan.lib.fn(
                "cudnnConvolutionBackwardFilter")(
                plan.h.value, plan.ptr(plan.one), xd.value, xs, yd.value, ds, plan.conv.value,
                algo, wsp, size, plan.ptr(plan.one if i else plan.zero), plan.filter.value, dwp))
        if dx is not None:
            dxs = dxp + n0 * g["C"] * g["H"] * g["W"] * item
            found = plan.algo("backward_data", count, (
                plan.h.value, plan.filter.value, wp, yd.value, ds, plan.conv.value, xd.value,
                dxs))
            if found is None:
                return None
            algo, size = found
            wsp = _workspace(size)
            _check(plan, "cudnnConvolutionBackwardData", plan.lib.fn(
                "cudnnConvolutionBackwardData")(
                plan.h.value, plan.ptr(plan.one), plan.filter.value, wp, yd.value, ds,
                plan.conv.value, algo, wsp, size, plan.ptr(plan.zero), xd.value, dxs))
    return dx, dw
