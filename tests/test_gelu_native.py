"""The native float32 gelu and its gradient (kernels/cpu/gelu_native.c) against the
float64 numpy kernels (kernels/cpu/activation.py): within float32's precision over the
whole range, the tails, zeros, infinities and NaN; odd sizes; 1-3 threads, the same
bits; where it does not apply (float64, strided), None; and the op's kernels taking it."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from minigraph.kernels.cpu import activation, blocks, gelu_native, native
from minigraph.kernels.cpu.erf import normal_cdf

pytestmark = pytest.mark.skipif(
    not gelu_native.available(),
    reason=f"native kernels not built: {native.reason('gelu_native')}")


def reference(x):
    x = x.astype(np.float64)
    density = np.exp(-0.5 * np.minimum(np.abs(x), 100.0) ** 2) / math.sqrt(2 * math.pi)
    with np.errstate(invalid="ignore"):
        return x * normal_cdf(x), normal_cdf(x) + x * density


def inputs():
    x = np.concatenate([np.linspace(-12, 12, 24001), -np.geomspace(1e-30, 60, 300),
                        np.geomspace(1e-30, 60, 300), [0.0, -0.0, 3e38, -3e38]])
    return x.astype(np.float32)


def test_within_float32_precision_of_the_float64_kernels():
    x = inputs()
    out, grad = reference(x)
    got = gelu_native.forward(x)
    assert got.dtype == np.float32
    # relative to the value, or to float32's resolution of x where the value is tiny
    err = np.abs(got - out) / np.maximum(np.abs(out), 1e-6 * np.maximum(np.abs(x), 1e-30))
    assert err.max() < 2e-6
    d = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    dx = gelu_native.backward(x, d)
    np.testing.assert_allclose(dx, d * grad, rtol=1e-5, atol=1e-6)


def test_the_left_tail_keeps_its_relative_accuracy():
    x = -np.linspace(3, 12, 91).astype(np.float32)
    out = gelu_native.forward(x)
    np.testing.assert_allclose(out, reference(x)[0], rtol=2e-5)
    assert (out < 0).all()


def test_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45], np.float32)
    out = gelu_native.forward(x)
    assert out[0] == 0 and out[2] == np.inf and np.isnan(out[4])
    dx = gelu_native.backward(np.array([0.0, 50.0, -50.0], np.float32),
                              np.ones(3, np.float32))
    np.testing.assert_allclose(dx, [0.5, 1.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("size", [1, 7, 9, 100003])
def test_odd_sizes_and_threads_give_the_same_bits(size, threads, monkeypatch):
    x = np.random.default_rng(size).standard_normal(size).astype(np.float32) * 4
    want = gelu_native.forward(x)
    monkeypatch.setattr(gelu_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    np.testing.assert_array_equal(gelu_native.forward(x), want)
    np.testing.assert_array_equal(gelu_native.backward(x, x), gelu_native.backward(x[:], x))
    dout = x.copy()
    assert gelu_native.backward(x, dout, dx=dout) is dout       # in place over dout


def test_where_it_does_not_apply():
    assert gelu_native.forward(np.ones(8)) is None                      # float64
    assert gelu_native.forward(np.ones((4, 4), np.float32)[:, ::2]) is None
    assert gelu_native.backward(np.ones(4, np.float32), np.ones(5, np.float32)) is None


def test_the_op_kernels_take_it_and_fall_back(monkeypatch):
    op = SimpleNamespace(attrs={}, wants=lambda slot: True)
    x = np.linspace(-5, 5, 101).astype(np.float32)
    native_out = activation.gelu_cpu(op, {"x": x}, None)["out"]
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    numpy_out = activation.gelu_cpu(op, {"x": x}, None)["out"]
    np.testing.assert_allclose(native_out, numpy_out, rtol=2e-6, atol=1e-7)
    assert numpy_out.dtype == native_out.dtype == np.float32


def test_the_bound_form_gives_the_kernels_bits_on_many_threads():
    """The op's bound form (prepared_forward; minigraph.bound_run), through the op test
    helper: a pass large enough for every thread, odd-sized, then NaN and infinities."""
    from helpers import helper_test_op

    x = np.random.default_rng(1).standard_normal(3 * (1 << 15) + 7).astype(np.float32)
    x[:4] = [np.nan, np.inf, -np.inf, -0.0]
    with blocks.num_threads(3):
        got = helper_test_op("gelu", {"x": x})["out"]
    assert np.isnan(got[0]) and got[1] == np.inf and got[3] == 0.0
