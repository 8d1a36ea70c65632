"""Launchers for kernels/cuda/matmul.cu: tiled matrix products on device arrays,
`mul` (x flattened to 2-D times y) with its gradients, and batched products with
numpy's broadcasting of the batch axes (`batched`, the matmul op) with theirs."""
from __future__ import annotations

import itertools
import math

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import cublas, launch, libraries, loader, strided

MODULE = "matmul"
GEMM_FORMAT = "iiiPqPqPqi" + "qqqqqq" + "iqqi"
SIGNATURES = {f"gemm_{v}_{t}": GEMM_FORMAT for v in ("nn", "tn", "nt", "tt")
              for t in ("f32", "f64")}
SIGNATURES.update({f"gemm_sum_slices_{t}": "PPqqii" for t in ("f32", "f64")})
SIGNATURES.update({f"bias_act_{t}": "PPPqqqi" for t in ("f32", "f64")})
SPLIT_MIN_K = 256       # the hand-written GEMM splits K into slices of at least this many
MAX_SLICES = 64
MAX_K = 2**31 - 16      # K of one hand-written launch (its int parameters), a multiple of 16


def gemm(dtype, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, beta=False, inner_count=1,
         batches=1, strides=(0, 0, 0, 0, 0, 0), red=1, a_red=0, b_red=0, what="matmul"):
    """C = op(A) @ op(B) (+ C with beta) on raw device pointers a, b, c (ints),
    op(A) m x k, op(B) k x n, row-major with leading dims lda, ldb, ldc;
    op = transpose when trans_*. `batches` products: product z uses offsets
    outer * s_outer + inner * s_inner (z = outer * inner_count + inner) from
    strides = (a_outer, a_inner, b_outer, b_inner, c_outer, c_inner), and
    each sums `red` products at offsets r * a_red, r * b_red. Offsets in elements.
    The launches are planned once per device and geometry (gemm_plan); `what`
    names the op in errors."""
    key = (dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, bool(beta), inner_count, batches,
           tuple(strides), red, a_red, b_red, what, libraries.plan_key())
    plans = loader.cached("matmul.gemm", dict)
    run = plans.get(key)
    if run is None:
        run = loader.cache_put(plans, key, gemm_plan(*key[:-1]))
    run(a, b, c)


def gemm_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, beta=False, inner_count=1,
              batches=1, strides=(0, 0, 0, 0, 0, 0), red=1, a_red=0, b_red=0, what="matmul"):
    """run(a, b, c): the product of `gemm` with these arguments (see there) on the
    current device, for device pointers a, b, c: through cuBLAS where it is loaded
    (kernels/cuda/cublas.py), else the hand-written kernels (kernel_plan). Checks
    the geometry now (ValueError), so a launcher that keeps the plan checks
    nothing per call."""
    if m <= 0 or n <= 0:
        return _nothing
    run = cublas.gemm_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, beta, inner_count,
                           batches, strides, red, a_red, b_red, what)
    if run is not None:
        return run
    return kernel_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, beta, inner_count,
                       batches, strides, red, a_red, b_red)


def kernel_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, beta=False, inner_count=1,
                batches=1, strides=(0, 0, 0, 0, 0, 0), red=1, a_red=0, b_red=0):
    """gemm_plan's run(a, b, c) on the hand-written kernels of matmul.cu. A product
    with few output tiles and a long K (a convolution's filter gradient, summed over
    every image and pixel) is split into K slices across the grid (split_slices),
    their partial products summed in a fixed order by gemm_sum_slices."""
    dev = loader.device()
    if n >= 2**31:
        raise ValueError(f"gemm: {n} columns; the hand-written GEMM takes fewer than 2**31")
    slices = split_slices(m, n, k, batches, dev) if _splittable(
        m, n, ldc, inner_count, batches, strides, red) else 1
    if slices > 1:
        return _split_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, beta, inner_count,
                           batches, strides, slices)
    if k > MAX_K:
        raise ValueError(f"gemm: K = {k} needs splitting, which this product's layout "
                         "(a sum over several products, or a strided output) does not allow")
    variant = ("t" if trans_a else "n") + ("t" if trans_b else "n")
    name = f"gemm_{variant}_{loader.suffix(dtype)}"
    kern = loader.kernel(MODULE, name, SIGNATURES[name])
    if batches > dev.max_grid[2]:
        raise ValueError(f"gemm: {batches} batched products exceed the grid's z limit")
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


def split_slices(m, n, k, batches, dev):
    """How many K slices the hand-written GEMM of an m x n output (x `batches`) with
    inner dimension k is split into: enough for about two blocks per multiprocessor
    when its own tiles are fewer than the multiprocessors, each slice at least
    SPLIT_MIN_K long, at most MAX_SLICES; and always enough that no slice is longer
    than MAX_K."""
    tiles = math.ceil(m / launch.GEMM_TILE) * math.ceil(n / launch.GEMM_TILE) * batches
    slices = 1
    if tiles < dev.sm_count and k >= 2 * SPLIT_MIN_K:
        slices = min(math.ceil(2 * dev.sm_count / tiles), k // SPLIT_MIN_K, MAX_SLICES)
    slices = max(slices, math.ceil(k / MAX_K))
    return max(1, min(slices, dev.max_grid[2] // max(batches, 1)))


def _splittable(m, n, ldc, inner_count, batches, strides, red):
    """Whether the split-K plan covers this product: no `red` sum, one level of
    batching, and each product's output a contiguous m x n block after the last."""
    if red != 1 or ldc != n or (inner_count != 1 and inner_count != batches):
        return False
    c_stride = strides[4] if inner_count == 1 else strides[5]
    return batches == 1 or c_stride == m * n


def _split_plan(dtype, trans_a, trans_b, m, n, k, lda, ldb, beta, inner_count, batches,
                strides, slices):
    """run(a, b, c): the product as `slices` K slices (the same length but the last,
    which takes what is left) written into partials [batch][slice][m * n] by two
    batched launches at most, then summed in slice order into c."""
    chunk = min(MAX_K, -(-math.ceil(k / slices) // 16) * 16)
    full, rest = divmod(k, chunk)
    count = full + (1 if rest else 0)
    ga, gb = (strides[0], strides[2]) if inner_count == 1 else (strides[1], strides[3])
    a_step = chunk * (lda if trans_a else 1)
    b_step = chunk * (1 if trans_b else ldb)
    mn, itemsize = m * n, np.dtype(dtype).itemsize
    launches = []
    if full:
        launches.append((0, 0, 0, kernel_plan(
            dtype, trans_a, trans_b, m, n, chunk, lda, ldb, n, inner_count=full,
            batches=batches * full, strides=(ga, a_step, gb, b_step, count * mn, mn))))
    if rest:
        launches.append((full * a_step * itemsize, full * b_step * itemsize,
                         full * mn * itemsize, kernel_plan(
                             dtype, trans_a, trans_b, m, n, rest, lda, ldb, n, inner_count=1,
                             batches=batches, strides=(ga, 0, gb, 0, count * mn, 0))))
    name = f"gemm_sum_slices_{loader.suffix(dtype)}"
    total = batches * mn
    reduce = loader.flat_go(MODULE, name, SIGNATURES[name], total)
    flag = int(bool(beta))

    def run(a, b, c):
        partials = loader.empty((batches * count * mn,), np.dtype(dtype))
        p = loader.address(partials)
        for a_off, b_off, p_off, go in launches:
            go(a + a_off, b + b_off, p + p_off)
        reduce(p, c, mn, total, count, flag)
    return run


def bias_act(out, bias=None, residual=None, relu=False, inner=1, what="fused op"):
    """The fused ops' epilogue in place, in one launch: out = act(out + bias (broadcast
    along the axis of `bias.size` values whose inner extent is `inner`) + residual
    (out's shape)), act = relu or the identity. Returns out."""
    if bias is None and residual is None and not relu:
        return out
    channels = bias.size if bias is not None else 1
    for name, a in (("bias", bias), ("residual", residual)):
        if a is not None and np.dtype(a.dtype) != np.dtype(out.dtype):
            raise ValueError(f"{what}: {name} is {np.dtype(a.dtype)}, the output "
                             f"{np.dtype(out.dtype)}")
    if residual is not None:
        launch.check_array(f"{what}: residual", residual, out.shape, out.dtype)
    if out.size:
        name = f"bias_act_{loader.suffix(out.dtype)}"
        go = loader.flat_go(MODULE, name, SIGNATURES[name], out.size)
        go(loader.ptr(out, f"{what}: out"), loader.ptr(bias, f"{what}: bias"),
           loader.ptr(residual, f"{what}: residual"), out.size, inner, channels, int(relu))
    return out


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
    key = (x.shape, y.shape, x.dtype, y.dtype, x_num_col_dims, libraries.plan_key())
    found = plans.get(key)
    if found is None:
        found = loader.cache_put(plans, key, _mul_plan(x, y, x_num_col_dims))
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
    return out_shape, gemm_plan(x.dtype, False, False, rows, m, cols, cols, m, m, what="mul")


def mul_grad(x, y, dout, x_num_col_dims=1, need_dx=True, need_dy=True):
    """(dx, dy) of out = mul(x, y): dx = dout @ y^T (x's shape), dy = x2^T @ dout;
    None for the ones not needed."""
    plans = loader.cached("matmul.mul_grad", dict)
    key = (x.shape, y.shape, dout.shape, x.dtype, y.dtype, dout.dtype, x_num_col_dims,
           libraries.plan_key())
    found = plans.get(key)
    if found is None:
        found = loader.cache_put(plans, key, _mul_grad_plan(x, y, dout, x_num_col_dims))
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
    return (gemm_plan(x.dtype, False, True, rows, cols, m, m, m, cols, what="mul_grad: dx"),
            gemm_plan(x.dtype, True, False, cols, m, rows, cols, m, m, what="mul_grad: dy"))


# ---- batched products (the matmul op) -----------------------------------------------

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

def mul_gpu(op, ins, ctx):
    """out = flatten(x) @ y on the device (tiled matrix product), shaped x.shape[:n] + (M,)."""
    x, y = ins["x"], ins["y"]
    return {"out": mul(x, y, op.attrs["x_num_col_dims"])}


def fused_fc_gpu(op, ins, ctx):
    """The mul launcher (cuBLAS, or the hand-written GEMM), then the bias and relu in
    place on its output in one epilogue launch (bias_act)."""
    out = mul(ins["x"], ins["y"], op.attrs["x_num_col_dims"])
    bias = ins.get("bias")
    if bias is not None:
        launch.check_array("fused_fc: bias", bias, (out.shape[-1],), out.dtype)
    return {"out": bias_act(out, bias, None, op.attrs["activation"] == "relu",
                            what="fused_fc")}


def mul_grad_gpu(op, ins, ctx):
    """dx = dout2 @ y.T (x's shape), dy = x2.T @ dout2 on the device; each only when bound."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    dx, dy = mul_grad(x, y, d, op.attrs["x_num_col_dims"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


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
