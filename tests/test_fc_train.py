"""fc_native's training products (kernels/cpu/fc_train.h, fc_native.train_product) and
where mul's kernels use them (kernels/cpu/mul.py): against the float64 reference for
every remainder of the register tile and the panel, blocks of x's columns, either side
transposed, any number of threads; the choice between them and BLAS."""
import os

import numpy as np
import pytest
from helpers import helper_test_op, native_built, native_products

from minigraph.kernels.cpu import blocks, choices, fc_native, mul, native

rng = np.random.default_rng(11)

pytestmark = native_built("fc_native")
small_products = native_products(fc_native)

# rows (M): 1, a tile (6), the last rows in tiles of 4, many; columns (N): fewer than a
# vector, a panel (32 with AVX-512), past it, 8 panels and more; inner (K): 1, short of
# a transpose's 8, one block (512), blocks split evenly (513, 784, 1100)
SHAPES = [(1, 1, 1), (6, 7, 17), (7, 40, 23), (13, 512, 33), (128, 513, 130), (4, 9, 520),
          (131, 784, 129), (2, 1100, 200), (64, 77, 30), (9, 30, 24), (21, 50, 300),
          (128, 128, 256), (5, 3, 2)]


def operands(m, k, n, x_transposed, w_transposed):
    """Random float32 x and w laid out as train_product reads them for A (M, K) @ B (K,
    N), and A and B."""
    x = rng.standard_normal((k, m) if x_transposed else (m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if w_transposed else (k, n)).astype(np.float32)
    return x, w, (x.T if x_transposed else x), (w.T if w_transposed else w)


def close(got, a, b):
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert got.dtype == np.float32 and got.shape == want.shape
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    np.testing.assert_array_less(np.abs(got - want), 4e-7 * scale + 1e-30)


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("x_transposed, w_transposed", [(False, False), (False, True),
                                                        (True, False), (True, True)])
def test_products_against_the_float64_reference(m, k, n, x_transposed, w_transposed):
    x, w, a, b = operands(m, k, n, x_transposed, w_transposed)
    assert fc_native.train_supports(x, w, x_transposed, w_transposed)
    close(fc_native.train_product(x, w, x_transposed, w_transposed), a, b)


@pytest.mark.parametrize("m, k, n, x_transposed, w_transposed", [
    (128, 700, 300, False, False), (128, 1030, 140, False, True),
    (300, 64, 130, True, False), (9, 64, 20, False, True), (64, 130, 3, True, False)])
def test_the_same_bits_on_any_number_of_threads(m, k, n, x_transposed, w_transposed,
                                                monkeypatch):
    x, w, _, _ = operands(m, k, n, x_transposed, w_transposed)
    outs = []
    for threads in (1, 2, 3, 5):
        monkeypatch.setattr(blocks, "get_num_threads", lambda t=threads: t)
        outs.append(fc_native.train_product(x, w, x_transposed, w_transposed))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("x_transposed, w_transposed", [(False, False), (False, True),
                                                        (True, False)])
def test_nan_and_infinities_spread_as_in_the_reference(x_transposed, w_transposed):
    """A NaN of x and an infinity of w reach the outputs they reach in the float64
    product, and only those (no padding of a panel or a tile mixes them in)."""
    x, w, a, b = operands(13, 70, 45, x_transposed, w_transposed)
    a[4, 9] = np.nan
    b[30, 40] = np.inf
    b[31, 2] = -np.inf
    a[7, 31] = 0.0                                  # 0 * -inf: NaN in row 7's column 2
    got = fc_native.train_product(x, w, x_transposed, w_transposed)
    with np.errstate(invalid="ignore"):
        want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    scale = (np.abs(np.nan_to_num(a, nan=0, posinf=0, neginf=0)).astype(np.float64)
             @ np.abs(np.nan_to_num(b, nan=0, posinf=0, neginf=0)))
    assert (np.abs(got[finite] - want[finite]) <= 4e-7 * scale[finite]).all()


def test_what_it_leaves_to_blas(monkeypatch):
    """float64, a view that is not C-contiguous, sides that do not chain, other ranks,
    too little work, MINIGRAPH_NATIVE=0."""
    x, w, _, _ = operands(8, 9, 10, False, False)
    assert fc_native.train_supports(x, w) and fc_native.train_supports(x.T.copy(), w, True)
    assert not fc_native.train_supports(x.astype(np.float64), w)
    assert not fc_native.train_supports(x, w.astype(np.float64))
    assert not fc_native.train_supports(x[:, ::2], w[::2])
    assert not fc_native.train_supports(x, w, False, True)          # (8, 9) @ (10, 9)^T
    assert not fc_native.train_supports(x.reshape(8, 3, 3), w)
    monkeypatch.setattr(fc_native, "MIN_WORK", 8 * 9 * 10 + 1)
    assert not fc_native.train_supports(x, w)
    monkeypatch.setattr(fc_native, "MIN_WORK", 1)
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert not fc_native.train_supports(x, w)


def counting_kernel(monkeypatch):
    """A list that grows by one at each call of fc_native.train_product from now on."""
    calls, kernel = [], fc_native.train_product

    def counted(*args):
        calls.append(args)
        return kernel(*args)
    monkeypatch.setattr(fc_native, "train_product", counted)
    return calls


@pytest.mark.parametrize("name", ["native", "blas"])
def test_mul_and_its_input_gradient_on_either_option(name, monkeypatch):
    """mul's product (trained_product) and mul_grad's input gradient d @ y^T on each
    option of the choice, against the float64 reference (finite differences: the
    op's test below); the kernel runs where it is the option."""
    x, y, _, _ = operands(70, 40, 300, False, False)
    d = rng.standard_normal((70, 300)).astype(np.float32)
    calls = counting_kernel(monkeypatch)
    with choices.forcing({"mm": name}):
        close(mul.product(x, y), x, y)
        close(mul.trained_product(d, y, b_transposed=True), d, y.T)
    assert len(calls) == (2 if name == "native" else 0)


@pytest.mark.parametrize("name", ["panels", "native", "blas"])
def test_weight_gradients_on_each_option(name, monkeypatch):
    x = rng.standard_normal((256, 48)).astype(np.float32)
    d = rng.standard_normal((256, 80)).astype(np.float32)
    calls = counting_kernel(monkeypatch)
    with choices.forcing({"fc_dw": name}):
        close(mul.weight_grad(x, d), x.T, d)
    assert len(calls) == (name == "panels")


def test_a_relus_output_through_mul_and_its_weight_gradient(monkeypatch):
    """A mostly zero x (a relu's output), whose products skip its zeros (fc_sparse.h),
    through mul's product and the weight gradient x^T @ d on the kernel."""
    x = np.maximum(rng.standard_normal((70, 300)).astype(np.float32) - 0.3, 0.0)
    y = rng.standard_normal((300, 130)).astype(np.float32)
    d = rng.standard_normal((70, 130)).astype(np.float32)
    calls = counting_kernel(monkeypatch)
    with choices.forcing({"mm": "native", "fc_dw": "panels"}):
        close(mul.product(x, y), x, y)
        close(mul.weight_grad(x, d), x.T, d)
    assert len(calls) == 2


@pytest.mark.parametrize("name", ["native", "blas"])
def test_the_mul_op_and_its_gradients_on_either_option(name):
    """The op in float64 on BLAS (the kernel takes float32 only: finite differences need
    float64) and in float32 on the forced option, its output and gradients against the
    float64 reference."""
    x = rng.standard_normal((6, 5, 7))
    y = rng.standard_normal((35, 9))
    with choices.forcing({"mm": name, "fc_dw": "panels" if name == "native" else name}):
        helper_test_op("mul", {"x": x, "y": y}, {"x_num_col_dims": 1},
                       lambda x, y, **_: {"out": x.reshape(6, 35) @ y}, grad_wrt=("x", "y"))
        x32, y32 = x.astype(np.float32), y.astype(np.float32)
        d = rng.standard_normal((6, 9)).astype(np.float32)
        close(mul.product(x32.reshape(6, 35), y32), x32.reshape(6, 35), y32)
        close(mul.trained_product(d, y32, b_transposed=True), d, y32.T)
        close(mul.weight_grad(x32.reshape(6, 35), d), x32.reshape(6, 35).T, d)


def test_the_avx2_build_against_the_reference(tmp_path, monkeypatch):
    """Where the CPU has AVX-512, a build told otherwise (CC="cc -mno-avx512f") has
    panels of 16 columns: its remainders and transposes against the reference too."""
    if native.vector_floats("fc_native") != 16:
        pytest.skip("the build here already has 8-float vectors")
    monkeypatch.setenv("MINIGRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", " ".join((os.environ.get("CC") or "cc").split()
                                      + ["-mno-avx512f"]))
    native._load.cache_clear()
    try:
        assert native.vector_floats("fc_native") == 8
        for m, k, n in [(7, 40, 23), (13, 513, 17), (64, 77, 30), (5, 3, 2)]:
            for flags in [(False, False), (False, True), (True, False)]:
                x, w, a, b = operands(m, k, n, *flags)
                close(fc_native.train_product(x, w, *flags), a, b)
                x[rng.random(x.shape) < 0.6] = 0.0           # fc_sparse.h's tiles
                close(fc_native.train_product(x, w, *flags), a, b)
    finally:
        native._load.cache_clear()
