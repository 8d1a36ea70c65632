"""Stand-ins for cuBLAS and cuDNN, as strict as the real libraries, for machines with no
GPU: `fake_cublas()` / `fake_cudnn()` return a minigraph.kernels.cuda.libraries.Library
whose functions take the arguments the real ones take (each converted through the
declared ctypes argument types first, so a wrong type fails as ctypes would) and
compute on the emulator's host memory with numpy. `installed(...)` puts them in for a
block (libraries.use). What they check, returning the library's status code:

- a handle works only in the context it was made in (`context()`: the device current
  on this thread, or the fake driver's current context), and only until destroyed;
- cuBLAS: a workspace must have been set (cublasSetWorkspace, 256-byte aligned:
  minigraph's contract - without one cuBLAS allocates its own, which a CUDA graph
  capture forbids); leading dimensions at least the rows (else INVALID_VALUE);
  compute types CUBLAS_COMPUTE_32F / _64F / _32F_FAST_TF32 only (TF32 rounds the
  operands to 10 mantissa bits, as tensor cores do);
- cuDNN: descriptors exist, are set and agree with each other (else BAD_PARAM); each
  algorithm needs its own workspace (`WORKSPACE`: a null pointer or fewer bytes is
  BAD_PARAM); the Find functions return every algorithm with made-up times, the
  fastest non-deterministic; the fused call is NOT_SUPPORTED for float64 (a stand-in
  for the shapes cuDNN does not fuse);
- every call is recorded in `calls` as (function, stream handle of the handle, context).
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np
from references import conv2d as conv_ref
from references import conv2d_grad as conv_grad_ref

from minigraph import device
from minigraph.kernels.cuda import cublas, cudnn_api, libraries

CUBLAS_STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED",
                 7: "CUBLAS_STATUS_INVALID_VALUE", 13: "CUBLAS_STATUS_EXECUTION_FAILED",
                 15: "CUBLAS_STATUS_NOT_SUPPORTED"}
CUDNN_STATUS = {0: "CUDNN_STATUS_SUCCESS", 1000: "CUDNN_STATUS_NOT_INITIALIZED",
                2000: "CUDNN_STATUS_BAD_PARAM", 3000: "CUDNN_STATUS_NOT_SUPPORTED",
                5000: "CUDNN_STATUS_EXECUTION_FAILED"}
WORKSPACE = {0: 0, 1: 1024, 2: 4096}          # cuDNN algorithm -> the workspace bytes it needs
TIMES = {0: 3.0, 1: 1.0, 2: 2.0}              # ms: algorithm 1 fastest but non-deterministic
DTYPES = {0: np.float32, 1: np.float64}


def default_context():
    """The device current on this thread (minigraph's notion; the emulator has no driver)."""
    return device.current().key


def _typed(name, fn, argtypes):
    """fn wrapped to convert its arguments through the declared ctypes types first."""
    def call(*args):
        if len(args) != len(argtypes):
            raise TypeError(f"{name}: {len(argtypes)} arguments expected, got {len(args)}")
        for i, (t, a) in enumerate(zip(argtypes, args)):
            try:
                t.from_param(a)
            except TypeError as e:
                raise ctypes.ArgumentError(f"{name}: argument {i + 1}: {e}") from None
        return fn(*args)
    call.__name__ = name
    return call


def _out(ref, value):
    """Write `value` where a byref()/pointer argument points."""
    target = getattr(ref, "_obj", ref)
    if isinstance(target, ctypes._Pointer):
        target = target.contents
    target.value = value


def host(pointer, dtype, count):
    """A numpy view of `count` values of `dtype` at host address `pointer`."""
    if count <= 0:
        return np.zeros(0, dtype)
    return np.ctypeslib.as_array((np.ctypeslib.as_ctypes_type(dtype) * count).from_address(
        int(pointer)))


def tf32(a):
    """float32 values rounded to TF32 (10 explicit mantissa bits, round to nearest)."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return bits.view(np.float32)


class _Base:
    def __init__(self, context):
        self.context = context or default_context
        self.calls = []
        self.handles = {}           # handle value -> {"context", "stream", "workspace"}
        self._next = iter(range(0x1000, 1 << 40, 0x100))

    def _handle(self, value):
        h = self.handles.get(value)
        if h is None or h["context"] != self.context():
            return None
        return h

    def _record(self, name, value):
        h = self.handles.get(value) or {}
        self.calls.append((name, h.get("stream"), h.get("context")))

    def library(self, name, prototypes, c_types, status_names, version):
        functions = {}
        for fname, (_, params) in prototypes.items():
            impl = getattr(self, fname)
            functions[fname] = _typed(fname, impl, [c_types[p] for p in params])
        lib = libraries.Library(name, self, f"fake {name}", 13, version, None, functions)
        lib.status_string = lambda code: status_names.get(int(code), f"status {int(code)}")
        return lib


class FakeCublas(_Base):
    """The cuBLAS functions of kernels/cuda/cublas.py's PROTOTYPES (see the module doc)."""

    def cublasCreate_v2(self, out):
        value = next(self._next)
        self.handles[value] = {"context": self.context(), "stream": None, "workspace": None}
        _out(out, value)
        return 0

    def cublasDestroy_v2(self, value):
        if self._handle(value) is None:
            return 1
        del self.handles[value]
        return 0

    def cublasGetVersion_v2(self, value, out):
        _out(out, 130000)
        return 0 if self._handle(value) else 1

    def cublasSetStream_v2(self, value, stream):
        h = self._handle(value)
        if h is None:
            return 1
        h["stream"] = int(stream or 0)
        return 0

    def cublasSetWorkspace_v2(self, value, pointer, nbytes):
        h = self._handle(value)
        if h is None:
            return 1
        if nbytes and (not pointer or int(pointer) % 256):
            return 7
        h["workspace"] = (int(pointer or 0), int(nbytes))
        return 0

    def cublasSetMathMode(self, value, mode):
        return 0 if self._handle(value) else 1

    def cublasGetStatusString(self, code):
        return CUBLAS_STATUS.get(int(code), "unknown").encode()

    def cublasGemmEx_64(self, value, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c,
                        ct, ldc, compute, algo):
        return self.cublasGemmStridedBatchedEx_64(value, ta, tb, m, n, k, alpha, a, at, lda, 0,
                                                  b, bt, ldb, 0, beta, c, ct, ldc, 0, 1, compute,
                                                  algo, name="cublasGemmEx_64")

    def cublasGemmStridedBatchedEx_64(self, value, ta, tb, m, n, k, alpha, a, at, lda, sa, b,
                                      bt, ldb, sb, beta, c, ct, ldc, sc, count, compute, algo,
                                      name="cublasGemmStridedBatchedEx_64"):
        h = self._handle(value)
        self._record(name, value)
        if h is None:
            return 1
        if h["workspace"] is None:
            return 13
        if not (at == bt == ct) or at not in DTYPES or compute not in (68, 70, 77):
            return 15
        dtype = np.dtype(DTYPES[at])
        if (compute == 70) != (dtype == np.float64) or (compute == 77 and dtype != np.float32):
            return 15
        rows_a, cols_a = (m, k) if ta == 0 else (k, m)
        rows_b, cols_b = (k, n) if tb == 0 else (n, k)
        if min(m, n, k) < 0 or count < 1 or lda < max(1, rows_a) or ldb < max(1, rows_b) or \
                ldc < max(1, m):
            return 7
        scalar = np.float64 if dtype == np.float64 else np.float32
        alpha_v = host(alpha, scalar, 1)[0]
        beta_v = host(beta, scalar, 1)[0]
        for z in range(int(count)):
            A = self._matrix(a, dtype, rows_a, cols_a, lda, z * sa)
            B = self._matrix(b, dtype, rows_b, cols_b, ldb, z * sb)
            C = self._matrix(c, dtype, m, n, ldc, z * sc)
            A = A if ta == 0 else A.T
            B = B if tb == 0 else B.T
            if compute == 77:
                A, B = tf32(A), tf32(B)
            prod = (A.astype(np.float64) @ B.astype(np.float64)) if k else np.zeros((m, n))
            old = C.astype(np.float64) if beta_v else 0.0
            C[...] = (float(alpha_v) * prod + float(beta_v) * old).astype(dtype)
        return 0

    @staticmethod
    def _matrix(pointer, dtype, rows, cols, ld, offset):
        """The column-major rows x cols matrix at pointer + offset elements (a view)."""
        if rows == 0 or cols == 0:
            return np.zeros((rows, cols), dtype)
        span = (rows - 1) + (cols - 1) * ld + 1
        base = host(int(pointer) + offset * dtype.itemsize, dtype, span)
        return np.lib.stride_tricks.as_strided(base, (rows, cols),
                                               (dtype.itemsize, ld * dtype.itemsize))


class FakeCudnn(_Base):
    """The cuDNN functions of kernels/cuda/cudnn_api.py's PROTOTYPES (see the module doc)."""

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
        _out(out, value)
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
        _out(out, value)
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
        _out(returned, len(results))
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


def fake_cublas(context=None):
    """(FakeCublas, its Library)."""
    fake = FakeCublas(context)
    return fake, fake.library("cublas", cublas.PROTOTYPES, cublas.C_TYPES, CUBLAS_STATUS,
                              "fake cuBLAS")


def fake_cudnn(context=None):
    """(FakeCudnn, its Library)."""
    fake = FakeCudnn(context)
    return fake, fake.library("cudnn", cudnn_api.PROTOTYPES, cudnn_api.C_TYPES, CUDNN_STATUS,
                              "fake cuDNN 9.28.1")


@contextlib.contextmanager
def installed(cublas_on=True, cudnn_on=True, context=None):
    """Both stand-ins (or None for those off: the library is missing) in use for the
    block; yields (FakeCublas or None, FakeCudnn or None)."""
    fb, lb = fake_cublas(context) if cublas_on else (None, None)
    fd, ld = fake_cudnn(context) if cudnn_on else (None, None)
    with libraries.use("cublas", lb), libraries.use("cudnn", ld):
        yield fb, fd
