"""Helpers shared by the GPU kernel bindings of the op modules.

A binding (`kernel(op_type, "gpu")`) takes the device arrays of the op's
inputs, calls the launchers of minigraph.kernels on them and returns device
arrays: nothing is copied to the host inside a step. Importing this and the
launchers imports nothing from pycuda. Not an op module: it registers nothing.
"""
from __future__ import annotations

import numpy as np

from minigraph.schema import OpError

GPU_FLOATS = (np.dtype("float32"), np.dtype("float64"))


def wants(op, slot):
    """True when output `slot` of `op` is bound (unbound optional outputs are skipped)."""
    return op.outputs.get(slot) is not None


def check_gpu_float(op, **arrays):
    """OpError unless every array (by input slot name) is float32 or float64,
    the dtypes the GPU kernels are compiled for."""
    for slot, a in arrays.items():
        if a is not None and np.dtype(a.dtype) not in GPU_FLOATS:
            raise OpError(f"{op.type}: input {slot!r} has dtype {np.dtype(a.dtype)}; the GPU "
                          "kernels take float32 or float64 (run float16 on the CPU)")


def present(**outputs):
    """{slot: array} without the outputs that were not computed (None)."""
    return {slot: a for slot, a in outputs.items() if a is not None}
