"""Launchers for kernels/cuda/matmul.cu: tiled matrix products on device arrays,
and `mul` (x flattened to 2-D times y) with its gradients."""
from __future__ import annotations

import math

from minigraph.kernels import present
from minigraph.kernels.cuda import launch, loader

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
    each sums `red` products at offsets r * a_red, r * b_red. Offsets in elements.
    The launches are planned once per device and geometry (gemm_plan)."""
    key = (dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, bool(beta), inner_count, batches,
           tuple(strides), red, a_red, b_red)
    plans = loader.cached("matmul.gemm", dict)
    run = plans.get(key)
    if run is None:
        run = plans[key] = gemm_plan(*key)
    run(a, b, c)


def gemm_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, beta=False, inner_count=1,
              batches=1, strides=(0, 0, 0, 0, 0, 0), red=1, a_red=0, b_red=0):
    """run(a, b, c): the launches of `gemm` with these arguments (see there) on the
    current device, for device pointers a, b, c. Checks the geometry now (ValueError),
    so a launcher that keeps the plan checks nothing per call."""
    if trans_a and trans_b:
        raise ValueError("gemm: A^T @ B^T is not provided")
    if m <= 0 or n <= 0:
        return _nothing
    variant = "tn" if trans_a else "nt" if trans_b else "nn"
    name = f"gemm_{variant}_{loader.suffix(dtype)}"
    kern = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    if batches > dev.max_grid[2]:
        raise ValueError(f"gemm: {batches} batched products exceed the grid's z limit")
    if max(m, n, k) >= 2**31:
        raise ValueError("gemm: dimensions must be below 2**31")
    itemsize = 8 if loader.suffix(dtype) == "f64" else 4
    launches = []
    for r0, rows, _, _, grid in launch.gemm_launches(m, n, batches, dev):
        a_off = (r0 if trans_a else r0 * lda) * itemsize
        launches.append((kern.prepared(grid, (launch.GEMM_THREADS, 1, 1)), (rows, n, k), a_off,
                         r0 * ldc * itemsize))
    tail = (ldc, inner_count, *strides, red, a_red, b_red, int(bool(beta)))

    def run(a, b, c):
        for go, head, a_off, c_off in launches:
            go(*head, a + a_off, lda, b, ldb, c + c_off, *tail)
    return run


def _nothing(*pointers):
    """The plan of an empty product."""


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
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(out, 0)
    gemm(a.dtype, trans_a, trans_b, m, n, k, loader.ptr(a), a.shape[1], loader.ptr(b),
         b.shape[1], loader.ptr(out), n, beta=accumulate)
    return out


def _flat(shape, n):
    return math.prod(shape[:n]), math.prod(shape[n:])


def mul(x, y, x_num_col_dims=1, out=None):
    """out = flatten(x) @ y with x viewed as (prod(x.shape[:n]), prod(x.shape[n:])),
    shaped x.shape[:n] + (y.shape[1],). Returns out."""
    plans = loader.cached("matmul.mul", dict)
    key = (x.shape, y.shape, x.dtype, y.dtype, x_num_col_dims)
    found = plans.get(key)
    if found is None:
        found = plans[key] = _mul_plan(x, y, x_num_col_dims)
    out_shape, run = found
    xp, yp = loader.ptr(x, "mul: x"), loader.ptr(y, "mul: y")
    if out is None:
        out = loader.empty(out_shape, x.dtype)
    else:
        launch.check_array("mul: out", out, out_shape, x.dtype)
    if run is None:
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(out, 0)
    run(xp, yp, loader.address(out))        # made here, or checked by check_array
    return out


def _mul_plan(x, y, n):
    """(out shape, run(x, y, out) or None when x has no columns) of mul."""
    rows, cols = _flat(tuple(x.shape), n)
    if len(y.shape) != 2 or tuple(y.shape)[0] != cols or y.dtype != x.dtype:
        raise ValueError(f"mul: y must be ({cols}, M) for x of shape {tuple(x.shape)} and "
                         f"x_num_col_dims={n}, got {tuple(y.shape)}")
    out_shape = tuple(x.shape[:n]) + (y.shape[1],)
    if cols == 0:
        return out_shape, None
    m = y.shape[1]
    return out_shape, gemm_plan(x.dtype, False, False, rows, m, cols, cols, m, m)


def mul_grad(x, y, dout, x_num_col_dims=1, need_dx=True, need_dy=True):
    """(dx, dy) of out = mul(x, y): dx = dout @ y^T (x's shape), dy = x2^T @ dout;
    None for the ones not needed."""
    plans = loader.cached("matmul.mul_grad", dict)
    key = (x.shape, y.shape, dout.shape, x.dtype, y.dtype, dout.dtype, x_num_col_dims)
    found = plans.get(key)
    if found is None:
        found = plans[key] = _mul_grad_plan(x, y, dout, x_num_col_dims)
    dx_run, dy_run = found
    xp, yp = loader.ptr(x, "mul_grad: x"), loader.ptr(y, "mul_grad: y")
    dp = loader.ptr(dout, "mul_grad: dout")
    dx = dy = None
    if need_dx:
        dx = loader.empty(x.shape, x.dtype)
        dx_run(dp, yp, loader.address(dx))
    if need_dy:
        dy = loader.empty(y.shape, y.dtype)
        dy_run(xp, dp, loader.address(dy))
    return dx, dy


def _mul_grad_plan(x, y, dout, n):
    """(run for dx, run for dy) of mul_grad: run(a, b, out) on device pointers."""
    rows, cols = _flat(tuple(x.shape), n)
    m = y.shape[1] if len(y.shape) == 2 else -1
    launch.check_array("mul_grad: y", y, (cols, m), x.dtype)
    launch.check_array("mul_grad: dout", dout, tuple(x.shape[:n]) + (m,), x.dtype)
    return (gemm_plan(x.dtype, False, True, rows, cols, m, m, m, cols),
            gemm_plan(x.dtype, True, False, cols, m, rows, cols, m, m))


# ---- op kernels -------------------------------------------------------------------

def mul_gpu(op, ins, ctx):
    """out = flatten(x) @ y on the device (tiled matrix product), shaped x.shape[:n] + (M,)."""
    x, y = ins["x"], ins["y"]
    return {"out": mul(x, y, op.attrs["x_num_col_dims"])}


def mul_grad_gpu(op, ins, ctx):
    """dx = dout2 @ y.T (x's shape), dy = x2.T @ dout2 on the device; each only when bound."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    dx, dy = mul_grad(x, y, d, op.attrs["x_num_col_dims"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)
