"""cuDNN's C interface as ctypes sees it: the prototypes minigraph calls (those of
cudnn_graph.h, cudnn_ops.h and cudnn_cnn.h, checked against the wheel's headers by
tests/gpu/test_library_headers.py), the perf-result struct, the enum values used,
and the loaded library (kernels/cuda/libraries.py finds it). kernels/cuda/cudnn.py
makes the calls.
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cuda import libraries

FIND_WORKSPACE_BYTES = 256 << 20
DATA = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}      # cudnnDataType_t
NCHW, CROSS_CORRELATION, RELU, NOT_PROPAGATE_NAN = 0, 1, 1, 0
DEFAULT_MATH, TENSOR_OP_MATH, FMA_MATH = 0, 1, 3
DETERMINISTIC = 1
NOT_SUPPORTED = 3000             # cuDNN 9: 3000-3999 are "not supported" codes
ALGO_COUNTS = {"forward": 8, "backward_data": 6, "backward_filter": 7}
MAX_ELEMENTS = 2**31 - 1
ENUMS = {"CUDNN_DATA_FLOAT": 0, "CUDNN_DATA_DOUBLE": 1, "CUDNN_TENSOR_NCHW": NCHW,
         "CUDNN_CROSS_CORRELATION": CROSS_CORRELATION, "CUDNN_ACTIVATION_RELU": RELU,
         "CUDNN_NOT_PROPAGATE_NAN": NOT_PROPAGATE_NAN, "CUDNN_DEFAULT_MATH": DEFAULT_MATH,
         "CUDNN_TENSOR_OP_MATH": TENSOR_OP_MATH, "CUDNN_FMA_MATH": FMA_MATH,
         "CUDNN_DETERMINISTIC": DETERMINISTIC, "CUDNN_STATUS_SUCCESS": 0,
         "CUDNN_STATUS_NOT_SUPPORTED": NOT_SUPPORTED,
         "CUDNN_CONVOLUTION_FWD_ALGO_COUNT": 8, "CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT": 6,
         "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT": 7}


class AlgoPerf(ctypes.Structure):
    """cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (one layout for all three)."""

    _fields_ = [("algo", ctypes.c_int), ("status", ctypes.c_int), ("time", ctypes.c_float),
                ("memory", ctypes.c_size_t), ("determinism", ctypes.c_int),
                ("mathType", ctypes.c_int), ("reserved", ctypes.c_int * 3)]


PERF_STRUCTS = ("cudnnConvolutionFwdAlgoPerf_t", "cudnnConvolutionBwdDataAlgoPerf_t",
                "cudnnConvolutionBwdFilterAlgoPerf_t")
_VP, _D = ctypes.c_void_p, "const void*"
C_TYPES = {"cudnnStatus_t": ctypes.c_int, "cudnnHandle_t": _VP,
           "cudnnHandle_t*": ctypes.POINTER(_VP), "cudaStream_t": _VP, "size_t": ctypes.c_size_t,
           "const char*": ctypes.c_char_p, "int": ctypes.c_int,
           "int*": ctypes.POINTER(ctypes.c_int),
           "double": ctypes.c_double, "void*": _VP, _D: _VP,
           "cudnnTensorDescriptor_t": _VP, "cudnnTensorDescriptor_t*": ctypes.POINTER(_VP),
           "cudnnFilterDescriptor_t": _VP, "cudnnFilterDescriptor_t*": ctypes.POINTER(_VP),
           "cudnnConvolutionDescriptor_t": _VP,
           "cudnnConvolutionDescriptor_t*": ctypes.POINTER(_VP),
           "cudnnActivationDescriptor_t": _VP, "cudnnActivationDescriptor_t*": ctypes.POINTER(_VP),
           "cudnnTensorFormat_t": ctypes.c_int, "cudnnDataType_t": ctypes.c_int,
           "cudnnConvolutionMode_t": ctypes.c_int, "cudnnMathType_t": ctypes.c_int,
           "cudnnActivationMode_t": ctypes.c_int, "cudnnNanPropagation_t": ctypes.c_int,
           "cudnnConvolutionFwdAlgo_t": ctypes.c_int, "cudnnConvolutionBwdDataAlgo_t": ctypes.c_int,
           "cudnnConvolutionBwdFilterAlgo_t": ctypes.c_int,
           **{f"{s}*": ctypes.POINTER(AlgoPerf) for s in PERF_STRUCTS}}
_T, _F, _C = "const cudnnTensorDescriptor_t", "const cudnnFilterDescriptor_t", \
    "const cudnnConvolutionDescriptor_t"
PROTOTYPES = {
    "cudnnGetVersion": ("size_t", []),
    "cudnnGetErrorString": ("const char*", ["cudnnStatus_t"]),
    "cudnnCreate": ("cudnnStatus_t", ["cudnnHandle_t*"]),
    "cudnnDestroy": ("cudnnStatus_t", ["cudnnHandle_t"]),
    "cudnnSetStream": ("cudnnStatus_t", ["cudnnHandle_t", "cudaStream_t"]),
    "cudnnCreateTensorDescriptor": ("cudnnStatus_t", ["cudnnTensorDescriptor_t*"]),
    "cudnnDestroyTensorDescriptor": ("cudnnStatus_t", ["cudnnTensorDescriptor_t"]),
    "cudnnSetTensor4dDescriptor": ("cudnnStatus_t", [
        "cudnnTensorDescriptor_t", "cudnnTensorFormat_t", "cudnnDataType_t", "int", "int", "int",
        "int"]),
    "cudnnCreateFilterDescriptor": ("cudnnStatus_t", ["cudnnFilterDescriptor_t*"]),
    "cudnnDestroyFilterDescriptor": ("cudnnStatus_t", ["cudnnFilterDescriptor_t"]),
    "cudnnSetFilter4dDescriptor": ("cudnnStatus_t", [
        "cudnnFilterDescriptor_t", "cudnnDataType_t", "cudnnTensorFormat_t", "int", "int", "int",
        "int"]),
    "cudnnCreateConvolutionDescriptor": ("cudnnStatus_t", ["cudnnConvolutionDescriptor_t*"]),
    "cudnnDestroyConvolutionDescriptor": ("cudnnStatus_t", ["cudnnConvolutionDescriptor_t"]),
    "cudnnSetConvolution2dDescriptor": ("cudnnStatus_t", [
        "cudnnConvolutionDescriptor_t", "int", "int", "int", "int", "int", "int",
        "cudnnConvolutionMode_t", "cudnnDataType_t"]),
    "cudnnSetConvolutionGroupCount": ("cudnnStatus_t", ["cudnnConvolutionDescriptor_t", "int"]),
    "cudnnSetConvolutionMathType": ("cudnnStatus_t", ["cudnnConvolutionDescriptor_t",
                                                      "cudnnMathType_t"]),
    "cudnnCreateActivationDescriptor": ("cudnnStatus_t", ["cudnnActivationDescriptor_t*"]),
    "cudnnDestroyActivationDescriptor": ("cudnnStatus_t", ["cudnnActivationDescriptor_t"]),
    "cudnnSetActivationDescriptor": ("cudnnStatus_t", [
        "cudnnActivationDescriptor_t", "cudnnActivationMode_t", "cudnnNanPropagation_t",
        "double"]),
    "cudnnFindConvolutionForwardAlgorithmEx": ("cudnnStatus_t", [
        "cudnnHandle_t", _T, _D, _F, _D, _C, _T, "void*", "const int", "int*",
        "cudnnConvolutionFwdAlgoPerf_t*", "void*", "size_t"]),
    "cudnnFindConvolutionBackwardDataAlgorithmEx": ("cudnnStatus_t", [
        "cudnnHandle_t", _F, _D, _T, _D, _C, _T, "void*", "const int", "int*",
        "cudnnConvolutionBwdDataAlgoPerf_t*", "void*", "size_t"]),
    "cudnnFindConvolutionBackwardFilterAlgorithmEx": ("cudnnStatus_t", [
        "cudnnHandle_t", _T, _D, _T, _D, _C, "const cudnnFilterDescriptor_t", "void*",
        "const int", "int*", "cudnnConvolutionBwdFilterAlgoPerf_t*", "void*", "size_t"]),
    "cudnnConvolutionForward": ("cudnnStatus_t", [
        "cudnnHandle_t", _D, _T, _D, _F, _D, _C, "cudnnConvolutionFwdAlgo_t", "void*", "size_t",
        _D, _T, "void*"]),
    "cudnnConvolutionBiasActivationForward": ("cudnnStatus_t", [
        "cudnnHandle_t", _D, _T, _D, _F, _D, _C, "cudnnConvolutionFwdAlgo_t", "void*", "size_t",
        _D, _T, _D, _T, _D, "const cudnnActivationDescriptor_t", _T, "void*"]),
    "cudnnConvolutionBackwardData": ("cudnnStatus_t", [
        "cudnnHandle_t", _D, _F, _D, _T, _D, _C, "cudnnConvolutionBwdDataAlgo_t", "void*",
        "size_t", _D, _T, "void*"]),
    "cudnnConvolutionBackwardFilter": ("cudnnStatus_t", [
        "cudnnHandle_t", _D, _T, _D, _T, _D, _C, "cudnnConvolutionBwdFilterAlgo_t", "void*",
        "size_t", _D, _F, "void*"]),
}
for _name, (_, _params) in PROTOTYPES.items():          # const T and T pass the same
    for _p in _params:
        C_TYPES.setdefault(_p, C_TYPES.get(_p.removeprefix("const "), None))


def declare(lib):
    """cuDNN's functions of PROTOTYPES, typed (libraries.declare)."""
    return libraries.declare(lib, PROTOTYPES, C_TYPES)


def _status_string(functions, code):
    text = functions["cudnnGetErrorString"](int(code))
    return text.decode() if isinstance(text, bytes) else str(text)


def _version(functions):
    v = int(functions["cudnnGetVersion"]())
    return f"cuDNN {v // 10000}.{v % 10000 // 100}.{v % 100}"


def library():
    """The loaded cuDNN (libraries.Library), or None (libraries.why('cudnn'))."""
    return libraries.load("cudnn", declare, _status_string, _version)
