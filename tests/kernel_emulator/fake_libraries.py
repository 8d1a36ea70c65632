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
- cuDNN (fake_cudnn.py): descriptors exist, are set and agree with each other (else
  BAD_PARAM); each algorithm needs its own workspace (`WORKSPACE`: a null pointer or
  fewer bytes is BAD_PARAM); the Find functions return every algorithm with made-up
  times, the fastest non-deterministic; the fused call is NOT_SUPPORTED for float64
  (a stand-in for the shapes cuDNN does not fuse);
- every call is recorded in `calls` as (function, stream handle of the handle, context).
"""
from __future__ import annotations

import contextlib

import numpy as np

from minigraph.kernels.cuda import cublas, libraries

from .fake_cudnn import fake_cudnn
from .fake_library_base import DTYPES, FakeLibrary, host, tf32, write_out

CUBLAS_STATUS = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED",
                 7: "CUBLAS_STATUS_INVALID_VALUE", 13: "CUBLAS_STATUS_EXECUTION_FAILED",
                 15: "CUBLAS_STATUS_NOT_SUPPORTED"}


class FakeCublas(FakeLibrary):
    """The cuBLAS functions of kernels/cuda/cublas.py's PROTOTYPES (see the module doc)."""

    def cublasCreate_v2(self, out):
        value = next(self._next)
        self.handles[value] = {"context": self.context(), "stream": None, "workspace": None}
        write_out(out, value)
        return 0

    def cublasDestroy_v2(self, value):
        if self._handle(value) is None:
            return 1
        del self.handles[value]
        return 0

    def cublasGetVersion_v2(self, value, out):
        write_out(out, 130000)
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


def fake_cublas(context=None):
    """(FakeCublas, its Library)."""
    fake = FakeCublas(context)
    return fake, fake.library("cublas", cublas.PROTOTYPES, cublas.C_TYPES, CUBLAS_STATUS,
                              "fake cuBLAS")


@contextlib.contextmanager
def installed(cublas_on=True, cudnn_on=True, context=None):
    """Both stand-ins (or None for those off: the library is missing) in use for the
    block; yields (FakeCublas or None, FakeCudnn or None)."""
    fb, lb = fake_cublas(context) if cublas_on else (None, None)
    fd, ld = fake_cudnn(context) if cudnn_on else (None, None)
    with libraries.use("cublas", lb), libraries.use("cudnn", ld):
        yield fb, fd
