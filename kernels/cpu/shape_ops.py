"""CPU kernels of reshape, flatten and transpose (ops/shape_ops.py): new C-contiguous
arrays, never views of x. `out_shape` gives the concrete output shape of reshape and
flatten (the GPU kernels use it too); `bind_reshape` is their bound form.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from minigraph.kernels.cpu import prepared


def out_shape(op, x_shape):
    """The concrete output shape of reshape or flatten `op` on an input of `x_shape`
    (attributes checked by the schema: reshape's one -1 resolved, flatten's axes
    merged)."""
    a = op.attrs
    if "shape" in a:
        known = math.prod(d for d in a["shape"] if d != -1)
        return tuple(math.prod(x_shape) // known if d == -1 else d for d in a["shape"])
    start, stop = a["start_axis"] % len(x_shape), a["stop_axis"] % len(x_shape)
    merged = (math.prod(x_shape[start:stop + 1]),)
    return tuple(x_shape[:start]) + merged + tuple(x_shape[stop + 1:])


def reshape_cpu(op, ins, ctx):
    """out = a copy of x in `shape` (the -1 resolved)."""
    x = ins["x"]
    return {"out": x.reshape(out_shape(op, x.shape)).copy()}


def flatten_cpu(op, ins, ctx):
    """out = a copy of x with dims start_axis..stop_axis merged."""
    x = ins["x"]
    return {"out": x.reshape(out_shape(op, x.shape)).copy()}


def bind_reshape(op):
    """reshape_cpu's and flatten_cpu's bound form (minigraph.bound_run): a C-contiguous
    x copied into the same array of the output shape every run (the kernels' copy),
    prepared again only for another input array. None (the kernel runs) for another x."""
    kept = {"out": None}

    def prepare(x):
        if not x.flags.c_contiguous:             # x.reshape would be a copy, not a view
            return None
        shape = out_shape(op, x.shape)
        out = prepared.output(kept, shape, x.dtype)
        return functools.partial(np.copyto, out, x.reshape(shape)), {"out": out}
    return prepared.form(("x",), prepare, streamed=("x",))


def reshape_grad_cpu(op, ins, ctx):
    """dx = a copy of dout in x's shape."""
    if not op.wants("dx"):
        return {}
    return {"dx": ins["dout"].reshape(ins["x"].shape).copy()}


def transpose_cpu(op, ins, ctx):
    """out = x.transpose(perm), C-contiguous (a copy even for the identity perm)."""
    return {"out": ins["x"].transpose(op.attrs["perm"]).copy(order="C")}


def transpose_grad_cpu(op, ins, ctx):
    """dx = dout.transpose(argsort(perm)), C-contiguous."""
    if not op.wants("dx"):
        return {}
    return {"dx": ins["dout"].transpose(np.argsort(op.attrs["perm"])).copy(order="C")}
