"""Batched products with numpy's broadcasting of the batch axes (the matmul op) and
their gradients, on the GEMM launchers of kernels/cuda/matmul.py."""
from __future__ import annotations

import itertools
import math

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import launch, libraries, loader, strided
from minigraph.kernels.cuda.matmul import gemm, gemm_plan


def batch_launches(dims, strides, zmax):
    """[(offsets (a, b, c), inner_count, batches, gemm strides (a_outer, a_inner,
    b_outer, b_inner, c_outer, c_inner))]: the gemm launches of a product batched over
    the collapsed batch `dims`, the operands at `strides` (a, b, c: element strides
    over dims, 0 where broadcast). The last two dims run inside a launch (blockIdx.z,
    at most `zmax` products), chunked to fit; the others loop on the host."""
    if not dims:
        dims, strides = (1,), tuple((0,) for _ in strides)
    *lead, inner = dims
    outer = lead.pop() if lead else 1
    s_in = [st[-1] for st in strides]
    s_out = [st[-2] if len(dims) >= 2 else 0 for st in strides]
    ichunk = min(inner, zmax)
    ochunk = min(outer, max(1, zmax // ichunk))
    gemm_strides = (s_out[0], s_in[0], s_out[1], s_in[1], s_out[2], s_in[2])
    launches = []
    for idx in itertools.product(*(range(n) for n in lead)):
        base = [sum(i * s for i, s in zip(idx, st)) for st in strides]
        for o0 in range(0, outer, ochunk):
            for i0 in range(0, inner, ichunk):
                ni = min(ichunk, inner - i0)
                offsets = tuple(b + o0 * so + i0 * si for b, so, si in zip(base, s_out, s_in))
                launches.append((offsets, ni, min(ochunk, outer - o0) * ni, gemm_strides))
    return launches


def _op_shape(a, trans):
    rows, cols = (int(n) for n in a.shape[-2:])
    return (cols, rows) if trans else (rows, cols)


def _bmm_plan(dtype, a_shape, ta, b_shape, tb, batch):
    """run(a, b, c) on device pointers: c (batch + (m, n), contiguous) = op(a) @ op(b)
    for each batch index, a and b broadcast over `batch`. When b is a single matrix
    and a, not transposed, holds every batch matrix, the batch folds into one
    product of a's stacked rows; otherwise batch_launches plans the launches."""
    (m, k), (_, n) = ((a_shape[-1], a_shape[-2]) if ta else a_shape[-2:],
                      (b_shape[-1], b_shape[-2]) if tb else b_shape[-2:])
    lda, ldb = a_shape[-1], b_shape[-1]
    count = math.prod(batch)
    a_full, b_one = math.prod(a_shape[:-2]) == count, math.prod(b_shape[:-2]) == 1
    if count == 1 or (b_one and a_full and not ta):
        return gemm_plan(dtype, ta, tb, count * m, n, k, lda, ldb, n)
    mats = [math.prod(a_shape[-2:]), math.prod(b_shape[-2:]), m * n]
    strides = [tuple(s * mats[0] for s in strided.broadcast_strides(batch, a_shape[:-2])),
               tuple(s * mats[1] for s in strided.broadcast_strides(batch, b_shape[:-2])),
               tuple(s * mats[2] for s in strided.contiguous_strides(batch))]
    dims, strides = strided.collapse(batch, *strides)
    itemsize = np.dtype(dtype).itemsize
    runs = [(gemm_plan(dtype, ta, tb, m, n, k, lda, ldb, n, inner_count=ic, batches=nb,
                       strides=st), [o * itemsize for o in offsets])
            for offsets, ic, nb, st in batch_launches(dims, strides, loader.device().max_grid[2])]

    def run(a, b, c):
        for go, (oa, ob, oc) in runs:
            go(a + oa, b + ob, c + oc)
    return run


def _bmm(a, ta, b, tb, batch, out):
    """out (batch + op(a) @ op(b)'s shape, contiguous) = op(a) @ op(b), broadcast."""
    plans = loader.cached("matmul.batched", dict)
    key = (np.dtype(a.dtype), tuple(a.shape), ta, tuple(b.shape), tb, batch, libraries.plan_key())
    run = plans.get(key)
    if run is None:
        run = loader.cache_put(plans, key, _bmm_plan(key[0], key[1], ta, key[3], tb, batch))
    run(loader.ptr(a, "matmul: a"), loader.ptr(b, "matmul: b"), loader.address(out))
    return out


def _check(x, y, trans_x, trans_y):
    """(batch shape, m, n) of matmul(x, y); ValueError for operands that do not chain."""
    if np.dtype(x.dtype) != np.dtype(y.dtype):
        raise ValueError(f"matmul: dtypes differ ({x.dtype} and {y.dtype})")
    if len(x.shape) < 2 or len(y.shape) < 2:
        raise ValueError(f"matmul: x and y must have rank >= 2, got shapes {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    (m, k), (k2, n) = _op_shape(x, trans_x), _op_shape(y, trans_y)
    if k != k2:
        raise ValueError(f"matmul: op(x) is {m}x{k}, op(y) is {k2}x{n}: inner dims differ")
    return strided.broadcast_shape("matmul", x.shape[:-2], y.shape[:-2]), m, n


def batched(x, y, trans_x=False, trans_y=False):
    """out = op(x) @ op(y) (numpy's matmul: x (..., M, K), y (..., K, N), the batch axes
    broadcast; op swaps the last two axes where trans_*), a new array (..., M, N)."""
    batch, m, n = _check(x, y, trans_x, trans_y)
    out = loader.empty(batch + (m, n), x.dtype)
    if out.size:
        _bmm(x, trans_x, y, trans_y, batch, out)
    return out


def batched_grad(x, y, dout, trans_x=False, trans_y=False, need_dx=True, need_dy=True):
    """(dx, dy) of out = batched(x, y, trans_x, trans_y): with X = op(x), Y = op(y),
    dX = dout @ Y^T and dY = X^T @ dout per batch index, transposed back where x or y
    was, summed over the batch axes x or y was broadcast along (in double; a single
    matrix gathering a whole batch, as y of x (B, M, K) @ y (K, N), is instead one
    product over the stacked rows, accumulated in the dtype); None for the ones not
    needed."""
    batch, m, n = _check(x, y, trans_x, trans_y)
    launch.check_array("matmul_grad: dout", dout, batch + (m, n), x.dtype)
    dx = dy = None
    if need_dx:          # dx = dout @ Y^T, or Y @ dout^T for a transposed x
        dx = _grad_of(x, batch, dout, False, y, not trans_y) if not trans_x else \
            _grad_of(x, batch, y, trans_y, dout, True)
    if need_dy:          # dy = X^T @ dout, or dout^T @ X for a transposed y
        dy = _grad_of(y, batch, x, not trans_x, dout, False) if not trans_y else \
            _grad_of(y, batch, dout, True, x, trans_x)
    return dx, dy


def _grad_of(target, batch, a, ta, b, tb):
    """The gradient of `target` (x or y): op(a) @ op(b) per batch index, summed back to
    target's shape. Written straight into it when target holds every batch matrix;
    one product a_stacked^T @ b_stacked when target is a single matrix and a (to be
    transposed) and b (not) hold every batch matrix; else per batch index, then
    summed in double by broadcast.reduce_to."""
    from minigraph.kernels.cuda import broadcast, fill

    shape = tuple(int(s) for s in target.shape)
    out = loader.empty(shape, target.dtype)
    count = math.prod(batch)
    if out.size == 0:
        return out
    if count == 0:                           # a sum over no batch matrices
        return fill.fill_constant(out, 0)
    if math.prod(shape[:-2]) == count:
        return _bmm(a, ta, b, tb, batch, out)
    if math.prod(shape[:-2]) == 1 and ta and not tb and math.prod(a.shape[:-2]) == count \
            and math.prod(b.shape[:-2]) == count:
        k = count * int(a.shape[-2])
        gemm(a.dtype, True, False, shape[-2], shape[-1], k, loader.ptr(a), a.shape[-1],
             loader.ptr(b), b.shape[-1], loader.address(out), shape[-1])
        return out
    full = loader.empty(batch + shape[-2:], target.dtype)
    _bmm(a, ta, b, tb, batch, full)
    return broadcast.reduce_to(full, shape, out=out, what="matmul_grad")


# ---- op kernels -------------------------------------------------------------------

def matmul_gpu(op, ins, ctx):
    """out = op(x) @ op(y) on the device, the batch axes broadcast (numpy's matmul)."""
    a = op.attrs
    return {"out": batched(ins["x"], ins["y"], a["transpose_x"], a["transpose_y"])}


def matmul_grad_gpu(op, ins, ctx):
    """dx, dy of matmul on the device, each summed over the batch axes its operand was
    broadcast along (in double), each only when bound."""
    a = op.attrs
    dx, dy = batched_grad(ins["x"], ins["y"], ins["dout"], a["transpose_x"], a["transpose_y"],
                          need_dx=op.wants("dx"), need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)
