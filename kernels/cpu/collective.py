"""CPU kernels of the collective ops (ops/collective.py), on the communicator of
their KernelContext (`ctx.comm`): every array of one dtype packed into one buffer
and reduced in one allreduce; `label` names an op's collective in order checks and
deadline errors (the GPU kernels use it too).
"""
from __future__ import annotations

import numpy as np

from minigraph.schema import OpError


def label(op):
    """What a collective of `op` is called on every rank: the op and its inputs."""
    names = [v.name for v in op.inputs["x"]]
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    return f"{op.type} [{shown}]"


def share_label(op):
    """What c_scale_by_batch_share's allreduce is called on every rank."""
    return f"{op.type} batch={op.inputs['batch'].name}"


def by_dtype(xs):
    """{dtype: [index, ...]} of the arrays, in first-seen order."""
    groups = {}
    for i, x in enumerate(xs):
        groups.setdefault(np.dtype(x.dtype), []).append(i)
    return groups


def scaled(x, factor):
    """x * factor as a new array of x's dtype (0-d arrays stay arrays)."""
    out = np.empty_like(x)
    np.multiply(x, factor, out=out, casting="same_kind")
    return out


def batch_share(op, ins, comm):
    """size * B_r / sum of B over the ranks (one scalar allreduce on the host), B_r the
    leading dimension of `batch` on this rank."""
    mine = ins["batch"].shape[0]
    total = comm.allreduce(np.array([float(mine)]), what=share_label(op))
    if total[0] == 0:
        raise OpError(f"{op.type}: every rank's batch is empty")
    return comm.size * mine / total[0]


def allreduce_avg_cpu(op, ins, ctx):
    """Pack the arrays of each dtype into one buffer, allreduce it once, unpack."""
    comm = ctx.comm
    xs = ins["x"]
    if comm.size == 1:
        return {"out": [x.copy() for x in xs]}
    outs = [None] * len(xs)
    for dtype, idx in by_dtype(xs).items():
        packed = np.concatenate([xs[i].reshape(-1) for i in idx])
        total = comm.allreduce(packed, what=label(op))
        total /= comm.size
        start = 0
        for i in idx:
            size = xs[i].size
            outs[i] = total[start:start + size].reshape(xs[i].shape).astype(dtype, copy=False)
            start += size
    return {"out": outs}


def avg_presummed_cpu(op, ins, ctx):
    """out_i = x_i / size (no communication)."""
    size = ctx.comm.size
    return {"out": [scaled(x, 1.0 / size) if size > 1 else x.copy() for x in ins["x"]]}


def scale_by_batch_share_cpu(op, ins, ctx):
    """out = x * size * B_r / sum of B."""
    comm = ctx.comm
    if comm.size == 1:
        return {"out": ins["x"].copy()}
    return {"out": scaled(ins["x"], batch_share(op, ins, comm))}
