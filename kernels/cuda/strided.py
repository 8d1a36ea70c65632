"""Shapes and strides for the kernels of kernels/cuda/strided.cuh (pure Python, no pycuda).

Kernels that walk a tensor through other tensors' strides (broadcasting,
reductions to a shape, transposes) see at most MAX_DIMS dims: the launchers
collapse the shapes first (dims of size 1 dropped, neighbours merged where
every operand is contiguous across them), then pad on the left with dims of
size 1 and stride 0. Strides here are in elements.
"""
from __future__ import annotations

import math

MAX_DIMS = 6          # strided.cuh's MAX_DIMS


def contiguous_strides(shape):
    """Element strides of a C-contiguous tensor of `shape`."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= int(n)
    return tuple(reversed(strides))


def broadcast_shape(what, a, b):
    """The numpy broadcast of shapes a and b (right-aligned; each dim equal, or 1
    in one of them); ValueError naming `what` and both shapes otherwise."""
    a, b = tuple(int(d) for d in a), tuple(int(d) for d in b)
    rank = max(len(a), len(b))
    pa, pb = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    out = []
    for i, (m, n) in enumerate(zip(pa, pb)):
        if m != n and 1 not in (m, n):
            raise ValueError(f"{what}: shapes {a} and {b} do not broadcast (dim {i} of the "
                             f"right-aligned shapes: {m} vs {n})")
        out.append(n if m == 1 else m)
    return tuple(out)


def broadcast_strides(out_shape, shape):
    """Strides of a contiguous tensor of `shape` read at every position of
    `out_shape` it broadcasts to (0 on its broadcast dims)."""
    out_shape, shape = tuple(out_shape), tuple(shape)
    padded = (1,) * (len(out_shape) - len(shape)) + shape
    own = contiguous_strides(padded)
    return tuple(0 if n == 1 else s for n, s in zip(padded, own))


def collapse(shape, *strides):
    """(dims, [strides of each operand]) with size-1 dims dropped and neighbours
    merged where every operand steps across them as one dim."""
    dims, out = [], [[] for _ in strides]
    for i, n in enumerate(shape):
        if n == 1:
            continue
        if dims and all(st[-1] == s[i] * n for st, s in zip(out, strides)):
            dims[-1] *= n
            for st, s in zip(out, strides):
                st[-1] = s[i]
            continue
        dims.append(int(n))
        for st, s in zip(out, strides):
            st.append(int(s[i]))
    return tuple(dims), [tuple(st) for st in out]


def padded(what, dims, *strides):
    """dims and strides padded on the left to MAX_DIMS (size 1, stride 0), as one
    flat argument list: dims, then each operand's strides. ValueError naming
    `what` when more than MAX_DIMS dims are left after collapsing."""
    if len(dims) > MAX_DIMS:
        raise ValueError(f"{what}: {len(dims)} dims after merging contiguous ones; the GPU "
                         f"kernels take at most {MAX_DIMS}")
    pad = MAX_DIMS - len(dims)
    args = [1] * pad + list(dims)
    for st in strides:
        args += [0] * pad + list(st)
    return args


def split_kept(dims, d_strides, target_strides):
    """Of collapsed dims of a tensor d and a target read through
    `target_strides` (0 where the target is broadcast): (kept dims, their d
    strides, reduced dims, their d strides)."""
    kept = [(n, s) for n, s, t in zip(dims, d_strides, target_strides) if t]
    red = [(n, s) for n, s, t in zip(dims, d_strides, target_strides) if not t]
    return ([n for n, _ in kept], [s for _, s in kept], [n for n, _ in red], [s for _, s in red])


def channel_view_of(dims, target_strides):
    """(pre, C, post) when the kept dims of a collapsed reduction form one run
    (at most one kept dim after collapsing), else None."""
    kept = [i for i, t in enumerate(target_strides) if t]
    if len(kept) > 1:
        return None
    if not kept:
        return 1, 1, math.prod(dims)
    k = kept[0]
    return math.prod(dims[:k]), dims[k], math.prod(dims[k + 1:])
