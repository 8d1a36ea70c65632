"""The native sum over rows of a bias gradient (kernels/cpu/rows_native.c): numpy's
np.add.reduce(a, axis=0, dtype=np.float64) rounded to float32, bit for bit."""
import numpy as np
import pytest

from minigraph.kernels.cpu import blocks, native, rows_native

rng = np.random.default_rng(11)

pytestmark = pytest.mark.skipif(native.library("rows_native") is None,
                                reason=f"native kernels not built: {native.reason('rows_native')}")


def numpy_bits(a):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.add.reduce(a, axis=0, dtype=np.float64).astype(np.float32).view(np.int32)


def values(rows, cols):
    """Magnitudes from 1e-3 to 1e30, so that the order of the adds shows in the bits."""
    scale = rng.choice(np.array([1e-3, 1.0, 1e4, 1e30]), size=(rows, cols))
    return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)


# rows: none, one, a few, many; columns: 2, odd, a vector's (8) and a pass's (64) and
# their remainders, and more than numpy's buffer (8192 values)
@pytest.mark.parametrize("rows, cols", [
    (rows, cols) for rows in (0, 1, 2, 3, 7, 100, 1024, 2049)
    for cols in (2, 3, 7, 8, 9, 63, 64, 65, 129, 384, 1000, 8193, 20000)
    if rows * cols <= 5_000_000])
def test_the_bits_of_numpys_float64_sum(rows, cols):
    a = values(rows, cols)
    np.testing.assert_array_equal(rows_native.sum_rows(a).view(np.int32), numpy_bits(a))


def test_nan_infinities_and_negative_zeros_as_numpy():
    a = values(50, 70)
    a[3, 0], a[4, 1], a[5, 2], a[6, 2] = np.nan, np.inf, -np.inf, np.inf   # inf - inf: NaN
    a[:, 3] = -0.0                                                        # +0.0, not -0.0
    a[:, 4] = np.float32(3e38)                                            # overflows float32
    np.testing.assert_array_equal(rows_native.sum_rows(a).view(np.int32), numpy_bits(a))


def test_the_same_bits_on_any_number_of_threads(monkeypatch):
    a = values(300, 1000)
    outs = []
    for threads in (1, 2, 3, 7):
        monkeypatch.setattr(blocks, "get_num_threads", lambda t=threads: t)
        monkeypatch.setattr(rows_native, "MIN_THREAD_VALUES", 1)
        outs.append(rows_native.sum_rows(a))
    for out in outs[1:]:
        np.testing.assert_array_equal(out.view(np.int32), outs[0].view(np.int32))


def test_what_it_leaves_to_numpy(monkeypatch):
    """One column (numpy sums it pairwise), float64, a non-contiguous view, other ranks,
    and MINIGRAPH_NATIVE=0."""
    a = values(40, 6)
    for other in (a[:, :1], a.astype(np.float64), a[:, ::2], a.reshape(-1), a.reshape(4, 10, 6)):
        assert rows_native.sum_rows(other) is None
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert rows_native.sum_rows(a) is None
