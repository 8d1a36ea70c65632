"""Helpers shared by the GPU kernel bindings of the op modules.

A binding (`kernel(op_type, "gpu", dtypes=GPU_FLOATS)`) takes the device
arrays of the op's inputs, calls the launchers of minigraph.kernels on them
and returns device arrays: nothing is copied to the host inside a step. The
executor checks the float dtypes the binding declares; `op.wants(slot)`
says whether an optional output is bound. Importing this and the launchers
imports nothing from pycuda. Not an op module: it registers nothing.
"""
from __future__ import annotations

import numpy as np

GPU_FLOATS = (np.dtype("float32"), np.dtype("float64"))


def present(**outputs):
    """{slot: array} without the outputs that were not computed (None)."""
    return {slot: a for slot, a in outputs.items() if a is not None}
