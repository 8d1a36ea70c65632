"""The native product for an x mostly of zeros (kernels/cpu/fc_sparse.h): the bits of
the dense kernel (fc_forward_f32) on the same packed weight for every remainder of its
groups of panels, parts and blocks of x's columns, rows past a pass, any number of
threads, bias and relu, zeros of either sign, NaN and inf in x; the float64 reference
through fc_native.forward; the dense kernel wherever a weight is not finite or x is
mostly nonzero; and the training kernels' failed allocation, raised as MemoryError."""
import ctypes
import os

import numpy as np
import pytest
from helpers import native_built, native_products

from minigraph.kernels.cpu import fc_native

rng = np.random.default_rng(11)

pytestmark = native_built("fc_native")
small_products = native_products(fc_native)

# x's columns: one, short of a part (64), a part, past it, blocks split evenly (513:
# 257 + 256, 1100: 367 + 367 + 366); the weight's columns: whole groups of panels (3
# panels of 32 with AVX-512, 6 of 16 with AVX2: 96) and every remainder of groups and
# panels; rows: one, a few, past a pass of 128
SHAPES = [(1, 1, 17), (5, 63, 33), (7, 64, 100), (9, 65, 129), (130, 513, 200),
          (300, 130, 64), (3, 1100, 520), (128, 784, 256), (2, 20, 18), (129, 200, 47),
          (4, 96, 96), (6, 70, 80)]


def reference(x, w, bias, relu):
    with np.errstate(invalid="ignore"):                 # 0 * inf: NaN, as in float32
        out = x.astype(np.float64) @ w.astype(np.float64)
    if bias is not None:
        out += bias
    return np.maximum(out, 0.0) if relu else out


def relu_like(m, k, density):
    """float32 (m, k): standard normal values where a uniform draw is below `density`,
    +0.0 and -0.0 elsewhere (a relu's output has both)."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    zeros = rng.random((m, k)) >= density
    x[zeros] = np.where(rng.random(zeros.sum()) < 0.5, 0.0, -0.0)
    return x


def both_kernels(x, w, bias, relu, threads):
    """(dense, sparse): fc_forward_f32's and fc_sparse_f32's out on w packed once."""
    lib = fc_native._lib()                           # the library, its functions typed
    packed = fc_native.packed_weight(w)
    outs = []
    for fn in (lib.fc_forward_f32, lib.fc_sparse_f32):
        out = np.full((x.shape[0], w.shape[1]), 7.0, np.float32)
        rc = fn(x.ctypes.data, packed.ctypes.data,
                None if bias is None else bias.ctypes.data, out.ctypes.data, *x.shape,
                w.shape[1], int(relu), threads)
        assert rc == 0
        outs.append(out)
    return outs


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("density", [0.0, 0.3, 0.55])
@pytest.mark.parametrize("bias, relu", [(True, True), (False, False)])
def test_the_dense_kernels_bits(m, k, n, density, bias, relu):
    x = relu_like(m, k, density)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    for threads in (1, 2, 3):
        dense, sparse = both_kernels(x, w, b, relu, threads)
        np.testing.assert_array_equal(sparse.view(np.int32), dense.view(np.int32))


@pytest.mark.parametrize("m, k, n", [(7, 64, 100), (130, 513, 200)])
def test_nan_inf_and_signed_zeros_in_x(m, k, n):
    """NaN and inf in x are not zeros (they reach every sum of their row as in the dense
    kernel); a row of -0.0 only gives the bias, as in the dense kernel."""
    x = relu_like(m, k, 0.3)
    x[1, 3], x[2, 5], x[3, 9] = np.nan, np.inf, -np.inf
    x[4] = -0.0
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for relu in (False, True):
        dense, sparse = both_kernels(x, w, b, relu, 2)
        np.testing.assert_array_equal(sparse.view(np.int32), dense.view(np.int32))
        assert np.isnan(sparse[1]).all()
        assert (np.isinf(sparse[2]) | (relu and sparse[2] == 0)).all()
        np.testing.assert_array_equal(sparse[4], np.maximum(b, 0) if relu else b)


@pytest.mark.parametrize("m, k, n", [(128, 784, 256), (3, 1100, 520), (9, 65, 129)])
def test_forward_against_the_float64_reference(m, k, n):
    x = relu_like(m, k, 0.4)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    got = fc_native.forward(x, w, b, relu=True)
    want = reference(x, w, b, True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * np.sqrt(k) * abs(want).max())
    assert fc_native.finite_weight(w)


def inf_where_x_is_zero(m, k, n):
    """x mostly zeros whose column 5 is all zeros, and w with inf in row 5."""
    x = relu_like(m, k, 0.3)
    x[:, 5] = 0.0
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[5, 2] = np.inf
    return x, w


def test_a_weight_not_finite_takes_the_dense_kernel():
    """0 * inf is NaN: fc_sparse_f32, which skips the zeros, is only for finite weights,
    so forward runs the dense kernel on this one and gives the reference's NaNs. Run
    directly on it, fc_sparse_f32 shows it skips them on mostly zero x (column 2 is
    finite) and is the dense kernel on mostly nonzero x."""
    x, w = inf_where_x_is_zero(20, 70, 40)
    got = fc_native.forward(x, w)
    assert not fc_native.finite_weight(w)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(reference(x, w, None, False)))
    assert np.isnan(got[:, 2]).all()
    dense, sparse = both_kernels(x, w, None, False, 2)
    assert np.isnan(dense[:, 2]).all() and np.isfinite(sparse).all()
    x[x == 0] = 1.0                                  # mostly nonzero: the dense kernel
    x[:, 5] = 0.0
    dense, sparse = both_kernels(x, w, None, False, 2)
    np.testing.assert_array_equal(sparse.view(np.int32), dense.view(np.int32))
    assert np.isnan(sparse[:, 2]).all()


def test_finite_weight_is_found_once_a_weight(monkeypatch):
    w = np.ones((8, 40), np.float32)
    calls = []
    real = np.isfinite
    monkeypatch.setattr(np, "isfinite", lambda a: calls.append(a.shape) or real(a))
    assert fc_native.finite_weight(w) and fc_native.finite_weight(w)
    assert calls == [(8, 40)] and not w.flags.writeable
    w.flags.writeable = True
    w[0, 0] = np.nan                                  # a changed weight is looked at again
    assert not fc_native.finite_weight(w) and calls == [(8, 40), (8, 40)]


def test_prepared_forward_chooses_by_the_weight():
    """The prepared call runs fc_sparse_f32 on a finite weight, fc_forward_f32 else."""
    lib = fc_native._lib()
    x = relu_like(6, 30, 0.3)
    out = np.empty((6, 40), np.float32)
    seen = []
    for w in (np.ones((30, 40), np.float32), inf_where_x_is_zero(6, 30, 40)[1]):
        call = fc_native.prepared_forward(x, w, None, False, out)
        seen.append(next(c.cell_contents for c in call.__closure__
                         if isinstance(c.cell_contents, ctypes._CFuncPtr)))
    assert [fn.__name__ for fn in seen] == ["fc_sparse_f32", "fc_forward_f32"]
    assert seen[0] is lib.fc_sparse_f32


# Training's products (fc_train_sparse_f32): inner sizes of one block (its group's block
# kept over the units of the same group: rows past a pass) and of several, every
# remainder of groups and panels, either side transposed
TRAIN_SHAPES = [(5, 63, 33), (9, 65, 129), (130, 513, 200), (300, 130, 100), (3, 1100, 47),
                (129, 200, 96), (64, 8, 17)]


def train_kernels(x, xt, w, wt, threads):
    """(dense, sparse, code): fc_train_f32's and fc_train_sparse_f32's out for A = x or
    x^T by B = w or w^T, and the return code of fc_train_sparse_f32."""
    lib = fc_native._lib()
    m, k = x.shape[::-1] if xt else x.shape
    n = w.shape[0] if wt else w.shape[1]
    outs, codes = [], []
    for fn in (lib.fc_train_f32, lib.fc_train_sparse_f32):
        out = np.full((m, n), 7.0, np.float32)
        codes.append(fn(x.ctypes.data, int(xt), w.ctypes.data, int(wt), out.ctypes.data, m,
                        k, n, threads))
        outs.append(out)
    assert codes[0] == 0
    return outs[0], outs[1], codes[1]


def train_operands(m, k, n, xt, wt, density):
    """x relu-like as A (M, K) (laid out (K, M) where xt) and w (K, N) ((N, K) where wt),
    and A and B."""
    a = relu_like(m, k, density)
    b = rng.standard_normal((k, n)).astype(np.float32)
    x = np.ascontiguousarray(a.T) if xt else a
    w = np.ascontiguousarray(b.T) if wt else b
    return x, w, a, b


@pytest.mark.parametrize("m, k, n", TRAIN_SHAPES)
@pytest.mark.parametrize("xt, wt", [(False, False), (False, True), (True, False),
                                    (True, True)])
@pytest.mark.parametrize("density", [0.0, 0.4, 0.9])
def test_the_training_kernels_bits(m, k, n, xt, wt, density):
    """The one-row tiles where A is mostly zeros (code 0), fc_train_f32 where it is
    mostly not (code 2): fc_train_f32's bits on any number of threads."""
    x, w, _, _ = train_operands(m, k, n, xt, wt, density)
    for threads in (1, 2, 3):
        dense, sparse, code = train_kernels(x, xt, w, wt, threads)
        assert code == (2 if density > 0.6 else 0)
        np.testing.assert_array_equal(sparse.view(np.int32), dense.view(np.int32))


@pytest.mark.parametrize("xt, wt", [(False, False), (True, False), (False, True)])
def test_training_against_the_float64_reference(xt, wt):
    x, w, a, b = train_operands(70, 600, 130, xt, wt, 0.4)
    got = fc_native.train_product(x, w, xt, wt)
    want = reference(a, b, None, False)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    np.testing.assert_array_less(np.abs(got - want), 4e-7 * scale + 1e-30)


@pytest.mark.parametrize("xt, wt", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("row", [5, 600])
def test_a_block_not_finite_sums_every_column(xt, wt, row):
    """A block of the weight with an inf (in the first block of x's columns, or the
    second) sums every column there, so x's zeros meet it as in fc_train_f32 (NaN in
    every row), while the finite blocks skip them: fc_train_f32's bits either way; NaN
    and inf in x reach their rows' sums."""
    x, w, a, b = train_operands(40, 1100, 100, xt, wt, 0.3)
    a[:, row] = 0.0
    b[row, 2] = np.inf
    a[3, 9], a[4, 700] = np.nan, -np.inf
    x = np.ascontiguousarray(a.T) if xt else a
    w = np.ascontiguousarray(b.T) if wt else b
    dense, sparse, code = train_kernels(x, xt, w, wt, 2)
    assert code == 0
    np.testing.assert_array_equal(sparse.view(np.int32), dense.view(np.int32))
    want = reference(a, b, None, False)
    np.testing.assert_array_equal(np.isnan(sparse), np.isnan(want))
    assert np.isnan(sparse[:, 2]).all() and np.isnan(sparse[3]).all()
    assert np.isinf(sparse[4, 3:]).all()


FAILED_ALLOCATION = """
import resource
import numpy as np
import minigraph as mg
from minigraph.kernels.cpu import fc_native

mg.set_num_threads(2)
rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 4096)).astype(np.float32)    # A = x^T: copied to rows,
x[rng.random(x.shape) < 0.7] = 0.0                           # 64 MiB, by the C kernel
w = rng.standard_normal((4096, 8)).astype(np.float32)
fc_native.train_product(x[:64, :64].copy(), w[:64], True, False)  # the library, the pool
limit = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (16 << 20), limit[1]))
try:
    fc_native.train_product(x, w, True, False)
    print("no error")
except MemoryError as e:
    print("MemoryError:", e)
resource.setrlimit(resource.RLIMIT_AS, limit)
got = fc_native.train_product(x, w, True, False)
want = x.T.astype(np.float64) @ w.astype(np.float64)
print("after:", float(np.max(np.abs(got - want) / (np.abs(x.T) @ np.abs(w) + 1e-30))))
"""


def test_a_failed_allocation_raises_memory_error():
    """Where the C kernel cannot allocate its copy of x^T (the address space capped a
    little above what the process holds), train_product raises MemoryError, and the
    same product runs right once the cap is lifted: nothing was left half-done (a
    subprocess, with a hard timeout)."""
    import subprocess
    import sys

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc/self/statm here")
    done = subprocess.run([sys.executable, "-c", FAILED_ALLOCATION], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MemoryError: fc_native.train_product: the packed copies" in done.stdout
    assert float(done.stdout.split("after:")[1]) < 4e-7
