"""The native kernel of weight gradients (kernels/cpu/wgrad_native.c): x.T @ d against
the float64 reference for every remainder of its register tile (6 rows of out by two
vectors), its blocks of rows and its passes over rows that fit in L2; the same bits on
any number of threads; NaN and infinities; and what it leaves to BLAS."""
import os

import numpy as np
import pytest
from helpers import native_built, native_products

from minigraph.kernels.cpu import blocks, choices, mul, native, wgrad_native

rng = np.random.default_rng(17)

pytestmark = native_built("wgrad_native")
small_products = native_products(wgrad_native)


def operands(r, k, m):
    return (rng.standard_normal((r, k)).astype(np.float32),
            rng.standard_normal((r, m)).astype(np.float32))


def close(got, x, d):
    want = x.astype(np.float64).T @ d.astype(np.float64)
    assert got.dtype == np.float32 and got.shape == want.shape
    scale = max(1.0, float(abs(want).max())) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.sqrt(max(1, len(x))) * scale)


# rows: 1, short of a block (64), a block and one past, several; rows of out: 1, short of
# a tile (6), a tile and past it, a unit (36) and past it; columns: 1, a vector (8 or
# 16) and around it, a panel (16 or 32) and around it, several panels (a unit: 4)
SHAPES = [(1, 1, 1), (5, 3, 16), (63, 6, 17), (64, 7, 8), (65, 36, 31), (200, 37, 32),
          (129, 12, 33), (300, 130, 100), (70, 300, 129), (1000, 5, 1), (3, 77, 300),
          (128, 128, 128), (2, 1, 257)]


@pytest.mark.parametrize("r, k, m", SHAPES)
def test_against_the_float64_reference(r, k, m):
    x, d = operands(r, k, m)
    assert wgrad_native.supports(x, d)
    close(wgrad_native.product(x, d), x, d)


def test_rows_in_several_passes(monkeypatch):
    """(k + m) 600 floats a row: passes of 384 rows (1 MiB of x and d), the last short."""
    x, d = operands(1100, 300, 300)
    got = wgrad_native.product(x, d)
    close(got, x, d)
    outs = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(blocks, "get_num_threads", lambda t=threads: t)
        outs.append(wgrad_native.product(x, d))
    for out in outs:
        np.testing.assert_array_equal(out, got)


@pytest.mark.parametrize("r, k, m", [(1024, 128, 128), (50, 70, 300), (333, 13, 45)])
def test_the_same_bits_on_any_number_of_threads(r, k, m, monkeypatch):
    x, d = operands(r, k, m)
    outs = []
    for threads in (1, 2, 3, 5, 64):
        monkeypatch.setattr(blocks, "get_num_threads", lambda t=threads: t)
        outs.append(wgrad_native.product(x, d))
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.int32), outs[0].view(np.int32))


def test_no_rows_gives_zeros():
    got = wgrad_native.product(np.zeros((0, 7), np.float32), np.zeros((0, 40), np.float32))
    np.testing.assert_array_equal(got, np.zeros((7, 40), np.float32))


def test_nan_and_infinities_spread_as_in_the_reference():
    x, d = operands(100, 20, 40)
    x[3, 2] = np.nan                      # row 2 of out: NaN
    d[7, 5] = np.inf                      # column 5: infinite, or NaN where inf - inf
    x[9, 4], d[9, 6] = 0.0, np.inf        # 0 * inf: NaN in (4, 6)
    got = wgrad_native.product(x, d)
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float64).T @ d.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-4)
    assert np.isnan(got[2]).all() and np.isnan(got[4, 6])


def test_views_are_read_as_their_values():
    x, d = operands(90, 40, 60)
    got = wgrad_native.product(x[:, ::2], d.T.copy().T)
    close(got, x[:, ::2], d)


def test_what_it_leaves_to_blas(monkeypatch):
    """float64, rows that differ, other ranks, too little work, MINIGRAPH_NATIVE=0."""
    x, d = operands(30, 8, 9)
    assert not wgrad_native.supports(x.astype(np.float64), d)
    assert not wgrad_native.supports(x, d[:-1])
    assert not wgrad_native.supports(x.reshape(30, 2, 4), d)
    monkeypatch.setattr(wgrad_native, "MIN_WORK", 30 * 8 * 9 + 1)
    assert not wgrad_native.supports(x, d)
    monkeypatch.setattr(wgrad_native, "MIN_WORK", 1)
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert not wgrad_native.supports(x, d)


@pytest.mark.parametrize("name", ["native", "blas"])
def test_mul_and_matmul_weight_gradients_on_either_option(name):
    """mul's weight gradient (and matmul's, which is the same function) on each option of
    the choice, against the float64 reference; float64 stays on BLAS."""
    x, d = operands(256, 48, 80)
    with choices.forcing({"fc_dw": name}):
        got = mul.weight_grad(x, d)
        wide = mul.weight_grad(x.astype(np.float64), d.astype(np.float64))
    close(got, x, d)
    assert wide.dtype == np.float64
    np.testing.assert_allclose(wide, x.astype(np.float64).T @ d.astype(np.float64), rtol=1e-12)


def test_the_avx2_build_against_the_reference(tmp_path, monkeypatch):
    """Where the CPU has AVX-512, a build told otherwise (CC="cc -mno-avx512f") has tiles of
    6 by 16 columns and panels of 16: its remainders against the reference too."""
    if native.vector_floats("wgrad_native") != 16:
        pytest.skip("the build here already has 8-float vectors")
    monkeypatch.setenv("MINIGRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", " ".join((os.environ.get("CC") or "cc").split()
                                      + ["-mno-avx512f"]))
    native._load.cache_clear()
    wgrad_native._kernel.clear()
    try:
        assert native.vector_floats("wgrad_native") == 8
        for r, k, m in [(65, 13, 7), (70, 36, 15), (129, 40, 16), (33, 7, 47)]:
            x, d = operands(r, k, m)
            close(wgrad_native.product(x, d), x, d)
    finally:
        native._load.cache_clear()
        wgrad_native._kernel.clear()
