"""The native pooling kernels (kernels/cpu/pool_native.c) against the numpy kernels
they replace (kernels/cpu/pool2d.py, themselves checked against float64 references
and finite differences in test_pool2d.py): the gradient's dx, bit for bit, on tiling,
strided, overlapping and padded windows, ties, NaN and -inf, 1-3 threads; the 2x2
tiles' forward, bit for bit, with NaN and infinities, in blocks of rows and their
remainders; global average pooling against the float64 mean; average pooling and its
gradient, bit for bit; and where the native kernels do not apply, None."""
import numpy as np
import pytest

from minigraph.kernels.cpu import blocks, native, pool_native
from minigraph.kernels.cpu.pool2d import out_hw, pool2d_cpu, pool2d_grad_cpu, tiled_max

rng = np.random.default_rng(5)

pytestmark = pytest.mark.skipif(not pool_native.available(),
                                reason=f"native kernels not built: {native.reason('pool_native')}")

# (x shape, ksize, strides, paddings): tiling 2x2 (float32: eight windows at a time and
# the rest of a row, with masked loads and stores: rows of 19, 17, 14, 7, 5 and 2
# windows; planes 8 wide two rows of windows
# at a time, and the odd row left), a remainder row and column left out,
# overlapping 3x3 windows with padding, strided and padded, one-tap windows, windows
# wider than tall, a window as large as the padded plane
CASES = {
    "2x2 tiling": ((4, 3, 8, 8), (2, 2), (2, 2), (0, 0)),
    "2x2 odd plane": ((2, 3, 7, 9), (2, 2), (2, 2), (0, 0)),
    "2x2 rows of 19": ((2, 3, 6, 38), (2, 2), (2, 2), (0, 0)),
    "2x2 8 wide, 3 rows of windows": ((2, 3, 7, 8), (2, 2), (2, 2), (0, 0)),
    "2x2 odd plane of 17 wide": ((2, 2, 7, 35), (2, 2), (2, 2), (0, 0)),
    "2x2 14x14 planes (rows of 7)": ((3, 5, 14, 14), (2, 2), (2, 2), (0, 0)),
    "2x2 28x28 planes (rows of 14)": ((2, 3, 28, 28), (2, 2), (2, 2), (0, 0)),
    "2x2 rows of 5 and of 2": ((2, 2, 4, 10), (2, 2), (2, 2), (0, 0)),
    "2x2 rows of 2": ((3, 2, 4, 4), (2, 2), (2, 2), (0, 0)),
    "3x3 overlapping": ((2, 4, 6, 5), (3, 3), (1, 1), (1, 1)),
    "3x3 stride 2 padded": ((3, 2, 9, 8), (3, 3), (2, 2), (1, 1)),
    "1x1 stride 2": ((2, 2, 5, 5), (1, 1), (2, 2), (0, 0)),
    "1x3": ((2, 3, 4, 10), (1, 3), (1, 2), (0, 1)),
    "whole plane": ((1, 2, 3, 3), (5, 5), (1, 1), (1, 1)),
}


def attrs_of(ksize, strides, paddings):
    return {"ksize": ksize, "strides": strides, "paddings": paddings, "pool_type": "max",
            "global_pooling": False}


def op_of(attrs):
    return type("Op", (), {"attrs": attrs})()


def numpy_grad(x, dout, attrs, monkeypatch):
    """dx from the numpy kernel (the native kernel switched off)."""
    with monkeypatch.context() as m:
        m.setenv("MINIGRAPH_NATIVE", "0")
        assert pool_native.max_pool_grad(x, dout, attrs, out_hw(x.shape, attrs)) is None
        return pool2d_grad_cpu(op_of(attrs), {"x": x, "dout": dout}, None)["dx"]


def inputs(shape, attrs, dtype, ties=False):
    x = rng.integers(-2, 3, shape) if ties else rng.standard_normal(shape)
    hw = out_hw(shape, attrs)
    dout = rng.standard_normal(shape[:2] + hw)
    return x.astype(dtype), dout.astype(dtype), hw


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_gradient_as_the_numpy_kernel(case, dtype, ties, threads, monkeypatch):
    """Bit for bit the numpy kernel's dx; with ties (few distinct values) the first
    max in row-major tap order takes the gradient."""
    monkeypatch.setattr(pool_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    shape, *geometry = CASES[case]
    attrs = attrs_of(*geometry)
    x, dout, hw = inputs(shape, attrs, dtype, ties)
    got = pool_native.max_pool_grad(x, dout, attrs, hw)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, numpy_grad(x, dout, attrs, monkeypatch))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["2x2 tiling", "2x2 rows of 19", "3x3 overlapping",
                                  "3x3 stride 2 padded"])
def test_nan_and_infinities(case, dtype, monkeypatch):
    """A NaN takes the gradient only as a window's first tap; a window of -inf whose
    first tap is padding passes nothing on; +inf wins."""
    shape, *geometry = CASES[case]
    attrs = attrs_of(*geometry)
    x, dout, hw = inputs(shape, attrs, dtype)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, flat.size // 5, replace=False)] = np.nan
    flat[rng.choice(flat.size, flat.size // 5, replace=False)] = -np.inf
    flat[rng.choice(flat.size, flat.size // 10, replace=False)] = np.inf
    x[0, 0] = -np.inf                                   # a whole plane of -inf
    got = pool_native.max_pool_grad(x, dout, attrs, hw)
    np.testing.assert_array_equal(got, numpy_grad(x, dout, attrs, monkeypatch))


def test_what_the_kernel_does_not_take_returns_none(monkeypatch):
    """float16, a non-contiguous x or dout, mixed dtypes, a dout of the wrong shape,
    native kernels off: None, and the op kernel's numpy path gives the same dx."""
    attrs = attrs_of((2, 2), (2, 2), (0, 0))
    x, dout, hw = inputs((2, 3, 8, 8), attrs, np.float32)
    assert pool_native.max_pool_grad(x.astype(np.float16), dout.astype(np.float16),
                                     attrs, hw) is None
    assert pool_native.max_pool_grad(x[:, ::2], dout[:, ::2], attrs, hw) is None
    assert pool_native.max_pool_grad(x, np.asfortranarray(dout), attrs, hw) is None
    assert pool_native.max_pool_grad(x, dout.astype(np.float64), attrs, hw) is None
    assert pool_native.max_pool_grad(x, dout[:, :, :3], attrs, hw) is None
    np.testing.assert_array_equal(
        pool2d_grad_cpu(op_of(attrs), {"x": x[:, ::2], "dout": dout[:, ::2]}, None)["dx"],
        numpy_grad(np.ascontiguousarray(x[:, ::2]), np.ascontiguousarray(dout[:, ::2]),
                   attrs, monkeypatch))


def test_the_op_kernel_runs_it(monkeypatch):
    """pool2d_grad's CPU kernel takes the native path for a max pool."""
    calls = []
    real = pool_native.max_pool_grad

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(pool_native, "max_pool_grad", counted)
    attrs = attrs_of((2, 2), (2, 2), (0, 0))
    x, dout, _ = inputs((2, 3, 8, 8), attrs, np.float32)
    dx = pool2d_grad_cpu(op_of(attrs), {"x": x, "dout": dout}, None)["dx"]
    assert calls == [1]
    np.testing.assert_array_equal(dx, numpy_grad(x, dout, attrs, monkeypatch))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1, 2, 2), (3, 5, 6, 10), (2, 70, 4, 6), (64, 16, 8, 8),
                                   (3, 1, 2, 8), (2, 3, 4, 36), (4, 3, 28, 28),
                                   (2, 4, 14, 14)])
def test_tiles_forward_is_the_numpy_kernels(shape, dtype, threads, monkeypatch):
    """2x2 windows at stride 2: numpy's tiled max, NaN propagating, bit for bit; rows of
    pairs fewer than, more than and not a multiple of the kernel's block (float64);
    rows of fewer than 8 windows, of 8 and more, and of 8 and a remainder (float32:
    eight at a time, the rest through masked loads; rows of 4 two at a time, an odd
    count of them), on one thread and on three."""
    monkeypatch.setattr(pool_native, "MIN_THREAD_VALUES", 1)
    attrs = attrs_of((2, 2), (2, 2), (0, 0))
    x = rng.standard_normal(shape).astype(dtype)
    flat = x.reshape(-1)
    for value, share in ((np.nan, 7), (np.inf, 9), (-np.inf, 9)):
        flat[rng.choice(flat.size, max(1, flat.size // share), replace=False)] = value
    with blocks.num_threads(threads):
        got = pool_native.max_pool_tiles(x)
    want = tiled_max(x, attrs, out_hw(shape, attrs))
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_tiles_forward_declines_what_it_does_not_take(monkeypatch):
    x = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    assert pool_native.max_pool_tiles(x[:, :, :3]) is None            # odd height
    assert pool_native.max_pool_tiles(x[:, :, :, :5]) is None         # odd width
    assert pool_native.max_pool_tiles(x.astype(np.float16)) is None
    assert pool_native.max_pool_tiles(x[:, ::2]) is None              # not contiguous
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert pool_native.max_pool_tiles(x) is None


# ---- channels last -------------------------------------------------------------------

def nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


# the cases, and channels enough for whole vectors (2x2 tiles: 8 channels at a time
# and the rest one by one)
NHWC_CASES = {**CASES,
              "2x2 tiling, 19 channels": ((2, 19, 6, 8), (2, 2), (2, 2), (0, 0)),
              "2x2 odd plane, 8 channels": ((3, 8, 7, 9), (2, 2), (2, 2), (0, 0)),
              "3x3 overlapping, 11 channels": ((2, 11, 6, 5), (3, 3), (1, 1), (1, 1))}


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(NHWC_CASES))
def test_nhwc_gradient_is_the_nchw_one(case, dtype, ties, threads, monkeypatch):
    """The NHWC kernel (vectorized over channels) gives the NCHW kernel's dx transposed,
    bit for bit, ties included; and the numpy NHWC kernel's."""
    monkeypatch.setattr(pool_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    shape, *geometry = NHWC_CASES[case]
    attrs = attrs_of(*geometry)
    x, dout, hw = inputs(shape, attrs, dtype, ties)
    want = pool_native.max_pool_grad(x, dout, attrs, hw)
    got = pool_native.max_pool_grad(nhwc(x), nhwc(dout), attrs, hw, "NHWC")
    assert got.dtype == dtype and got.shape == nhwc(x).shape
    np.testing.assert_array_equal(got, nhwc(want))
    nhwc_attrs = {**attrs, "data_layout": "NHWC"}
    with monkeypatch.context() as m:
        m.setenv("MINIGRAPH_NATIVE", "0")
        np.testing.assert_array_equal(
            pool2d_grad_cpu(op_of(nhwc_attrs), {"x": nhwc(x), "dout": nhwc(dout)}, None)["dx"],
            got)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["2x2 tiling", "3x3 overlapping", "3x3 stride 2 padded",
                                  "2x2 tiling, 19 channels", "3x3 overlapping, 11 channels"])
def test_nhwc_nan_and_infinities(case, dtype):
    shape, *geometry = NHWC_CASES[case]
    attrs = attrs_of(*geometry)
    x, dout, hw = inputs(shape, attrs, dtype)
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, flat.size // 5, replace=False)] = np.nan
    flat[rng.choice(flat.size, flat.size // 5, replace=False)] = -np.inf
    flat[rng.choice(flat.size, flat.size // 10, replace=False)] = np.inf
    x[0, 0] = -np.inf
    got = pool_native.max_pool_grad(nhwc(x), nhwc(dout), attrs, hw, "NHWC")
    np.testing.assert_array_equal(got, nhwc(pool_native.max_pool_grad(x, dout, attrs, hw)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1, 2, 2), (3, 5, 6, 10), (2, 70, 4, 6), (4, 16, 8, 8)])
def test_nhwc_tiles_forward_is_the_numpy_kernels(shape, dtype):
    attrs = {**attrs_of((2, 2), (2, 2), (0, 0)), "data_layout": "NHWC"}
    x = nhwc(rng.standard_normal(shape).astype(dtype))
    flat = x.reshape(-1)
    for value, share in ((np.nan, 7), (np.inf, 9), (-np.inf, 9)):
        flat[rng.choice(flat.size, max(1, flat.size // share), replace=False)] = value
    got = pool_native.max_pool_tiles(x, "NHWC")
    want = tiled_max(x, attrs, out_hw(x.shape, attrs))
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert pool_native.max_pool_tiles(x[:, :, :-1], "NHWC") is None            # odd width
    assert pool_native.max_pool_grad(x, x, attrs, (1, 1), "NHWC") is None      # wrong dout


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 7, 9), (32, 64, 8, 8), (3, 5, 1, 13),
                                   (2, 2, 4, 4)])
def test_global_average_is_the_float64_mean(shape, threads, monkeypatch):
    """Planes of 1, 63, 64, 13 and 16 values (eight lanes at a time and the rest): the
    float64 mean rounded once, the numpy kernel's bits (data of one scale: every
    float64 sum is exact), NaN and infinities as the mean makes them."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    monkeypatch.setattr(pool_native, "MIN_THREAD_VALUES", 1)
    x = rng.standard_normal(shape).astype(np.float32)
    want = x.astype(np.float64).mean(axis=(2, 3), keepdims=True).astype(np.float32)
    got = pool_native.global_avg(x)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    attrs = {**attrs_of((1, 1), (1, 1), (0, 0)), "pool_type": "avg", "global_pooling": True}
    np.testing.assert_array_equal(pool2d_cpu(op_of(attrs), {"x": x}, None)["out"], want)
    flat = x.reshape(-1)
    for value in (np.nan, np.inf, -np.inf):
        flat[rng.integers(flat.size)] = value
    with np.errstate(invalid="ignore"):
        want = x.astype(np.float64).mean(axis=(2, 3), keepdims=True).astype(np.float32)
    np.testing.assert_array_equal(pool_native.global_avg(x), want)


def test_global_average_declines_what_it_does_not_take(monkeypatch):
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    assert pool_native.global_avg(x.astype(np.float64)) is None
    assert pool_native.global_avg(x[:, :, :, ::2]) is None                 # not contiguous
    assert pool_native.global_avg(x[:, :, :0]) is None                     # empty planes
    assert pool_native.global_avg(x[0]) is None                            # not 4-D
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert pool_native.global_avg(x) is None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_average_pooling_and_its_gradient_are_the_numpy_kernels(case, threads, monkeypatch):
    """float32 average pooling over each window's real elements, and its gradient (the
    shares of overlapping windows added in tap order), bit for bit the numpy kernels'."""
    monkeypatch.setattr(pool_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    shape, *geometry = CASES[case]
    attrs = dict(attrs_of(*geometry), pool_type="avg")
    x, dout, hw = inputs(shape, attrs, np.float32)
    x.reshape(-1)[::7] = np.inf
    dout.reshape(-1)[1::5] = -0.0                      # shares of +0.0 (0 + -0.0 / n)
    dout.reshape(-1)[2::11] = 3e-45                    # subnormal shares, rounded
    got, got_dx = pool_native.avg_pool(x, attrs, hw), pool_native.avg_pool(x, attrs, hw, dout)
    with monkeypatch.context() as m:
        m.setenv("MINIGRAPH_NATIVE", "0")
        assert pool_native.avg_pool(x, attrs, hw) is None
        want = pool2d_cpu(op_of(attrs), {"x": x}, None)["out"]
        want_dx = pool2d_grad_cpu(op_of(attrs), {"x": x, "dout": dout}, None)["dx"]
    assert got.tobytes() == want.tobytes() and got_dx.tobytes() == want_dx.tobytes()


def test_average_pooling_declines_what_it_does_not_take():
    attrs = dict(attrs_of((2, 2), (2, 2), (0, 0)), pool_type="avg")
    x = rng.standard_normal((2, 3, 4, 4))
    assert pool_native.avg_pool(x, attrs, (2, 2)) is None                 # float64
    x = x.astype(np.float32)
    assert pool_native.avg_pool(x[:, :, :, ::2], attrs, (2, 1)) is None   # not contiguous
    assert pool_native.avg_pool(x, attrs, (2, 2), np.zeros((2, 3, 2, 3), np.float32)) is None
