"""cuBLAS through ctypes: every GPU matrix product when the library loads.

`PROTOTYPES` declares each function used, as the C prototype in cuBLAS's own
header (tests/gpu/test_library_headers.py checks them against cublas_api.h);
the ctypes types follow from `libraries`-independent C_TYPES. The 64-bit
entry points (`cublasGemmEx_64`, `cublasGemmStridedBatchedEx_64`, cuBLAS 12+)
take every dimension, leading dimension and batch count as int64, so no size
needs splitting.

One handle per device context (`handle()`), bound to the device's stream,
with a workspace of WORKSPACE_BYTES from the device's memory pool
(cublasSetWorkspace: without one cuBLAS would allocate its own on first use,
which a CUDA graph capture forbids). Products are float32 (CUBLAS_COMPUTE_32F:
no tensor cores, the CPU's results within float32 rounding) unless
minigraph.device.set_tf32(True) (CUBLAS_COMPUTE_32F_FAST_TF32), or float64.

`gemm_plan` takes minigraph's row-major description of a product (the one
kernels/cuda/matmul.py's hand-written GEMM takes) and returns run(a, b, c): C
row-major is C^T column-major, so each call computes C^T = op(B)^T op(A)^T.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph import device
from minigraph.kernels.cuda import libraries, loader

WORKSPACE_BYTES = 32 << 20      # cuBLAS's recommendation for Hopper (4 MiB elsewhere)
OP_N, OP_T = 0, 1               # cublasOperation_t
CUDA_R_32F, CUDA_R_64F = 0, 1   # cudaDataType (library_types.h)
COMPUTE_32F, COMPUTE_64F, COMPUTE_32F_FAST_TF32 = 68, 70, 77    # cublasComputeType_t
GEMM_DEFAULT = -1               # cublasGemmAlgo_t
ENUMS = {"CUBLAS_OP_N": OP_N, "CUBLAS_OP_T": OP_T, "CUBLAS_COMPUTE_32F": COMPUTE_32F,
         "CUBLAS_COMPUTE_64F": COMPUTE_64F, "CUBLAS_COMPUTE_32F_FAST_TF32": COMPUTE_32F_FAST_TF32,
         "CUBLAS_GEMM_DEFAULT": GEMM_DEFAULT, "CUBLAS_STATUS_SUCCESS": 0}

# C type -> ctypes type, for every type the prototypes below use
C_TYPES = {"cublasStatus_t": ctypes.c_int, "cublasHandle_t": ctypes.c_void_p,
           "cublasHandle_t*": ctypes.POINTER(ctypes.c_void_p), "int*": ctypes.POINTER(ctypes.c_int),
           "cudaStream_t": ctypes.c_void_p, "void*": ctypes.c_void_p,
           "const void*": ctypes.c_void_p, "size_t": ctypes.c_size_t,
           "cublasMath_t": ctypes.c_int, "const char*": ctypes.c_char_p,
           "cublasOperation_t": ctypes.c_int, "int64_t": ctypes.c_int64,
           "long long int": ctypes.c_longlong, "cudaDataType": ctypes.c_int,
           "cublasComputeType_t": ctypes.c_int, "cublasGemmAlgo_t": ctypes.c_int}

_GEMM_HEAD = ["cublasHandle_t", "cublasOperation_t", "cublasOperation_t", "int64_t", "int64_t",
              "int64_t", "const void*"]
PROTOTYPES = {
    "cublasCreate_v2": ("cublasStatus_t", ["cublasHandle_t*"]),
    "cublasDestroy_v2": ("cublasStatus_t", ["cublasHandle_t"]),
    "cublasGetVersion_v2": ("cublasStatus_t", ["cublasHandle_t", "int*"]),
    "cublasSetStream_v2": ("cublasStatus_t", ["cublasHandle_t", "cudaStream_t"]),
    "cublasSetWorkspace_v2": ("cublasStatus_t", ["cublasHandle_t", "void*", "size_t"]),
    "cublasSetMathMode": ("cublasStatus_t", ["cublasHandle_t", "cublasMath_t"]),
    "cublasGetStatusString": ("const char*", ["cublasStatus_t"]),
    "cublasGemmEx_64": ("cublasStatus_t", _GEMM_HEAD + [
        "const void*", "cudaDataType", "int64_t", "const void*", "cudaDataType", "int64_t",
        "const void*", "void*", "cudaDataType", "int64_t", "cublasComputeType_t",
        "cublasGemmAlgo_t"]),
    "cublasGemmStridedBatchedEx_64": ("cublasStatus_t", _GEMM_HEAD + [
        "const void*", "cudaDataType", "int64_t", "long long int", "const void*",
        "cudaDataType", "int64_t", "long long int", "const void*", "void*", "cudaDataType",
        "int64_t", "long long int", "int64_t", "cublasComputeType_t", "cublasGemmAlgo_t"]),
}


def declare(lib):
    """cuBLAS's functions of PROTOTYPES, typed (libraries.declare)."""
    return libraries.declare(lib, PROTOTYPES, C_TYPES)


def _status_string(functions, code):
    text = functions["cublasGetStatusString"](int(code))
    return text.decode() if isinstance(text, bytes) else str(text)


def _version(functions):
    return "cuBLAS"


def library():
    """The loaded cuBLAS (libraries.Library), or None (libraries.why('cublas'))."""
    return libraries.load("cublas", declare, _status_string, _version)


class Handle:
    """A cuBLAS handle of one device context, on its stream, with its workspace."""

    def __init__(self, lib, state):
        self.lib = lib
        made = ctypes.c_void_p()
        lib.call("cuBLAS", "cublasCreate_v2", ctypes.byref(made))
        self.value = made.value
        self.workspace = loader.empty((WORKSPACE_BYTES + 256,), np.uint8)
        start = -(-int(self.workspace.gpudata) // 256) * 256     # cuBLAS wants 256-byte alignment
        version = ctypes.c_int()
        lib.call("cuBLAS", "cublasGetVersion_v2", self.value, ctypes.byref(version))
        lib.version = f"cuBLAS {version.value}"
        lib.call("cuBLAS", "cublasSetStream_v2", self.value, state.stream_handle)
        lib.call("cuBLAS", "cublasSetWorkspace_v2", self.value, start, WORKSPACE_BYTES)

    def close(self):
        if self.value is not None:
            value, self.value = self.value, None
            self.lib.call("cuBLAS", "cublasDestroy_v2", value)


def handle():
    """The current device's cuBLAS Handle, or None where cuBLAS is not loaded."""
    def make(state):
        lib = library()
        return None if lib is None else Handle(lib, state)
    return libraries.handle_of("cublas", make)


def available():
    """Whether products on the current device go through cuBLAS."""
    return handle() is not None


def _batches(inner_count, batches, strides):
    """[(a, b, c offsets in elements, count, (stride a, stride b, stride c))]: the
    strided-batched calls covering `batches` products z = outer * inner_count + inner
    (two-level strides, see matmul.gemm) - one call when one level is trivial, else
    a loop over the smaller level."""
    ao, ai, bo, bi, co, ci = strides
    outer = batches // inner_count
    if inner_count == 1:
        return [((0, 0, 0), batches, (ao, bo, co))]
    if outer == 1:
        return [((0, 0, 0), inner_count, (ai, bi, ci))]
    if outer <= inner_count:
        return [((o * ao, o * bo, o * co), inner_count, (ai, bi, ci)) for o in range(outer)]
    return [((i * ai, i * bi, i * ci), outer, (ao, bo, co)) for i in range(inner_count)]


def gemm_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, beta=False, inner_count=1,
              batches=1, strides=(0, 0, 0, 0, 0, 0), red=1, a_red=0, b_red=0, what="matmul"):
    """run(a, b, c) on device pointers: matmul.gemm's product (same arguments, see
    there; `what` names the op in errors) through cuBLAS on the current device, or
    None when cuBLAS is not used there. A sum over `red` products is `red` calls,
    the later ones with beta 1."""
    h = handle()
    if h is None:
        return None
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        scalar, data, compute = ctypes.c_double, CUDA_R_64F, COMPUTE_64F
    elif dtype == np.float32:
        scalar, data = ctypes.c_float, CUDA_R_32F
        compute = COMPUTE_32F_FAST_TF32 if device.tf32_enabled() else COMPUTE_32F
    else:
        raise TypeError(f"cuBLAS products take float32 or float64, got {dtype}")
    one, zero = scalar(1.0), scalar(0.0)
    itemsize = dtype.itemsize
    # cuBLAS refuses a leading dimension below 1, which an empty operand (k = 0) has;
    # the product is then beta * c, as the BLAS defines it
    lda, ldb, ldc = max(lda, 1), max(ldb, 1), max(ldc, 1)
    op_b, op_a = (OP_T if trans_b else OP_N), (OP_T if trans_a else OP_N)
    calls = []
    for r in range(red):
        first = one if (beta or r > 0) else zero
        for (oa, ob, oc), count, (sa, sb, sc) in _batches(inner_count, batches, strides):
            offsets = ((ob + r * b_red) * itemsize, (oa + r * a_red) * itemsize, oc * itemsize)
            calls.append((offsets, count, (sb, sa, sc), ctypes.addressof(first)))
    lib, value = h.lib, h.value
    alpha = ctypes.addressof(one)
    single, strided = lib.fn("cublasGemmEx_64"), lib.fn("cublasGemmStridedBatchedEx_64")
    status = lib.status_string

    def run(a, b, c):
        for (off_b, off_a, off_c), count, (sb, sa, sc), beta_ptr in calls:
            if count == 1:
                code = single(value, op_b, op_a, n, m, k, alpha, b + off_b, data, ldb,
                              a + off_a, data, lda, beta_ptr, c + off_c, data, ldc, compute,
                              GEMM_DEFAULT)
            else:
                code = strided(value, op_b, op_a, n, m, k, alpha, b + off_b, data, ldb, sb,
                               a + off_a, data, lda, sa, beta_ptr, c + off_c, data, ldc, sc,
                               count, compute, GEMM_DEFAULT)
            if code:
                call = "cublasGemmEx_64" if count == 1 else "cublasGemmStridedBatchedEx_64"
                raise device.GPUError(f"{what} ({m}x{k} @ {k}x{n}): {call} failed with "
                                      f"{status(code)} (status {int(code)}, {lib.version})")
    run.keep = (one, zero)          # the scalars' memory, for as long as the plan lives
    return run
