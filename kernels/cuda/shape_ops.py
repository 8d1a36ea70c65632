"""Launchers for kernels/cuda/shape_ops.cu: copies between layouts, for any dtype of
1, 2, 4 or 8 bytes (the kernels move words): copy / reshape, concat and its
gradient's slices, transpose.

reshape returns a device copy, never a view: an output that aliased its
input would change when an op later writes the input in place (an
optimizer's update, an in-place pair), which no other op's output does.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu.shape_ops import out_shape
from minigraph.kernels.cuda import launch, loader, strided

MODULE = "shape_ops"
_WORDS = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
SIGNATURES = {}
for _size, _w in _WORDS.items():
    for _width in (1, launch.VECTOR_BYTES // _size):
        SIGNATURES[f"copy_{_w}_w{_width}"] = "PPq"
        SIGNATURES[f"copy_rows_{_w}_w{_width}"] = "PqqPqqqq"
    SIGNATURES[f"transpose_{_w}"] = "PPq" + "q" * (2 * strided.MAX_DIMS)


def word(what, dtype):
    """The word suffix of `dtype` (u8 .. u64); TypeError naming `what` for other sizes."""
    dtype = np.dtype(dtype)
    if dtype.itemsize not in _WORDS:
        raise TypeError(f"{what}: the GPU copies move 1, 2, 4 or 8-byte values, got {dtype}")
    return _WORDS[dtype.itemsize]


def _launch(name, units, *args):
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    k.launch((launch.flat_grid(units, dev, threads, k.resources), 1, 1), (threads, 1, 1), *args)


def copy(src, out=None, shape=None):
    """A device copy of `src` (same dtype and size) into `out`, or into a new
    array of `shape` (default src's shape). Returns out."""
    shape = tuple(src.shape) if shape is None else tuple(int(n) for n in shape)
    if out is None:
        if math.prod(shape) != src.size:
            raise ValueError(f"copy: cannot copy {src.size} values into shape {shape}")
        out = loader.empty(shape, src.dtype)
    if out.size != src.size or np.dtype(out.dtype) != np.dtype(src.dtype):
        raise ValueError(f"copy: out must hold {src.size} values of {np.dtype(src.dtype)}, got "
                         f"{np.dtype(out.dtype)}{tuple(out.shape)}")
    if src.size:
        sfx = word("copy", src.dtype)
        pointers = (loader.ptr(src, "copy: src"), loader.ptr(out, "copy: out"))
        width = launch.vector_width(np.dtype(src.dtype).itemsize)
        if not launch.is_aligned(*pointers):
            width = 1
        _launch(f"copy_{sfx}_w{width}", -(-src.size // width), *pointers, src.size)
    return out


def reshape(x, shape):
    """A new device array of `shape` (same number of values) holding x's values
    in C order. Returns it."""
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) != x.size:
        raise ValueError(f"reshape: cannot reshape {tuple(x.shape)} ({x.size} values) into "
                         f"{shape}")
    return copy(x, shape=shape)


def _copy_rows(what, src, spitch, soff, dst, dpitch, doff, rows, cols):
    """dst[r, doff:doff+cols] = src[r, soff:soff+cols] for r < rows (pitches in values)."""
    if rows == 0 or cols == 0:
        return
    itemsize = np.dtype(src.dtype).itemsize
    ps, pd = loader.ptr(src, f"{what}: source"), loader.ptr(dst, f"{what}: destination")
    width = launch.vector_width(itemsize)
    if not (launch.is_aligned(ps, pd) and all(v % width == 0 for v in
                                              (spitch, soff, dpitch, doff, cols))):
        width = 1
    _launch(f"copy_rows_{word(what, src.dtype)}_w{width}", rows * cols // width, ps,
            spitch // width, soff // width, pd, dpitch // width, doff // width, rows,
            cols // width)


def _axis(what, rank, axis):
    if not -rank <= axis < rank:
        raise ValueError(f"{what}: axis {axis} is out of range for rank {rank}")
    return axis % rank


def concat_shape(shapes, axis):
    """(output shape, normalised axis) of concatenating `shapes` along `axis`;
    ValueError unless they have one rank and agree outside the axis."""
    first = tuple(shapes[0])
    axis = _axis("concat", len(first), axis)
    for i, s in enumerate(shapes):
        s = tuple(s)
        if len(s) != len(first) or s[:axis] + s[axis + 1:] != first[:axis] + first[axis + 1:]:
            raise ValueError(f"concat: input {i} has shape {s}, input 0 has {first}; they "
                             f"must agree on every dim but axis {axis}")
    total = sum(int(s[axis]) for s in shapes)
    return first[:axis] + (total,) + first[axis + 1:], axis


def concat(xs, axis=0, out=None):
    """np.concatenate(xs, axis) on the device (xs: one dtype, one rank, equal dims
    but `axis`; negative axis counts from the end). Returns out (new unless given)."""
    if not xs:
        raise ValueError("concat: needs at least one input")
    for i, a in enumerate(xs):
        if np.dtype(a.dtype) != np.dtype(xs[0].dtype):
            raise ValueError(f"concat: input {i} is {np.dtype(a.dtype)}, input 0 is "
                             f"{np.dtype(xs[0].dtype)}")
    shape, axis = concat_shape([a.shape for a in xs], axis)
    if out is None:
        out = loader.empty(shape, xs[0].dtype)
    launch.check_array("concat: out", out, shape, xs[0].dtype)
    pre, post = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    start = 0
    for a in xs:
        cols = int(a.shape[axis]) * post
        _copy_rows("concat", a, cols, 0, out, shape[axis] * post, start, pre, cols)
        start += cols
    return out


def concat_slice(dout, shapes, axis, index, out=None):
    """The part of concat's dout that belongs to input `index` (of shape
    shapes[index]), as a new contiguous array (or into `out`). Returns it."""
    shape, axis = concat_shape(shapes, axis)
    launch.check_array("concat_grad: dout", dout, shape, dout.dtype)
    mine = tuple(int(n) for n in shapes[index])
    if out is None:
        out = loader.empty(mine, dout.dtype)
    launch.check_array("concat_grad: dx", out, mine, dout.dtype)
    pre, post = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    start = sum(int(s[axis]) for s in shapes[:index]) * post
    cols = mine[axis] * post
    _copy_rows("concat_grad", dout, shape[axis] * post, start, out, cols, 0, pre, cols)
    return out


def transpose(x, perm, out=None):
    """x.transpose(perm) as a new C-contiguous array (or into `out`). Returns it."""
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(len(x.shape))):
        raise ValueError(f"transpose: perm {perm} is not a permutation of the {len(x.shape)} "
                         "axes")
    shape = tuple(int(x.shape[p]) for p in perm)
    if out is None:
        out = loader.empty(shape, x.dtype)
    launch.check_array("transpose: out", out, shape, x.dtype)
    if out.size == 0:
        return out
    own = strided.contiguous_strides(x.shape)
    dims, (src,) = strided.collapse(shape, tuple(own[p] for p in perm))
    if len(dims) <= 1:                        # nothing moves
        return copy(x, out=out)
    sfx = word("transpose", x.dtype)
    _launch(f"transpose_{sfx}", out.size, loader.ptr(x, "transpose: x"),
            loader.ptr(out, "transpose: out"), out.size, *strided.padded("transpose", dims, src))
    return out


# ---- op kernels -------------------------------------------------------------------

def reshape_gpu(op, ins, ctx):
    """out = a device copy of x in `shape` (the -1 resolved)."""
    x = ins["x"]
    return {"out": reshape(x, out_shape(op, tuple(x.shape)))}


def flatten_gpu(op, ins, ctx):
    """out = a device copy of x with dims start_axis..stop_axis merged."""
    x = ins["x"]
    return {"out": reshape(x, out_shape(op, tuple(x.shape)))}


def reshape_grad_gpu(op, ins, ctx):
    """dx = a device copy of dout in x's shape, when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": reshape(ins["dout"], ins["x"].shape)}


def transpose_gpu(op, ins, ctx):
    """out = x.transpose(perm), a new C-contiguous device array."""
    return {"out": transpose(ins["x"], op.attrs["perm"])}


def transpose_grad_gpu(op, ins, ctx):
    """dx = dout.transpose(argsort(perm)) on the device, when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": transpose(ins["dout"], tuple(int(p) for p in np.argsort(op.attrs["perm"])))}


def concat_gpu(op, ins, ctx):
    """out = np.concatenate(x, axis) on the device."""
    return {"out": concat(ins["x"], op.attrs["axis"])}


def concat_grad_gpu(op, ins, ctx):
    """dx = x[index]'s slice of dout along axis (a new array), when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": concat_slice(ins["dout"], [x.shape for x in ins["x"]], op.attrs["axis"],
                                   op.attrs["index"])}
