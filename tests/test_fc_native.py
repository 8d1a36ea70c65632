"""The native kernel of fused_fc (kernels/cpu/fc_native.c): its results against the
float64 reference for every remainder of the register tile, blocks of x's columns,
packed and unpacked x, bias and relu, any number of threads; the few-columns kernel
(fc_cols.h) the same way; and the packed copies of weights they keep."""
import gc
import weakref

import numpy as np
import pytest
from helpers import native_built, native_products

import minigraph as mg
from minigraph.kernels.cpu import blocks, fc_native, native

rng = np.random.default_rng(5)

pytestmark = native_built("fc_native")
small_products = native_products(fc_native)


def reference(x, w, bias, relu):
    out = x.astype(np.float64) @ w.astype(np.float64)
    if bias is not None:
        out += bias
    return np.maximum(out, 0.0) if relu else out


# rows: 1, a tile (6), every remainder (the last rows in tiles of 4: one, two or none),
# packed and read in place; columns (more than COLS_MAX: fewer are fc_cols.h's): a
# panel (32 with AVX-512; 16 with AVX2 is past it here), short of it and past it, and
# enough panels (8 and more) that x is packed; x's columns: 1, one block (512), blocks
# split evenly (513, 784, 1100)
SHAPES = [(1, 1, 17), (5, 3, 18), (6, 16, 17), (7, 40, 23), (13, 512, 33), (128, 513, 130),
          (131, 784, 129), (2, 1100, 200), (12, 300, 256), (64, 77, 30), (3, 20, 140),
          (9, 30, 24), (10, 64, 200), (8, 33, 129), (21, 50, 40), (128, 96, 20),
          (7, 50, 31), (6, 40, 32), (11, 70, 47), (20, 64, 300), (4, 9, 520)]
# the few-columns kernel: columns 1 to COLS_MAX in tiles of every width (1 to 6) and
# ragged last tiles (7: 4 + 3, 11: 6 + 5, 13: 5 + 5 + 3); x's columns short of a
# vector, one, past it, many and a ragged end; rows 1, a pair, an odd last row
COLS_SHAPES = [(1, 1, 1), (2, 15, 2), (3, 16, 3), (64, 17, 4), (5, 100, 5), (7, 128, 6),
               (9, 33, 7), (64, 128, 10), (2, 2048, 10), (129, 300, 11), (4, 47, 13),
               (33, 64, 16), (1, 1568, 12), (128, 2048, 10)]
assert max(n for _, _, n in COLS_SHAPES) == fc_native.COLS_MAX
assert min(n for _, _, n in SHAPES) > fc_native.COLS_MAX


@pytest.mark.parametrize("m, k, n", SHAPES + COLS_SHAPES)
@pytest.mark.parametrize("bias, relu", [(True, True), (True, False), (False, True),
                                        (False, False)])
def test_forward_against_the_float64_reference(m, k, n, bias, relu):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    assert fc_native.supports(x, w)
    got = fc_native.forward(x, w, b, relu)
    want = reference(x, w, b, relu)
    assert got.dtype == np.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * np.sqrt(k) * max(1, abs(want).max()))


def operands(m, k, n):
    """Random float32 x (m, k), w (k, n) and bias (n,)."""
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32),
            rng.standard_normal(n).astype(np.float32))


def on_threads(monkeypatch, compute):
    """compute()'s results with 1, 2, 3 and 5 threads."""
    outs = []
    for threads in (1, 2, 3, 5):
        monkeypatch.setattr(blocks, "get_num_threads", lambda t=threads: t)
        outs.append(compute())
    return outs


@pytest.mark.parametrize("m, k, n", [(128, 700, 300), (9, 64, 20), (50, 1030, 140),
                                     (128, 2048, 10), (9, 700, 16), (64, 130, 3)])
def test_the_same_result_on_any_number_of_threads(m, k, n, monkeypatch):
    x, w, b = operands(m, k, n)
    outs = on_threads(monkeypatch, lambda: fc_native.forward(x, w, b, True))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def ones_with_nan_and_inf(m, k, n, nan_row, inf_row):
    """x (m, k) of ones with a NaN in row nan_row and +inf in row inf_row; w (k, n) of
    ones with column 7 of -1 (relu's zeros)."""
    x = np.ones((m, k), np.float32)
    x[nan_row, 3] = np.nan
    x[inf_row, 5] = np.inf
    w = np.ones((k, n), np.float32)
    w[:, 7] = -1.0
    return x, w


@pytest.mark.parametrize("n", [30, 10])                   # a panel; the few-columns kernel
def test_nan_and_infinities(n):
    x, w = ones_with_nan_and_inf(7, 20, n, 2, 4)
    got = fc_native.forward(x, w, None, relu=True)
    assert np.isnan(got[2]).all()                              # NaN stays NaN through relu
    assert np.isinf(got[4, 0]) and got[4, 7] == 0.0            # -inf: relu gives 0
    assert np.isfinite(got[[0, 1, 3, 5, 6]]).all()             # the other rows are untouched


# a weight of panels, and one of few columns (packed transposed, in a table of its own)
PACKED = pytest.mark.parametrize("n, table", [(20, "_packed"), (5, "_packed_cols")])


@PACKED
def test_a_weight_is_packed_once_and_made_read_only(n, table):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, n)).astype(np.float32)
    first = fc_native.forward(x, w)
    assert not w.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0] = 1.0
    ref, _, kept = getattr(fc_native, table)[id(w)]
    assert ref() is w
    np.testing.assert_array_equal(fc_native.forward(x, w), first)
    assert getattr(fc_native, table)[id(w)][2] is kept      # the same packed copy


@PACKED
def test_a_weight_made_writeable_again_is_packed_again(n, table):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((8, n)).astype(np.float32)
    fc_native.forward(x, w)
    kept = getattr(fc_native, table)[id(w)][2]
    w.flags.writeable = True
    w *= -2.0
    np.testing.assert_allclose(fc_native.forward(x, w), reference(x, w, None, False),
                               rtol=1e-5, atol=1e-5)
    assert not w.flags.writeable and getattr(fc_native, table)[id(w)][2] is not kept


@PACKED
def test_a_freed_weight_lets_go_of_its_packed_copy(n, table):
    """The packed copy goes with its weight, and no entry is left for a dead array
    (checked by weak references: another array may take the freed one's id at once)."""
    x = np.ones((2, 4), np.float32)
    w = np.ones((4, n), np.float32)
    fc_native.forward(x, w)
    packed = weakref.ref(getattr(fc_native, table)[id(w)][2])
    del w
    gc.collect()
    assert packed() is None
    assert all(entry[0]() is not None for entry in getattr(fc_native, table).values())


def test_the_few_columns_packing():
    """Each column's values side by side, zeros to a whole vector, and zero columns to
    whole tiles: 7 columns are tiles of 4 and 3, packed as 8."""
    w = np.arange(1, 22, dtype=np.float32).reshape(3, 7)
    packed = fc_native.packed_columns(w)
    length = native.vector_floats("fc_native")
    assert packed.size == 8 * length
    got = packed.reshape(8, length)
    np.testing.assert_array_equal(got[:7, :3], w.T)
    assert not got[:, 3:].any() and not got[7].any()


def test_a_new_value_of_the_parameter_is_used(monkeypatch):
    """Variable.set gives the inference net's weight a new array: the next run packs it."""
    monkeypatch.setattr(fc_native, "MIN_WORK", 1)
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 6))
    y = mg.layers.relu(net, mg.layers.fc(net, x, 20, name="a"))
    fast = mg.passes.optimize_for_inference(net)
    assert [op.type for op in fast.section("trunk")] == ["fused_fc"]
    v = rng.standard_normal((3, 6)).astype(np.float32)
    (first,) = fast.infer(feed={"x": v}, fetch=[y.name])
    w = fast.var("a.w")
    w.set(-w.get())
    (second,) = fast.infer(feed={"x": v}, fetch=[y.name])
    b = fast.var("a.b").get()
    np.testing.assert_allclose(second, np.maximum(v @ w.get() + b, 0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(first, second)


def test_supports():
    x32, w32 = np.ones((64, 64), np.float32), np.ones((64, 64), np.float32)
    assert fc_native.supports(x32, w32)
    assert not fc_native.supports(x32.astype(np.float64), w32.astype(np.float64))
    assert not fc_native.supports(np.ones((4, 0), np.float32), np.ones((0, 3), np.float32))


def test_off_with_minigraph_native_0(monkeypatch):
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert not fc_native.supports(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32))
    assert not fc_native.rows_supports(np.ones((1, 64), np.float32), np.ones((64, 64), np.float32))


def test_only_products_that_would_wake_blas_threads_by_default(monkeypatch):
    monkeypatch.undo()
    small = np.ones((8, 64), np.float32), np.ones((64, 64), np.float32)       # 32 K
    large = np.ones((128, 2048), np.float32), np.ones((2048, 17), np.float32)  # 4 M
    assert not fc_native.supports(*small) and fc_native.supports(*large)


def test_few_columns_at_any_size(monkeypatch):
    monkeypatch.undo()
    x = np.ones((8, 64), np.float32)
    assert fc_native.supports(x, np.ones((64, fc_native.COLS_MAX), np.float32))
    assert not fc_native.supports(x, np.ones((64, fc_native.COLS_MAX + 1), np.float32))


# ---- the few-rows kernel on an unpacked weight (fc_rows_f32) -----------------------------

# rows 1-4; x's columns: one block (1, 63) and two (64, 200, 513); columns: 1, short of a
# vector, a vector (8 or 16), past it, every run of 8/4/2/1 vectors and a ragged end
ROWS_SHAPES = [(1, 1, 1), (1, 63, 15), (2, 64, 16), (3, 200, 17), (4, 513, 130), (1, 128, 384),
               (1, 512, 128), (2, 70, 97), (1, 100, 250), (4, 65, 8), (3, 1, 40)]


@pytest.mark.parametrize("m, k, n", ROWS_SHAPES)
@pytest.mark.parametrize("bias, relu", [(True, True), (True, False), (False, False)])
def test_rows_kernel_against_the_float64_reference(m, k, n, bias, relu):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    assert fc_native.rows_supports(x, w, b)
    got = fc_native.rows_forward(x, w, b, relu)
    want = reference(x, w, b, relu)
    assert got.dtype == np.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * np.sqrt(k) * max(1, abs(want).max()))


@pytest.mark.parametrize("m, k, n", [(1, 128, 384), (4, 513, 130), (2, 63, 40)])
def test_rows_kernel_bits_on_any_threads_and_those_of_the_product_then_the_bias(m, k, n,
                                                                                monkeypatch):
    """The same bits on 1-5 threads; with the bias and relu, those of the product alone
    followed by a numpy bias add and maximum (mul + elementwise_add + relu, unfused)."""
    x, w, b = operands(m, k, n)
    outs = on_threads(monkeypatch, lambda: (fc_native.rows_forward(x, w, b, True),
                                            fc_native.rows_forward(x, w)))
    for fused, alone in outs:
        assert fused.tobytes() == outs[0][0].tobytes() and alone.tobytes() == outs[0][1].tobytes()
    assert outs[0][0].tobytes() == np.maximum(outs[0][1] + b, 0).tobytes()


@pytest.mark.parametrize("m, k, n", [(1, 128, 384), (4, 513, 130), (2, 63, 40)])
def test_rows_kernel_residual_bits_on_any_threads(m, k, n, monkeypatch):
    """With a residual: the bits of the product and bias, then a numpy residual add,
    then maximum (mul + elementwise_add + add + relu, unfused), on 1-5 threads."""
    x, w, b = operands(m, k, n)
    res = rng.standard_normal((m, n)).astype(np.float32)
    outs = on_threads(monkeypatch, lambda: fc_native.rows_forward(x, w, b, True, res))
    want = np.maximum(res + fc_native.rows_forward(x, w, b), 0).tobytes()
    assert all(out.tobytes() == want for out in outs)
    assert fc_native.residual_fits(res) and fc_native.residual_fits(None)
    assert not fc_native.residual_fits(res.astype(np.float64))
    assert not fc_native.residual_fits(np.ones((m, 2 * n), np.float32)[:, ::2])


def test_rows_group_bits_and_its_limit():
    """fc_rows_group_f32: each product the bits of fc_rows_f32's with its bias; more than
    GROUP_MAX products is an error before any call."""
    x = rng.standard_normal((2, 70)).astype(np.float32)
    ws = [rng.standard_normal((70, n)).astype(np.float32) for n in (16, 3, 40)]
    bs = [rng.standard_normal(16).astype(np.float32), None,
          rng.standard_normal(40).astype(np.float32)]
    outs = [np.empty((2, w.shape[1]), np.float32) for w in ws]
    fc_native.prepared_rows_group(x, ws, bs, outs)()
    for out, w, b in zip(outs, ws, bs):
        assert out.tobytes() == fc_native.rows_forward(x, w, b).tobytes()
    many = fc_native.GROUP_MAX + 1
    with pytest.raises(ValueError, match=f"1 to {fc_native.GROUP_MAX} products, got {many}"):
        fc_native.prepared_rows_group(x, ws[:1] * many, [None] * many, outs[:1] * many)


def test_rows_kernel_nan_and_infinities_and_a_prepared_call_reads_its_arrays_anew():
    x, w = ones_with_nan_and_inf(3, 80, 20, 1, 2)
    out = np.empty((3, 20), np.float32)
    call = fc_native.prepared_rows(x, w, None, True, out)
    call()
    assert np.isnan(out[1]).all() and out[0, 0] == 80.0 and out[0, 7] == 0.0
    assert np.isinf(out[2, 0]) and out[2, 7] == 0.0
    x[:] = 2.0                          # new values in the same arrays
    w[:, 7] = 0.5
    call()
    assert out[0, 0] == 160.0 and out[1, 7] == 80.0


def test_rows_supports():
    x, w = np.ones((4, 8), np.float32), np.ones((8, 3), np.float32)
    assert fc_native.rows_supports(x, w) and fc_native.rows_supports(x, w, np.ones(3, np.float32))
    assert not fc_native.rows_supports(np.ones((5, 8), np.float32), w)      # too many rows
    assert not fc_native.rows_supports(x.astype(np.float64), w.astype(np.float64))
    assert not fc_native.rows_supports(x, np.ones((3, 8), np.float32).T)   # not C-contiguous
    assert not fc_native.rows_supports(x, w, np.ones(3, np.float64))        # bias dtype
    assert not fc_native.rows_supports(x, w, np.ones(4, np.float32))        # bias length
