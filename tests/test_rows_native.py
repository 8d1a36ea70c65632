"""The native kernels of rows (kernels/cpu/rows_native.c): the sum over rows of a bias
gradient, numpy's np.add.reduce(a, axis=0, dtype=np.float64) rounded to float32, and
the adds on several threads, numpy's adds, bit for bit."""
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


def bits(a):
    return a.view(np.int32 if a.dtype == np.float32 else np.int64)


def special(shape, dtype):
    """Values of every magnitude, with NaN, infinities, -0.0 and sums that overflow."""
    a = (rng.standard_normal(shape) * rng.choice(np.array([1e-30, 1.0, 1e30]), size=shape))
    a = a.astype(dtype)
    flat = a.reshape(-1)
    odd = np.array([np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).max, np.inf], dtype)
    flat[:len(odd)] = odd[:flat.size]
    return a


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_the_adds_are_numpys_on_any_number_of_threads(monkeypatch, dtype, threads):
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    monkeypatch.setattr(rows_native, "MIN_THREAD_ADD", 1)
    for shape in ((1, 1), (3, 5), (257, 129), (64, 1000), (5, 7, 33)):
        a, b, bias = special(shape, dtype), special(shape, dtype), special(shape[-1:], dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            want, want_bias = np.add(a, b), np.add(a, bias)
            got = rows_native.add(a, b, np.empty_like(a))
            got_bias = rows_native.add_bias(a, bias, np.empty_like(a))
        if min(threads, a.size) == 1:
            assert got is None                                  # numpy's one thread
        else:
            np.testing.assert_array_equal(bits(got), bits(want))
        np.testing.assert_array_equal(bits(got_bias), bits(want_bias))
        into = a.copy()                                         # in place
        assert rows_native.add_bias(into, bias, into) is into
        np.testing.assert_array_equal(bits(into), bits(want_bias))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_a_bias_per_channel_is_numpys_broadcast_add(monkeypatch, dtype, threads):
    """x + bias[c] along axis 1 of NCHW (and axis 0, 2 of other shapes): numpy's bits,
    in place too, on any number of threads."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    monkeypatch.setattr(rows_native, "MIN_THREAD_ADD", 1)
    for shape, axis in (((2, 3, 1, 1), 1), ((5, 7, 4, 9), 1), ((64, 16, 8, 8), 1),
                        ((3, 17, 33), 1), ((6, 5), 0), ((2, 3, 4, 5), 2), ((7, 3, 2), 0)):
        x, bias = special(shape, dtype), special((shape[axis],), dtype)
        view = bias.reshape(bias.shape + (1,) * (len(shape) - axis - 1))
        with np.errstate(invalid="ignore", over="ignore"):
            want = x + view
            got = rows_native.add_channel_bias(x, bias, axis, np.empty_like(x))
            np.testing.assert_array_equal(bits(got), bits(want))
            into = x.copy()
            assert rows_native.add_channel_bias(into, bias, axis, into) is into
        np.testing.assert_array_equal(bits(into), bits(want))


def test_what_a_bias_per_channel_leaves_to_numpy(monkeypatch):
    """The last axis (add_bias's), an axis past the dims, a bias of another length or
    dtype, no values, a view, too few values, MINIGRAPH_NATIVE=0."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    x = values(64, 16 * 64).reshape(64, 16, 8, 8)
    b = x[0, :, 0, 0].copy()
    assert rows_native.add_channel_bias(x, x[0, 0, 0].copy(), 3) is None
    assert rows_native.add_channel_bias(x, b, 4) is None
    assert rows_native.add_channel_bias(x, b, -1) is None
    assert rows_native.add_channel_bias(x, b[:15].copy(), 1) is None
    assert rows_native.add_channel_bias(x, b.astype(np.float64), 1) is None
    assert rows_native.add_channel_bias(x[:0], b, 1) is None
    assert rows_native.add_channel_bias(x[:, :, :, ::2], b, 1) is None
    assert rows_native.add_channel_bias(x[:4], b, 1) is None          # 4096 values
    fresh = rows_native.add_channel_bias(x, b, 1)                      # out None: a new array
    assert fresh is not x and np.array_equal(bits(fresh), bits(x + b.reshape(16, 1, 1)))
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert rows_native.add_channel_bias(x, b, 1) is None


def test_the_ops_add_on_the_threads_with_numpys_bits(monkeypatch):
    """elementwise_add (a bias, and a conv's bias per channel), add and sum (of
    gradients) of arrays large enough."""
    from minigraph.kernels.cpu import binary, elementwise
    from minigraph.schema import KernelContext

    class Op:
        attrs = {"axis": -1}

    calls = []
    real = rows_native._add
    monkeypatch.setattr(rows_native, "_add", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    class Conv:
        attrs = {"axis": 1}

    x, y, z = (special((600, 256), np.float32) for _ in range(3))
    b = special((256,), np.float32)
    planes, c = special((60, 16, 8, 8), np.float32), special((16,), np.float32)
    ctx = KernelContext(None)
    with np.errstate(invalid="ignore", over="ignore"):
        got = [elementwise.elementwise_add_cpu(Op, {"x": x, "y": b}, ctx)["out"],
               binary.add_cpu(Op, {"x": x, "y": y}, ctx)["out"],
               elementwise.sum_cpu(Op, {"x": [x, y, z]}, ctx)["out"],
               elementwise.elementwise_add_cpu(Conv, {"x": planes, "y": c}, ctx)["out"]]
        want = [x + b, x + y, (x + y) + z, planes + c.reshape(16, 1, 1)]
    assert len(calls) == 5
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))


def test_what_the_adds_leave_to_numpy(monkeypatch):
    """Too few values for two threads, other dtypes, mixed dtypes, views, a bias of the
    wrong length, a read-only output, MINIGRAPH_NATIVE=0."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    a = values(600, 256)
    assert rows_native.add(a[:10], a[:10], np.empty_like(a[:10])) is None
    assert rows_native.add_bias(a[:10], a[0], np.empty_like(a[:10])) is None
    assert rows_native.add(a, a.astype(np.float64), np.empty_like(a)) is None
    ints = np.ones(a.shape, np.int32)
    assert rows_native.add(ints, ints, np.empty_like(ints)) is None
    assert rows_native.add(a[:, ::2], a[:, ::2], np.empty((600, 128), np.float32)) is None
    assert rows_native.add_bias(a, a[0, :7], np.empty_like(a)) is None
    frozen = np.empty_like(a)
    frozen.flags.writeable = False
    assert rows_native.add(a, a, frozen) is None
    assert rows_native.add(a, a, np.empty((600, 128), np.float32)) is None   # out's shape
    assert rows_native.add(a, a, np.empty_like(a)) is not None
    fresh = rows_native.add_bias(a, a[0])                     # out None: a new array
    assert fresh is not a and np.array_equal(bits(fresh), bits(a + a[0]))
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert rows_native.add(a, a, np.empty_like(a)) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 1000, 100_003])
def test_sum_squares_against_float64(monkeypatch, dtype, threads, n):
    """Each value squared in float64 and summed: within float64 rounding of numpy's
    float64 sum, on any number of threads, the same each time for a given number."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    monkeypatch.setattr(rows_native, "MIN_THREAD_VALUES", 1)
    a = (rng.standard_normal(n) * rng.choice([1e-20, 1.0, 1e18], size=n)).astype(dtype)
    want = float(np.sum(a.astype(np.float64) ** 2))
    got = rows_native.sum_squares(a)
    assert abs(got - want) <= 1e-13 * want
    assert rows_native.sum_squares(a) == got
    assert rows_native.sum_squares(a.reshape(-1, 1)) == got


@pytest.mark.parametrize("n", [31, 32, 100, 4099])
def test_sum_squares_adds_in_its_documented_order(monkeypatch, n):
    """One thread: four sums of 8 lanes (value i + 8 v + l of each block of 32 in lane l
    of sum v), then lane by lane (sum 0 + sum 1) + (sum 2 + sum 3), the lanes in order,
    then the last n % 32 values in order: the same bits with 8-double vectors and with
    AVX2's 4-double ones. float32 values, whose float64 squares are exact, so a fused
    multiply-add rounds as the separate add; magnitudes far apart, so the order shows."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 1)
    a = (rng.standard_normal(n) * rng.choice([1e-8, 1.0, 1e8], size=n)).astype(np.float32)
    squares = a.astype(np.float64) ** 2
    whole = n // 32 * 32
    sums = np.zeros((4, 8))
    for block in squares[:whole].reshape(-1, 4, 8):
        sums = sums + block
    want = 0.0
    for lane in (sums[0] + sums[1]) + (sums[2] + sums[3]):
        want += lane
    for value in squares[whole:]:
        want += value
    assert rows_native.sum_squares(a) == want


def test_sum_squares_of_non_finite_values_and_what_it_leaves_to_numpy(monkeypatch):
    a = np.ones(100, np.float32)
    a[50] = np.inf
    assert rows_native.sum_squares(a) == np.inf
    a[60] = np.nan
    assert np.isnan(rows_native.sum_squares(a))
    big = np.full(10, 3e38, np.float32)                      # squares overflow float32 only
    assert rows_native.sum_squares(big) == pytest.approx(10 * 3e38 ** 2)
    for other in (np.ones(10, np.int64), np.ones(10, np.float16), np.ones((4, 6))[:, ::2],
                  np.ones(0, np.float32)):
        assert rows_native.sum_squares(other) is None
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert rows_native.sum_squares(np.ones(10)) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [4096, 4103, 300_001])
def test_scale_has_numpys_float64_bits(monkeypatch, dtype, threads, n):
    """x * s as scale_cpu's numpy path computes it (in float64, + 0.0, cast back): the
    same bits, signed zeros, underflow to -0.0, overflow, NaN and infinities included."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    with np.errstate(all="ignore"):
        x = (rng.standard_normal(n) * rng.choice([1e-40, 1e-30, 1.0, 1e30, 3e38], size=n)
             ).astype(dtype)
        x[:7] = [-0.0, 0.0, np.nan, np.inf, -np.inf, -1e-45, 1e-45]
        for s in (0.5, 0.3, -2.0, 1e-30, 3e30, 1e-300, 0.0, -0.0):
            want = (x.astype(np.float64) * s + 0.0).astype(dtype)
            got = rows_native.scale(x, s)
            bits = np.int32 if dtype == np.float32 else np.int64
            np.testing.assert_array_equal(got.view(bits), want.view(bits))


def test_the_scale_op_takes_it_and_what_it_leaves_to_numpy(monkeypatch):
    from minigraph.kernels.cpu import math as math_kernels

    calls = []
    real = rows_native.scale
    monkeypatch.setattr(rows_native, "scale", lambda x, s: calls.append(x.size) or real(x, s))

    class Op:
        attrs = {"scale": 0.5, "bias": 0.0}

    x = rng.standard_normal(10000).astype(np.float32)
    np.testing.assert_array_equal(math_kernels.scale_cpu(Op(), {"x": x}, None)["out"], x * 0.5)
    assert calls == [10000]
    Op.attrs = {"scale": 0.5, "bias": 1.0}                     # a bias: numpy's
    np.testing.assert_allclose(math_kernels.scale_cpu(Op(), {"x": x}, None)["out"], x * 0.5 + 1)
    assert calls == [10000]
    for other in (np.ones(100, np.float32), np.ones(8192, np.float16),
                  np.ones((200, 60))[:, ::2], np.ones(5000, np.int64)):
        assert rows_native.scale(other, 2.0) is None
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert rows_native.scale(np.ones(10000), 2.0) is None
