"""Launchers for kernels/cuda/matmul.cu: tiled matrix products on device arrays
(cuBLAS where it loads, else the hand-written GEMM), `mul` (x flattened to 2-D
times y) with its gradients, fused_fc's epilogue; batched products with numpy's
broadcasting of the batch axes (the matmul op) are kernels/cuda/batched_matmul.py."""
from __future__ import annotations

import math

import numpy as np

from minigraph import device
from minigraph.kernels import present
from minigraph.kernels.cpu.layer_norm import check_rows
from minigraph.kernels.cuda import broadcast, cublas, launch, libraries, loader, norm
from minigraph.kernels.cuda import map as maps

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


# ---- op kernels -------------------------------------------------------------------

def mul_gpu(op, ins, ctx):
    """out = flatten(x) @ y on the device (tiled matrix product), shaped x.shape[:n] + (M,)."""
    x, y = ins["x"], ins["y"]
    return {"out": mul(x, y, op.attrs["x_num_col_dims"])}


def normalized_x(op, ins):
    """A fused op's x, or with attribute normalize layer_norm's y of it on the device
    (norm_scale, norm_bias, norm_epsilon; with the CPU's error for a row of variance 0
    at norm_epsilon 0, read back to the host)."""
    a = op.attrs
    if not a["normalize"]:
        return ins["x"]
    y, _, var = norm.layer_norm(ins["x"], ins.get("norm_scale"), ins.get("norm_bias"),
                                a["x_num_col_dims"], a["norm_epsilon"])
    if a["norm_epsilon"] == 0:
        check_rows(op, device.to_host(var), 0.0, "norm_epsilon")
    return y


def fused_fc_gpu(op, ins, ctx):
    """x normalised where the op normalises it (normalized_x), the mul launcher (cuBLAS,
    or the hand-written GEMM), then the bias, a residual of its shape and relu in place
    on its output in one epilogue launch (bias_act); a residual that broadcasts by
    broadcast's add, then relu; gelu by gelu's map in place."""
    out = mul(normalized_x(op, ins), ins["y"], op.attrs["x_num_col_dims"])
    bias, residual, act = ins.get("bias"), ins.get("residual"), op.attrs["activation"]
    if bias is not None:
        launch.check_array("fused_fc: bias", bias, (out.shape[-1],), out.dtype)
    late = residual is not None and tuple(residual.shape) != tuple(out.shape)
    out = bias_act(out, bias, None if late else residual, act == "relu" and not late,
                   what="fused_fc")
    if late:
        out = bias_act(broadcast.add(out, residual), relu=act == "relu", what="fused_fc")
    if act == "gelu":
        maps.unary("gelu", "gelu", out, out=out)
    return {"out": out}


def fused_fc_group_gpu(op, ins, ctx):
    """fused_fc's product and epilogue (the bias) for each weight of the group, on x
    normalised once where the op normalises it."""
    x, ys = normalized_x(op, ins), ins["y"]
    biases = ins.get("bias") or [None] * len(ys)
    outs = []
    for y, bias in zip(ys, biases):
        out = mul(x, y, op.attrs["x_num_col_dims"])
        if bias is not None:
            launch.check_array("fused_fc_group: bias", bias, (out.shape[-1],), out.dtype)
        outs.append(bias_act(out, bias, what="fused_fc_group"))
    return {"out": outs}


def mul_grad_gpu(op, ins, ctx):
    """dx = dout2 @ y.T (x's shape), dy = x2.T @ dout2 on the device; each only when bound."""
    x, y, d = ins["x"], ins["y"], ins["dout"]
    dx, dy = mul_grad(x, y, d, op.attrs["x_num_col_dims"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)
