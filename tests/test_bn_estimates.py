"""The native running-estimate update (kernels/cpu/bn_estimates.c) against numpy's
(kernels/cpu/batch_norm.blended_estimates, its reference): the same bits for each
rule (first batch, momentum, cumulative average), float32 and float64 estimates,
huge and non-finite statistics; the same error where a value is not finite, the
estimates left as they were; where it does not apply, None; and batch norm's
training step taking it."""
from types import SimpleNamespace

import numpy as np
import pytest

from minigraph.kernels.cpu import batch_norm, bn_estimates, native
from minigraph.schema import OpError

rng = np.random.default_rng(31)

pytestmark = pytest.mark.skipif(
    not bn_estimates.available(),
    reason=f"native kernels not built: {native.reason('bn_estimates')}")

RULES = [(None, 0), (None, 4), (0.9, 3), (0.1, 1), (0.0, 2), (1.0, 2), (0.9, 0)]


def op(momentum, first_batch=True):
    return SimpleNamespace(type="batch_norm", attrs={
        "momentum": momentum, "first_batch_sets_estimates": first_batch})


def both(o, mean, var, n, est_mean, est_var, counter, monkeypatch):
    """(native, numpy) results of updated_estimates: the pair of arrays or the error."""
    def run():
        try:
            return batch_norm.updated_estimates(o, mean, var, n, est_mean, est_var, counter)
        except OpError as e:
            return str(e)
    got = run()
    with monkeypatch.context() as m:
        m.setattr(bn_estimates, "blend", lambda *a: None)
        want = run()
    return got, want


def assert_same(got, want):
    if isinstance(want, str) or isinstance(got, str):
        assert got == want
        return
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("first_batch", [True, False])
@pytest.mark.parametrize("momentum,count", RULES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_bits_as_numpy(dtype, momentum, count, first_batch, monkeypatch):
    for c, magnitude in ((1, 1.0), (16, 1e3), (67, 1e-20), (64, 1e30)):
        mean = rng.standard_normal(c) * magnitude
        var = np.abs(rng.standard_normal(c)) * magnitude
        est_mean = (rng.standard_normal(c) * 3).astype(dtype)
        est_var = np.abs(rng.standard_normal(c)).astype(dtype)
        kept = est_mean.copy(), est_var.copy()
        got, want = both(op(momentum, first_batch), mean, var, int(rng.integers(2, 900)),
                         est_mean, est_var, np.array(count), monkeypatch)
        assert_same(got, want)
        np.testing.assert_array_equal(est_mean, kept[0])     # only read
        np.testing.assert_array_equal(est_var, kept[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", ["nan mean", "inf var", "overflow", "inf estimate"])
def test_not_finite_is_the_same_error(dtype, bad, monkeypatch):
    mean, var = rng.standard_normal(8), np.abs(rng.standard_normal(8))
    est_mean, est_var = np.zeros(8, dtype), np.ones(8, dtype)
    if bad == "nan mean":
        mean[3] = np.nan
    elif bad == "inf var":
        var[5] = np.inf
    elif bad == "overflow":          # finite in float64, infinite in the estimates' dtype
        var[2] = 1e300 if dtype == np.float64 else 1e40
    else:
        est_var[0] = np.inf
    with np.errstate(over="ignore", invalid="ignore"):
        got, want = both(op(0.9), mean, var, 2, est_mean, est_var, np.array(3), monkeypatch)
    assert_same(got, want)
    if bad == "overflow" and dtype == np.float64:
        assert not isinstance(got, str)          # var * 2 = 2e300 is still finite
    else:
        assert "the batch statistics are not finite" in got


def test_where_it_does_not_apply_none():
    c = 6
    mean, var = np.zeros(c), np.ones(c)
    em, ev = np.zeros(c, np.float32), np.ones(c, np.float32)
    rule = ("momentum", 0.9)
    cases = [
        (mean, var, em.astype(np.float16), ev.astype(np.float16)),   # estimates' dtype
        (mean, var, em, ev.astype(np.float64)),                      # dtypes differ
        (mean, var, np.zeros(2 * c, np.float32)[::2], ev),           # not contiguous
        (mean.astype(np.float32), var, em, ev),                      # statistics float32
        (mean[:4], var[:4], em, ev),                                 # lengths differ
        (mean, var, em.reshape(2, 3), ev.reshape(2, 3)),             # not one axis
    ]
    for case in cases:
        assert bn_estimates.blend(rule, *case[:2], 1.0, *case[2:]) is None


def test_a_training_step_takes_it(monkeypatch):
    """batch_norm's CPU forward in training writes the native kernel's estimates."""
    calls = []
    real = bn_estimates.blend
    monkeypatch.setattr(bn_estimates, "blend", lambda *a: calls.append(a[0]) or real(*a))
    x = rng.standard_normal((16, 3, 4, 4)).astype(np.float32)
    est_mean, est_var = np.zeros(3, np.float32), np.ones(3, np.float32)
    counter = np.array(2, np.int64)
    o = SimpleNamespace(type="batch_norm", attrs={
        "momentum": 0.9, "first_batch_sets_estimates": True, "data_layout": "NCHW",
        "epsilon": 1e-5, "use_global_est": False, "is_infer": False})
    batch_norm.forward_cpu(o, {"x": x, "estimated_mean": est_mean, "estimated_var": est_var,
                               "num_batches": counter})
    assert calls == [("momentum", 0.9)] and int(counter) == 3
    mean = x.astype(np.float64).mean(axis=(0, 2, 3))
    unbiased = x.astype(np.float64).var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(est_mean, 0.1 * mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(est_var, 0.9 + 0.1 * unbiased, rtol=1e-5)
