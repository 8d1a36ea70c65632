"""The native dropout forward (kernels/cpu/dropout_native.c) against the numpy kernel
it replaces (Philox words of kernels/cpu/philox.py, itself checked against Random123's
known answers in test_philox.py): the same mask and output bit for bit on odd sizes,
seeds with a step in the high word, 1-3 threads, NaN and infinities; and where the
native kernel does not apply, None."""
import numpy as np
import pytest

from minigraph.kernels.cpu import blocks, dropout, dropout_native, native

rng = np.random.default_rng(9)

pytestmark = pytest.mark.skipif(
    not dropout_native.available(),
    reason=f"native kernels not built: {native.reason('dropout_native')}")


def reference(x, p, seed, step):
    """(out, keep) from the numpy kernel's own functions."""
    keep = dropout.keep_mask(x.size, p, seed, step).reshape(x.shape)
    with np.errstate(invalid="ignore"):                  # NaN * 0, inf * 0
        out = x * (keep.astype(x.dtype) * dropout.scale_factor(p, x.dtype))
    return out, keep.astype(np.uint8)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape, p, seed, step", [
    ((7,), 0.5, 0, 0),                       # not a whole generator call
    ((64, 32, 7, 7), 0.25, 1234, 3),
    ((33, 130), 0.9, 2 ** 31 + 5, 2 ** 32 + 7),   # step past 32 bits wraps
    ((5, 11), 1e-7, 42, 1),
    ((1000,), 0.999999, 7, 0),
])
def test_same_bits_as_the_numpy_kernel(shape, p, seed, step, dtype, threads, monkeypatch):
    monkeypatch.setattr(dropout_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    x = rng.standard_normal(shape).astype(dtype)
    out, keep = dropout_native.forward(x, p, 1.0 / (1.0 - p), dropout.seed_of(seed, step),
                                       dropout.STREAM)
    want_out, want_keep = reference(x, p, seed, step)
    assert out.dtype == dtype and keep.dtype == np.uint8 and out.shape == keep.shape == shape
    np.testing.assert_array_equal(keep, want_keep)
    assert out.tobytes() == want_out.tobytes()          # signs of zeros included


def test_nan_and_infinities_as_numpy():
    """A dropped NaN or infinity is NaN (x * 0), as in the numpy kernel."""
    x = np.array([np.nan, np.inf, -np.inf, -1.0, 0.0, -0.0, 3.0, 1e30] * 8, np.float32)
    out, keep = dropout_native.forward(x, 0.5, 2.0, dropout.seed_of(3, 1), dropout.STREAM)
    want_out, want_keep = reference(x, 0.5, 3, 1)
    np.testing.assert_array_equal(keep, want_keep)
    assert 0 < keep.sum() < keep.size
    assert out.tobytes() == want_out.tobytes()


def test_what_the_kernel_does_not_take_returns_none(monkeypatch):
    x = rng.standard_normal((4, 6))
    args = (0.5, 2.0, 1, dropout.STREAM)
    assert dropout_native.forward(x.astype(np.float16), *args) is None
    assert dropout_native.forward(x[:, ::2], *args) is None
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert dropout_native.forward(x, *args) is None


def test_the_op_kernel_runs_it_and_steps(monkeypatch):
    """dropout's CPU kernel takes the native path, counts the step, and gives the numpy
    path's out and mask."""
    op = type("Op", (), {"attrs": {"is_infer": False, "p": 0.3, "seed": 11}})()
    x = rng.standard_normal((8, 9)).astype(np.float32)

    def run():
        step = np.array(5, np.int64)
        got = dropout.dropout_cpu(op, {"x": x, "step": step}, None)
        assert int(step) == 6
        return got

    calls = []
    real = dropout_native.forward
    monkeypatch.setattr(dropout_native, "forward", lambda *a: calls.append(1) or real(*a))
    native_out = run()
    assert calls == [1]
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    numpy_out = run()
    assert calls == [1, 1]                                 # called, declined
    for name in ("out", "mask"):
        assert native_out[name].dtype == numpy_out[name].dtype
        np.testing.assert_array_equal(native_out[name], numpy_out[name])
