"""The stand-in for cuDNN (fake_libraries.py says what it checks): FakeCudnn computes
convolutions with the float64 references on the emulator's host memory; each
algorithm needs its own workspace (WORKSPACE) and the Find functions report made-up
times (TIMES), the fastest non-deterministic."""
from __future__ import annotations

import ctypes

import numpy as np
from references import conv2d as conv_ref
from references import conv2d_grad as conv_grad_ref

from minigraph.kernels.cuda import cudnn_api

from .fake_library_base import DTYPES, FakeLibrary, host, write_out

CUDNN_STATUS = {0: "CUDNN_STATUS_SUCCESS", 1000: "CUDNN_STATUS_NOT_INITIALIZED",
                2000: "CUDNN_STATUS_BAD_PARAM", 3000: "CUDNN_STATUS_NOT_SUPPORTED",
                5000: "CUDNN_STATUS_EXECUTION_FAILED"}
WORKSPACE = {0: 0, 1: 1024, 2: 4096}          # cuDNN algorithm -> the workspace bytes it needs
TIMES = {0: 3.0, 1: 1.0, 2: 2.0}              # ms: algorithm 1 fastest but non-deterministic


class FakeCudnn(FakeLibrary):
    """The cuDNN functions of kernels/cuda/cudnn_api.py's PROTOTYPES (fake_libraries.py
    says what they check)."""

    def __init__(self, context=None):
        super().__init__(context)
        self.descriptors = {}           # value -> [kind, settings or None]

    def cudnnGetVersion(self):
        return 92801

    def cudnnGetErrorString(self, code):
        return CUDNN_STATUS.get(int(code), "unknown").encode()

    def cudnnCreate(self, out):
        value = next(self._next)
        self.handles[value] = {"context": self.context(), "stream": None}
        write_out(out, value)
        return 0

    def cudnnDestroy(self, value):
        if self._handle(value) is None:
            return 1000
        del self.handles[value]
        return 0

    def cudnnSetStream(self, value, stream):
        h = self._handle(value)
        if h is None:
            return 1000
        h["stream"] = int(stream or 0)
        return 0

    def __getattr__(self, name):
        for kind in ("Tensor", "Filter", "Convolution", "Activation"):
            if name == f"cudnnCreate{kind}Descriptor":
                return lambda out, kind=kind: self._create(kind, out)
            if name == f"cudnnDestroy{kind}Descriptor":
                return lambda value, kind=kind: self._destroy(kind, value)
        raise AttributeError(name)

    def _create(self, kind, out):
        value = next(self._next)
        self.descriptors[value] = [kind, None]
        write_out(out, value)
        return 0

    def _destroy(self, kind, value):
        found = self.descriptors.get(value)
        if found is None or found[0] != kind:
            return 2000
        del self.descriptors[value]
        return 0

    def _set(self, kind, value, settings):
        found = self.descriptors.get(value)
        if found is None or found[0] != kind:
            return 2000
        found[1] = settings
        return 0

    def _get(self, kind, value):
        found = self.descriptors.get(value)
        return found[1] if found is not None and found[0] == kind else None

    def cudnnSetTensor4dDescriptor(self, value, fmt, data, n, c, h, w):
        if fmt != 0 or data not in DTYPES or min(n, c, h, w) <= 0:
            return 2000
        return self._set("Tensor", value, (DTYPES[data], (n, c, h, w)))

    def cudnnSetFilter4dDescriptor(self, value, data, fmt, k, c, h, w):
        if fmt != 0 or data not in DTYPES or min(k, c, h, w) <= 0:
            return 2000
        return self._set("Filter", value, (DTYPES[data], (k, c, h, w)))

    def cudnnSetConvolution2dDescriptor(self, value, ph, pw, sh, sw, dh, dw, mode, data):
        if mode != 1 or min(sh, sw, dh, dw) <= 0 or min(ph, pw) < 0:
            return 2000
        return self._set("Convolution", value, {"pad": (ph, pw), "stride": (sh, sw),
                                                "dil": (dh, dw), "groups": 1, "math": 0,
                                                "data": DTYPES.get(data)})

    def cudnnSetConvolutionGroupCount(self, value, groups):
        conv = self._get("Convolution", value)
        if conv is None or groups < 1:
            return 2000
        conv["groups"] = groups
        return 0

    def cudnnSetConvolutionMathType(self, value, math):
        conv = self._get("Convolution", value)
        if conv is None or math not in (0, 1, 2, 3):
            return 2000
        conv["math"] = math
        return 0

    def cudnnSetActivationDescriptor(self, value, mode, nan, coef):
        return self._set("Activation", value, (mode, nan, coef)) if mode == 1 else 2000

    # ---- the convolutions ---------------------------------------------------------------
    def _geometry(self, x, w, conv, y):
        """(x dtype and shape, w shape, conv settings, y shape) checked, or None."""
        xs, ws, cs, ys = (self._get("Tensor", x), self._get("Filter", w),
                          self._get("Convolution", conv), self._get("Tensor", y))
        if None in (xs, ws, cs, ys) or not (xs[0] == ws[0] == ys[0] == cs["data"]):
            return None
        (n, c, h, wd), (o, cg, kh, kw), (yn, yc, yh, yw) = xs[1], ws[1], ys[1]
        (ph, pw), (sh, sw), (dh, dw) = cs["pad"], cs["stride"], cs["dil"]
        ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        wo = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        if c != cg * cs["groups"] or o % cs["groups"] or (yn, yc, yh, yw) != (n, o, ho, wo):
            return None
        return np.dtype(xs[0]), xs[1], ws[1], cs, ys[1]

    def _start(self, name, value, algo, ws, size):
        h = self._handle(value)
        self._record(name, value)
        if h is None:
            return 1000
        if algo not in WORKSPACE or size < WORKSPACE[algo] or (WORKSPACE[algo] and not ws):
            return 2000
        return 0

    @staticmethod
    def _args(cs):
        return cs["stride"], cs["pad"], cs["dil"], cs["groups"]

    @staticmethod
    def _read(pointer, dtype, shape):
        return host(pointer, dtype, int(np.prod(shape))).reshape(shape)

    def _forward(self, x, xp, w, wp, conv, y):
        g = self._geometry(x, w, conv, y)
        if g is None:
            return None, None
        dtype, xs, ws, cs, ys = g
        out = conv_ref(self._read(xp, dtype, xs).astype(np.float64),
                       self._read(wp, dtype, ws).astype(np.float64), *self._args(cs))
        return out, (dtype, ys)

    def cudnnConvolutionForward(self, value, alpha, x, xp, w, wp, conv, algo, ws, size, beta, y,
                                yp):
        code = self._start("cudnnConvolutionForward", value, algo, ws, size)
        if code:
            return code
        out, found = self._forward(x, xp, w, wp, conv, y)
        if out is None:
            return 2000
        self._read(yp, *found)[...] = out
        return 0

    def cudnnConvolutionBiasActivationForward(self, value, alpha1, x, xp, w, wp, conv, algo, ws,
                                              size, alpha2, z, zp, bias, bp, act, y, yp):
        code = self._start("cudnnConvolutionBiasActivationForward", value, algo, ws, size)
        if code:
            return code
        out, found = self._forward(x, xp, w, wp, conv, y)
        if out is None or self._get("Activation", act) is None or not bp or \
                self._get("Tensor", bias) is None or self._get("Tensor", z) is None:
            return 2000
        dtype, ys = found
        if dtype == np.float64:
            return 3000
        scalar = host(alpha2, np.float32, 1)[0]
        out = out + self._read(bp, dtype, (1, ys[1], 1, 1)) + float(scalar) * self._read(
            zp, dtype, ys).astype(np.float64)
        self._read(yp, dtype, ys)[...] = np.maximum(out, 0)
        return 0

    def cudnnConvolutionBackwardData(self, value, alpha, w, wp, dy, dyp, conv, algo, ws, size,
                                     beta, dx, dxp):
        code = self._start("cudnnConvolutionBackwardData", value, algo, ws, size)
        if code:
            return code
        g = self._geometry(dx, w, conv, dy)
        if g is None:
            return 2000
        dtype, xs, wsh, cs, ys = g
        grad, _ = conv_grad_ref(np.zeros(xs), self._read(wp, dtype, wsh).astype(np.float64),
                                self._read(dyp, dtype, ys).astype(np.float64), *self._args(cs))
        self._read(dxp, dtype, xs)[...] = grad
        return 0

    def cudnnConvolutionBackwardFilter(self, value, alpha, x, xp, dy, dyp, conv, algo, ws, size,
                                       beta, dw, dwp):
        code = self._start("cudnnConvolutionBackwardFilter", value, algo, ws, size)
        if code:
            return code
        g = self._geometry(x, dw, conv, dy)
        if g is None:
            return 2000
        dtype, xs, wsh, cs, ys = g
        _, grad = conv_grad_ref(self._read(xp, dtype, xs).astype(np.float64), np.zeros(wsh),
                                self._read(dyp, dtype, ys).astype(np.float64), *self._args(cs))
        target = self._read(dwp, dtype, wsh)
        b = float(host(beta, np.float64 if dtype == np.float64 else np.float32, 1)[0])
        target[...] = grad + (b * target.astype(np.float64) if b else 0.0)
        return 0

    def _find(self, name, value, run, count, returned, perf, ws, size):
        self._record(name, value)
        if self._handle(value) is None:
            return 1000
        results = []
        for algo in sorted(WORKSPACE, key=TIMES.get)[:count]:
            fits = WORKSPACE[algo] <= size
            if fits:
                code = run(algo, ws, size)
                if code:
                    return code
            results.append((algo, 0 if fits else 2000, TIMES[algo], WORKSPACE[algo],
                            0 if algo == 1 else 1))
        for i, (algo, status, time, memory, det) in enumerate(results):
            p = perf._obj[i] if hasattr(perf, "_obj") else perf[i]
            p.algo, p.status, p.time, p.memory, p.determinism = algo, status, time, memory, det
        write_out(returned, len(results))
        return 0

    def cudnnFindConvolutionForwardAlgorithmEx(self, value, x, xp, w, wp, conv, y, yp, count,
                                               returned, perf, ws, size):
        return self._find("cudnnFindConvolutionForwardAlgorithmEx", value, lambda a, p, s:
                          self.cudnnConvolutionForward(value, 0, x, xp, w, wp, conv, a, p, s, 0,
                                                       y, yp), count, returned, perf, ws, size)

    def cudnnFindConvolutionBackwardDataAlgorithmEx(self, value, w, wp, dy, dyp, conv, dx, dxp,
                                                    count, returned, perf, ws, size):
        return self._find("cudnnFindConvolutionBackwardDataAlgorithmEx", value,
                          lambda a, p, s: self.cudnnConvolutionBackwardData(
                              value, 0, w, wp, dy, dyp, conv, a, p, s, 0, dx, dxp),
                          count, returned, perf, ws, size)

    def cudnnFindConvolutionBackwardFilterAlgorithmEx(self, value, x, xp, dy, dyp, conv, dw, dwp,
                                                      count, returned, perf, ws, size):
        zero = ctypes.c_double(0.0)
        return self._find("cudnnFindConvolutionBackwardFilterAlgorithmEx", value,
                          lambda a, p, s: self.cudnnConvolutionBackwardFilter(
                              value, 0, x, xp, dy, dyp, conv, a, p, s, ctypes.addressof(zero),
                              dw, dwp), count, returned, perf, ws, size)


def fake_cudnn(context=None):
    """(FakeCudnn, its Library)."""
    fake = FakeCudnn(context)
    return fake, fake.library("cudnn", cudnn_api.PROTOTYPES, cudnn_api.C_TYPES, CUDNN_STATUS,
                              "fake cuDNN 9.28.1")
