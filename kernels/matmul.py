"""Launchers for kernels/matmul.cu: tiled matrix products on device arrays,
and `mul` (x flattened to 2-D times y) with its gradients."""
from __future__ import annotations

import math

from minigraph.kernels import launch, loader

MODULE = "matmul"
GEMM_FORMAT = "iiiPqPqPqi" + "qqqqqq" + "iqqi"
SIGNATURES = {f"gemm_{v}_{t}": GEMM_FORMAT for v in ("nn", "tn", "nt") for t in ("f32", "f64")}


def gemm(dtype, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, beta=False, inner_count=1,
         batches=1, strides=(0, 0, 0, 0, 0, 0), red=1, a_red=0, b_red=0):
    """C = op(A) @ op(B) (+ C with beta) on raw device pointers a, b, c (ints),
    op(A) m x k, op(B) k x n, row-major with leading dims lda, ldb, ldc;
    op = transpose when trans_*. `batches` products: product z uses offsets
    outer * s_outer + inner * s_inner (z = outer * inner_count + inner) from
    strides = (a_outer, a_inner, b_outer, b_inner, c_outer, c_inner), and
    each sums `red` products at offsets r * a_red, r * b_red. Offsets in elements."""
    if trans_a and trans_b:
        raise ValueError("gemm: A^T @ B^T is not provided")
    if m <= 0 or n <= 0:
        return
    variant = "tn" if trans_a else "nt" if trans_b else "nn"
    name = f"gemm_{variant}_{loader.suffix(dtype)}"
    kern = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    if batches > dev.max_grid[2]:
        raise ValueError(f"gemm: {batches} batched products exceed the grid's z limit")
    if max(m, n, k) >= 2**31:
        raise ValueError("gemm: dimensions must be below 2**31")
    itemsize = 8 if loader.suffix(dtype) == "f64" else 4
    for r0, rows, _, _, grid in launch.gemm_launches(m, n, batches, dev):
        a_off = r0 if trans_a else r0 * lda
        kern.launch(grid, (launch.GEMM_THREADS, 1, 1), rows, n, k, a + a_off * itemsize, lda,
                    b, ldb, c + r0 * ldc * itemsize, ldc, inner_count, *strides, red, a_red,
                    b_red, int(bool(beta)))


def matmul(a, b, trans_a=False, trans_b=False, out=None, accumulate=False):
    """out = op(a) @ op(b) for 2-D device arrays (+= into out with accumulate).
    Returns out (a new array unless given)."""
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: dtypes differ ({a.dtype} and {b.dtype})")
    launch.check_contiguous("matmul: a", a)
    launch.check_contiguous("matmul: b", b)
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    k2, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    if k != k2:
        raise ValueError(f"matmul: inner dims differ: op(a) is {m}x{k}, op(b) is {k2}x{n}")
    if out is None:
        out = loader.empty((m, n), a.dtype)
    launch.check_array("matmul: out", out, (m, n), a.dtype)
    if k == 0 and not accumulate:
        from minigraph.kernels import fill

        return fill.fill_constant(out, 0)
    gemm(a.dtype, trans_a, trans_b, m, n, k, loader.ptr(a), a.shape[1], loader.ptr(b),
         b.shape[1], loader.ptr(out), n, beta=accumulate)
    return out


def _flat(shape, n):
    return math.prod(shape[:n]), math.prod(shape[n:])


def mul(x, y, x_num_col_dims=1, out=None):
    """out = flatten(x) @ y with x viewed as (prod(x.shape[:n]), prod(x.shape[n:])),
    shaped x.shape[:n] + (y.shape[1],). Returns out."""
    rows, cols = _flat(tuple(x.shape), x_num_col_dims)
    launch.check_contiguous("mul: x", x)
    launch.check_contiguous("mul: y", y)
    if len(y.shape) != 2 or tuple(y.shape)[0] != cols or y.dtype != x.dtype:
        raise ValueError(f"mul: y must be ({cols}, M) for x of shape {tuple(x.shape)} and "
                         f"x_num_col_dims={x_num_col_dims}, got {tuple(y.shape)}")
    out_shape = tuple(x.shape[:x_num_col_dims]) + (y.shape[1],)
    out = loader.empty(out_shape, x.dtype) if out is None else out
    launch.check_array("mul: out", out, out_shape, x.dtype)
    if cols == 0:
        from minigraph.kernels import fill

        return fill.fill_constant(out, 0)
    gemm(x.dtype, False, False, rows, y.shape[1], cols, loader.ptr(x), cols, loader.ptr(y),
         y.shape[1], loader.ptr(out), y.shape[1])
    return out


def mul_grad(x, y, dout, x_num_col_dims=1, need_dx=True, need_dy=True):
    """(dx, dy) of out = mul(x, y): dx = dout @ y^T (x's shape), dy = x2^T @ dout;
    None for the ones not needed."""
    rows, cols = _flat(tuple(x.shape), x_num_col_dims)
    m = y.shape[1]
    launch.check_contiguous("mul_grad: x", x)
    launch.check_array("mul_grad: y", y, (cols, m), x.dtype)
    launch.check_array("mul_grad: dout", dout, tuple(x.shape[:x_num_col_dims]) + (m,), x.dtype)
    dx = dy = None
    if need_dx:
        dx = loader.empty(x.shape, x.dtype)
        gemm(x.dtype, False, True, rows, cols, m, loader.ptr(dout), m, loader.ptr(y), m,
             loader.ptr(dx), cols)
    if need_dy:
        dy = loader.empty(y.shape, y.dtype)
        gemm(x.dtype, True, False, cols, m, rows, loader.ptr(x), cols, loader.ptr(dout), m,
             loader.ptr(dy), m)
    return dx, dy
