"""The native batch-norm kernels (kernels/cpu/bn_native.c) against the float64
references: statistics, normalisation, gradient sums and the input gradient, alone
and fused, on odd shapes (vector tails, runs longer than a block, tiles of many
channels, one channel), NCHW and NHWC / (N, C) views, offset data, 1-3 threads, zero
rows, float32 and float64; determinism, bad arguments, threads and forks; and the
batch_norm kernels on both engines (the native kernels and the numpy engine)."""
from types import SimpleNamespace

import numpy as np
import pytest
from references import batch_norm_grad, batch_stats, bn_normalize
from thread_helpers import all_right_from_threads, run_in_forked_child

from minigraph.kernels.cpu import batch_norm as bn_kernels
from minigraph.kernels.cpu import batch_norm_stats, blocks, bn_native, native

rng = np.random.default_rng(29)
EPS = 1e-5

pytestmark = pytest.mark.skipif(not bn_native.available(),
                                reason=f"native kernels not built: {native.reason('bn_native')}")

# (layout, x shape): odd inner sizes (vector tails), inner longer than a block of sums,
# small inner with more channels than a tile takes, one channel, NHWC and (N, C) views
# (inner 1: rows split between threads), channels not a multiple of a vector, few rows
CASES = {
    "NCHW 5x3x7": ("NCHW", (5, 3, 7)),
    "NCHW 4x6x3x3": ("NCHW", (4, 6, 3, 3)),
    "NCHW 3x2x1500": ("NCHW", (3, 2, 1500)),
    "NCHW 30x40x2x2": ("NCHW", (30, 40, 2, 2)),
    "NCHW 2x1x17x19": ("NCHW", (2, 1, 17, 19)),
    "NHWC 7x5x4x3": ("NHWC", (7, 5, 4, 3)),
    "NC 33x70": ("NCHW", (33, 70)),
    "NC 2x5": ("NCHW", (2, 5)),
    "NCHW 3x5x1x1": ("NCHW", (3, 5, 1, 1)),
}


@pytest.fixture(params=[1, 2, 3])
def threads(request, monkeypatch):
    """Every call on `threads` threads, however small (MIN_THREAD_VALUES would keep
    these on one)."""
    monkeypatch.setattr(bn_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: request.param)
    return request.param


def inputs(case, dtype, offset=1.0):
    """(layout, x, dy, x3, dy3, scale, bias): x around `offset`, dy offset too (a plain
    sum of dy keeps its digits only if the kernels sum it well)."""
    layout, shape = CASES[case] if isinstance(case, str) else case
    x = (rng.standard_normal(shape) * 2 + offset).astype(dtype)
    dy = (rng.standard_normal(shape) + 0.5).astype(dtype)
    c = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias = rng.uniform(0.5, 2.0, c), rng.standard_normal(c)
    return (layout, x, dy, batch_norm_stats.as_3d(x, layout), batch_norm_stats.as_3d(dy, layout),
            scale, bias)


def close(got, want, dtype, count=1):
    """got against the float64 `want`; `count`: values summed into each."""
    assert got.shape == want.shape
    tol = 2e-5 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(got, want, rtol=tol * 5, atol=tol * 5 * max(1.0, count) ** 0.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_statistics_and_normalisation(case, dtype, threads):
    """The statistics, y fused with them, and y from other statistics (inference; a
    mean not representable in x's dtype)."""
    layout, x, _, x3, _, scale, bias = inputs(case, dtype)
    want_mean, want_var, n = batch_stats(x, layout)
    got_n, mean, m2 = bn_native.local_stats(x3)
    assert got_n == n and mean.dtype == m2.dtype == np.float64
    close(mean, want_mean, dtype)
    close(m2 / n, want_var, dtype)
    y = np.empty_like(x)
    fused = bn_native.local_stats(x3, EPS, scale, bias, batch_norm_stats.as_3d(y, layout))
    for a, b in zip(fused, (got_n, mean, m2), strict=True):
        np.testing.assert_array_equal(a, b)
    close(y, bn_normalize(x, scale, bias, want_mean, want_var, EPS, layout), dtype)
    mean, var = rng.standard_normal(scale.shape) + 1 / 3, rng.uniform(0.5, 2.0, scale.shape)
    k = scale / np.sqrt(var + EPS)
    assert bn_native.normalize(x3, mean, k, bias, batch_norm_stats.as_3d(y, layout))
    close(y, bn_normalize(x, scale, bias, mean, var, EPS, layout), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_gradient_sums_and_the_fused_backward(case, dtype, threads):
    layout, x, dy, x3, dy3, scale, _ = inputs(case, dtype)
    mean, var, n = batch_stats(x, layout)
    mean = mean + 1e-3                    # float64, not representable in x's dtype
    invstd = 1 / np.sqrt(var + EPS)
    want_dx, want_dscale, want_dbias = batch_norm_grad(x, dy, scale, mean, var, EPS, layout,
                                                       False)
    got_n, s_dy, s_dyx = bn_native.grad_sums(x3, dy3, mean)
    assert got_n == n
    close(s_dy, want_dbias, dtype, n)
    close(s_dyx * invstd, want_dscale, dtype, n)
    dx = np.empty_like(x)
    fused = bn_native.grad_sums(x3, dy3, mean, invstd, scale, batch_norm_stats.as_3d(dx, layout))
    for a, b in zip(fused, (got_n, s_dy, s_dyx), strict=True):
        np.testing.assert_array_equal(a, b)
    close(dx, want_dx, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_input_gradient_into_dy_and_with_constant_statistics(case, dtype, threads):
    layout, x, dy, x3, dy3, scale, _ = inputs(case, dtype)
    mean, var, n = batch_stats(x, layout)
    invstd = 1 / np.sqrt(var + EPS)
    want_dx = batch_norm_grad(x, dy, scale, mean, var, EPS, layout, False)[0]
    _, s_dy, s_dyx = bn_native.grad_sums(x3, dy3, mean)
    k_x, k_c = -scale * invstd ** 3 * s_dyx / n, -scale * invstd * s_dy / n
    into = dy.copy()
    into3 = batch_norm_stats.as_3d(into, layout)
    assert bn_native.input_grad(x3, into3, mean, scale * invstd, k_x, k_c, into3)
    close(into, want_dx, dtype)
    dx = np.empty_like(x)
    assert bn_native.input_grad(x3, dy3, mean, scale * invstd, None, None,
                                batch_norm_stats.as_3d(dx, layout))
    close(dx, batch_norm_grad(x, dy, scale, mean, var, EPS, layout, True)[0], dtype)


@pytest.mark.parametrize("case", ["NCHW 4x6x3x3", "NCHW 3x2x1500", "NHWC 7x5x4x3", "NC 33x70"])
def test_offset_data_keeps_its_digits(case, threads):
    """|mean| / std = 1e4 in float32: the variance to 1e-3 relative (shifted sums,
    never E[x^2] - E[x]^2); the gradient sums about the float64 mean, and y and dx,
    fused or not, as exact as float32 allows (x is centred on the mean rounded to
    float32, a step of about 1e-3 here, and the rounding is corrected in the constants)."""
    layout, shape = CASES[case]
    x = (1e4 + rng.standard_normal(shape)).astype(np.float32)
    dy = (0.7 * (x - 1e4) + rng.standard_normal(shape) + 0.5).astype(np.float32)
    x3, dy3 = batch_norm_stats.as_3d(x, layout), batch_norm_stats.as_3d(dy, layout)
    c = x3.shape[1]
    scale, bias = rng.uniform(0.5, 2.0, c), rng.standard_normal(c)
    want_mean, want_var, n = batch_stats(x, layout)
    y = np.empty_like(x)
    _, mean, m2 = bn_native.local_stats(x3, EPS, scale, bias, batch_norm_stats.as_3d(y, layout))
    np.testing.assert_allclose(m2 / n, want_var, rtol=1e-3)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-9)
    var, invstd = m2 / n, 1 / np.sqrt(m2 / n + EPS)
    want_y = bn_normalize(x, scale, bias, mean, var, EPS, layout)   # at the kernel's statistics
    np.testing.assert_allclose(y, want_y, atol=2e-5 * np.abs(want_y).max())
    y = np.empty_like(x)
    bn_native.normalize(x3, mean, invstd * scale, bias, batch_norm_stats.as_3d(y, layout))
    np.testing.assert_allclose(y, want_y, atol=2e-5 * np.abs(want_y).max())
    _, s_dy, s_dyx = bn_native.grad_sums(x3, dy3, want_mean)
    dy64 = dy3.astype(np.float64)
    np.testing.assert_allclose(s_dy, dy64.sum(axis=(0, 2)), atol=1e-6 * np.abs(dy64).sum())
    np.testing.assert_allclose(s_dyx, (dy64 * (x3 - want_mean[:, None])).sum(axis=(0, 2)),
                               rtol=1e-5)
    want_dx = batch_norm_grad(x, dy, scale, mean, var, EPS, layout, False)[0]
    dx = np.empty_like(x)
    bn_native.grad_sums(x3, dy3, mean, invstd, scale, batch_norm_stats.as_3d(dx, layout))
    np.testing.assert_allclose(dx, want_dx, atol=2e-5 * np.abs(want_dx).max())
    _, s_dy, s_dyx = bn_native.grad_sums(x3, dy3, mean)
    dx = np.empty_like(x)
    bn_native.input_grad(x3, dy3, mean, scale * invstd, -scale * invstd ** 3 * s_dyx / n,
                         -scale * invstd * s_dy / n, batch_norm_stats.as_3d(dx, layout))
    np.testing.assert_allclose(dx, want_dx, atol=2e-5 * np.abs(want_dx).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(0, 3, 4), (0, 5, 1), (4, 0, 3), (3, 2, 0)])
def test_no_values(shape, dtype, threads):
    """A rank with no rows of a synced batch (n = 0: zeros), no channels, no inner
    values: nothing is read or written; n counts the values of a channel."""
    x = np.zeros(shape, dtype)
    c = shape[1]
    for n, a, b in (bn_native.local_stats(x), bn_native.grad_sums(x, x, np.zeros(c)),
                    bn_native.local_stats(x, EPS, np.ones(c), np.zeros(c), np.empty_like(x)),
                    bn_native.grad_sums(x, x, np.zeros(c), np.ones(c), np.ones(c),
                                        np.empty_like(x))):
        assert n == shape[0] * shape[2] and a.shape == b.shape == (c,)
        assert not a.any() and not b.any()
    assert bn_native.normalize(x, np.zeros(c), np.ones(c), np.zeros(c), np.empty_like(x))
    assert bn_native.input_grad(x, x, np.zeros(c), np.ones(c), np.ones(c), np.ones(c),
                                np.empty_like(x))


def test_two_values_and_constant_channels(threads):
    """n = 2 (the least training takes) and a channel of one repeated value: variance
    0 exactly, y = bias, dx = 0."""
    x = np.array([[1.0, 5.0, 2.0], [3.0, 5.0, -2.0]], np.float32)[:, :, None]
    n, mean, m2 = bn_native.local_stats(x)
    assert n == 2
    np.testing.assert_array_equal(mean, [2.0, 5.0, 0.0])
    np.testing.assert_array_equal(m2, [2.0, 0.0, 8.0])
    y = np.empty_like(x)
    bn_native.local_stats(x, EPS, np.full(3, 2.0), np.array([0.0, 7.0, 1.0]), y)
    assert y[0, 1, 0] == y[1, 1, 0] == 7.0
    dx = np.empty_like(x)
    bn_native.grad_sums(x, np.ones_like(x), mean, 1 / np.sqrt(m2 / n + EPS), np.ones(3), dx)
    np.testing.assert_allclose(dx, 0, atol=1e-6)


@pytest.mark.parametrize("case", ["NCHW 30x40x2x2", "NCHW 3x2x1500", "NHWC 7x5x4x3",
                                  "NC 33x70"])
def test_results_are_deterministic(case, monkeypatch):
    """One thread count gives one result, bit for bit; with inner > 1 the threads split
    the channels and every count gives the same bits; with inner 1 other counts differ
    only by the rounding of the sums."""
    monkeypatch.setattr(bn_native, "MIN_THREAD_VALUES", 1)
    layout, x, dy, x3, dy3, scale, bias = inputs(case, np.float32)

    def run(count):
        monkeypatch.setattr(blocks, "get_num_threads", lambda: count)
        y, dx = np.empty_like(x3), np.empty_like(x3)
        n, mean, m2 = bn_native.local_stats(x3, EPS, scale, bias, y)
        _, s_dy, s_dyx = bn_native.grad_sums(x3, dy3, mean, 1 / np.sqrt(m2 / n + EPS), scale, dx)
        return [y, mean, m2, dx, s_dy, s_dyx]

    one = run(1)
    for count in (1, 2, 3):
        first = run(count)
        for a, b in zip(first, run(count), strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(first, one, strict=True):
            if x3.shape[2] > 1:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_small_work_stays_on_few_threads(monkeypatch):
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 16)
    monkeypatch.setattr(bn_native, "MIN_THREAD_VALUES", 1000)
    assert bn_native.threads_for(999, 64, 49) == 1
    assert bn_native.threads_for(7500, 64, 49) == 7
    assert bn_native.threads_for(10 ** 9, 64, 49) == 16
    assert bn_native.threads_for(10 ** 9, 3, 49) == 3          # channels split: one each
    assert bn_native.threads_for(10 ** 9, 3, 1) == 16          # rows split


def test_what_the_kernels_do_not_take_returns_none(monkeypatch):
    """float16, views that are not C-contiguous, mixed dtypes, and MINIGRAPH_NATIVE=0:
    None or False, nothing written (the caller runs the numpy engine)."""
    x, strided = np.ones((2, 3, 4), np.float32), np.ones((2, 3, 8), np.float32)[:, :, ::2]
    out = np.full_like(x, 7)
    assert bn_native.local_stats(x.astype(np.float16)) is None
    assert bn_native.local_stats(strided) is None
    assert bn_native.grad_sums(x, x.astype(np.float64), np.zeros(3)) is None
    assert not bn_native.normalize(x, np.zeros(3), np.ones(3), np.zeros(3), out.astype(float))
    assert bn_native.local_stats(x, EPS, np.ones(3), np.zeros(3), strided) is None
    assert (strided == 1).all()
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert bn_native.local_stats(x) is None
    assert not bn_native.input_grad(x, x, np.zeros(3), np.ones(3), None, None, out)
    assert not bn_native.available()
    assert (out == 7).all()


def test_wrong_shapes_are_an_error_naming_the_argument():
    x = np.zeros((4, 3, 5), np.float32)
    with pytest.raises(ValueError, match=r"grad_sums: dy has shape \(4, 3, 4\), expected \(4"):
        bn_native.grad_sums(x, np.zeros((4, 3, 4), np.float32), np.zeros(3))
    with pytest.raises(ValueError, match=r"bn_native.normalize: k has shape \(2,\), expected"):
        bn_native.normalize(x, np.zeros(3), np.ones(2), np.zeros(3), np.empty_like(x))
    with pytest.raises(ValueError, match=r"local_stats: x has shape \(4, 15\), expected a 3-D"):
        bn_native.local_stats(x.reshape(4, 15))
    with pytest.raises(ValueError, match=r"bn_native.input_grad: out has shape"):
        bn_native.input_grad(x, x, np.zeros(3), np.ones(3), None, None, x[:2])


def test_calls_from_several_threads_at_once(monkeypatch):
    """One call at a time uses the kernels' worker pool; the others start threads of
    their own: every result is right."""
    monkeypatch.setattr(bn_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    _, x, _, x3, _, scale, bias = inputs("NCHW 30x40x2x2", np.float32)
    want = np.empty_like(x3)
    bn_native.local_stats(x3, EPS, scale, bias, want)

    def right():
        y = np.empty_like(x3)
        bn_native.local_stats(x3, EPS, scale, bias, y)
        return np.array_equal(y, want)

    assert all_right_from_threads(right)


def _forked_stats(queue):
    bn_native.MIN_THREAD_VALUES = 1
    blocks.get_num_threads = lambda: 3
    _, mean, m2 = bn_native.local_stats(np.arange(60.0).reshape(2, 3, 10))
    queue.put([float(v) for v in (*mean, *m2)])


def test_a_forked_child_runs_threaded_kernels(monkeypatch):
    """The worker pool's threads are not in a forked child: it starts its own
    (the test fails by its timeout if the child waits on the parent's)."""
    monkeypatch.setattr(bn_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 3)
    bn_native.local_stats(rng.standard_normal((3, 6, 50)))
    code, got = run_in_forked_child(_forked_stats)
    assert code == 0
    x = np.arange(60.0).reshape(2, 3, 10)
    want = batch_stats(x, "NCHW")
    assert got == pytest.approx([*want[0], *(want[1] * 20)])


# ---- the batch_norm kernels on both engines --------------------------------------------------

@pytest.fixture(params=["native", "numpy"])
def engine(request, monkeypatch):
    """The engine batch norm runs on: the native kernels or the numpy engine
    (MINIGRAPH_NATIVE=0); two threads, and the numpy engine's blocks on small inputs."""
    monkeypatch.setattr(bn_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    monkeypatch.setattr(batch_norm_stats, "SMALL_VALUES", 0)
    if request.param == "numpy":
        monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    return request.param


def bn_op(layout, **attrs):
    """A stand-in for a batch_norm op (what its CPU kernels read)."""
    attrs = {"is_infer": False, "use_global_est": False, "epsilon": EPS, "momentum": 0.9,
             "data_layout": layout, **attrs}
    return SimpleNamespace(type="batch_norm", attrs=attrs, wants=lambda slot: True)


def identity(*sums):
    """A `combine` of one rank: the unfused path a synced batch norm takes."""
    return sums


@pytest.mark.parametrize("combine", [None, identity])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", ["NCHW 4x6x3x3", "NHWC 7x5x4x3", "NC 33x70"])
def test_forward_and_backward_kernels(engine, case, dtype, combine):
    """Training forward and backward, fused (one process) or not (a combine), against
    the float64 references; dx into dy when dy is handed over."""
    layout, x, dy, *_ = inputs(case, np.float64, offset=3.0)
    x, dy = x.astype(dtype), dy.astype(dtype)
    c = x.shape[1] if layout == "NCHW" else x.shape[-1]
    scale, bias = rng.uniform(0.5, 2.0, c).astype(dtype), rng.standard_normal(c).astype(dtype)
    est_mean, est_var, counter = np.zeros(c, dtype), np.ones(c, dtype), np.array(3)
    op = bn_op(layout)
    ins = {"x": x, "estimated_mean": est_mean, "estimated_var": est_var, "scale": scale,
           "bias": bias, "num_batches": counter}
    out = bn_kernels.forward_cpu(op, ins, combine=combine)
    mean, var, _ = batch_stats(x, layout)
    tol = {np.float16: 2e-3, np.float32: 1e-4, np.float64: 1e-10}[dtype]
    assert out["y"].dtype == dtype and int(counter) == 4
    np.testing.assert_allclose(out["y"], bn_normalize(x, scale, bias, mean, var, EPS, layout),
                               rtol=tol * 10, atol=tol * 10)
    np.testing.assert_allclose(est_mean, 0.1 * mean, rtol=tol, atol=tol)
    ins = {"x": x, "dy": dy.copy(), "scale": scale, "mean": out["batch_mean"],
           "var": out["batch_var"]}
    grads = bn_kernels.backward_cpu(op, ins, combine=combine, donated=("dy",))
    want = batch_norm_grad(x, dy, scale, out["batch_mean"], out["batch_var"], EPS, layout, False)
    n = x.size // c
    for name, w, count in zip(("dx", "dscale", "dbias"), want, (1, n, n), strict=True):
        assert grads[name].dtype == dtype
        np.testing.assert_allclose(grads[name], w, rtol=tol * 10, atol=tol * 10 * count ** 0.5,
                                   err_msg=name)
    if dtype != np.float16:
        assert grads["dx"] is ins["dy"]                 # written into the handed-over dy


@pytest.mark.parametrize("case", ["NCHW 4x6x3x3", "NHWC 7x5x4x3"])
def test_the_engines_agree(case, monkeypatch):
    """The batch_norm kernels in float32, offset data: native against numpy."""
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    layout, x, dy, *_ = inputs(case, np.float32, offset=300.0)
    c = x.shape[1] if layout == "NCHW" else x.shape[-1]
    scale, bias = rng.uniform(0.5, 2.0, c).astype(np.float32), np.ones(c, np.float32)

    def run():
        ins = {"x": x, "estimated_mean": np.zeros(c, np.float32),
               "estimated_var": np.ones(c, np.float32), "scale": scale, "bias": bias}
        train = bn_kernels.forward_cpu(bn_op(layout), ins)
        infer = bn_kernels.forward_cpu(bn_op(layout, is_infer=True), ins)
        yield from (train["y"], train["batch_mean"], train["batch_var"], infer["y"])
        for attrs in ({}, {"use_global_est": True}):
            grads = bn_kernels.backward_cpu(bn_op(layout, **attrs), {
                "x": x, "dy": dy, "scale": scale, "mean": train["batch_mean"],
                "var": train["batch_var"]})
            yield from (grads["dx"], grads["dscale"], grads["dbias"])

    native_out = list(run())
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    numpy_out = list(run())
    for got, want in zip(native_out, numpy_out, strict=True):
        assert got.dtype == want.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
