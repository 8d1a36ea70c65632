"""CUDA kernels: *.cu sources, their PyCUDA launchers, the loader, and op kernels.

A kernel module is either beside its launcher (batch_norm.py beside
batch_norm.cu, ...: plain functions on PyCUDA GPUArrays, usable without the
graph) or map-only: elementwise kernels declared one per line with map.cuh's
macros, launched by map.unary / map.binary, whose signatures map.py reads
from the source. `loader` compiles each module once per context and process;
`launch` derives every launch configuration from shapes and device
properties; `backend` is the PyCUDA side. Importing any of this imports
nothing from pycuda: that happens at the first launch.

Op kernels `<op>_gpu(op, ins, ctx)` take the device arrays of the op's inputs,
call the launchers and return device arrays: nothing is copied to the host
inside a step. They sit at the end of the launcher module they call
(activation.py, ...), or in a module of their own where that one is full
(batch_norm_op.py). `FLOATS` are the float dtypes they are registered for.
"""
from __future__ import annotations

import numpy as np

FLOATS = (np.dtype("float32"), np.dtype("float64"))
