"""The native normalisation kernels (kernels/cpu/norm_native.c) against a float64
reference: the rows' statistics, the normalisation with its affine, and the gradient
on odd shapes, offset data, 1-3 threads, without scale or bias, zero rows and rows of
one value; determinism, bad arguments, threads and forks; and the ops on both
engines (the native kernels and the numpy engine)."""
import numpy as np
import pytest
from helpers import helper_test_op
from references_norms import group_norm as gn_reference
from references_norms import instance_norm as in_reference
from references_norms import layer_norm as ln_reference
from thread_helpers import all_right_from_threads, run_in_forked_child

from minigraph.kernels.cpu import blocks, native, norm_native

rng = np.random.default_rng(11)
EPS = 1e-5

pytestmark = pytest.mark.skipif(not norm_native.available(),
                                reason=f"native kernels not built: {native.reason('norm_native')}")


def layer(rows, length):
    """(rows, L, post, size) of a layer_norm."""
    return rows, length, 1, length


def group(n, c, groups, spatial):
    """(rows, L, post, size) of a group_norm of x (n, c, spatial)."""
    return n * groups, c // groups * spatial, spatial, c


# odd row lengths (vector tails), rows too few to share out whole (cut between threads,
# one part inside one row), many short rows (whole rows per thread, in groups), runs
# longer than a tile of per-index sums, groups and instances, a 2-D group_norm (spatial
# size 1), one sample
CASES = {
    "layer 5x7": layer(5, 7),
    "layer 3x1000": layer(3, 1000),
    "layer 1x5000": layer(1, 5000),
    "layer 64x96": layer(64, 96),
    "layer 2x4500": layer(2, 4500),
    "group 3x6x2x25": group(3, 6, 2, 25),
    "instance 2x4x37": group(2, 4, 4, 37),
    "group 2-D 4x6x2": group(4, 6, 2, 1),
    "instance 1x8x33": group(1, 8, 8, 33),
}


@pytest.fixture(params=[1, 2, 3])
def threads(request, monkeypatch):
    """Every call on `threads` threads, however small (MIN_THREAD_VALUES would keep
    these on one)."""
    monkeypatch.setattr(norm_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: request.param)
    return request.param


def affine_index(shape, post, size):
    return (np.arange(int(np.prod(shape))).reshape(shape) // post) % size


def reference(x, dy, scale, bias, post, size, mean=None, var=None):
    """float64 {y, mean, variance, dx, dscale, dbias}; the gradient from the given
    statistics (default: x's own)."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    own_mean, own_var = x.mean(axis=1), x.var(axis=1)
    mean = own_mean if mean is None else mean.astype(np.float64)
    var = own_var if var is None else var.astype(np.float64)
    a = affine_index(x.shape, post, size)
    s = 1.0 if scale is None else scale.astype(np.float64)[a]
    xhat = (x - mean[:, None]) / np.sqrt(var[:, None] + EPS)
    own_xhat = (x - own_mean[:, None]) / np.sqrt(own_var[:, None] + EPS)
    y = own_xhat * s + (0.0 if bias is None else bias.astype(np.float64)[a])
    g = dy * s
    dx = (g - g.mean(axis=1, keepdims=True)
          - xhat * (g * xhat).mean(axis=1, keepdims=True)) / np.sqrt(var[:, None] + EPS)
    return {"y": y, "mean": own_mean, "variance": own_var, "dx": dx,
            "dscale": np.bincount(a.ravel(), (dy * xhat).ravel(), size),
            "dbias": np.bincount(a.ravel(), dy.ravel(), size)}


def inputs(case, dtype, offset=1.0):
    rows, length, post, size = CASES[case] if isinstance(case, str) else case
    x = (rng.standard_normal((rows, length)) * 2 + offset).astype(dtype)
    dy = rng.standard_normal((rows, length)).astype(dtype)
    scale = rng.uniform(0.5, 2.0, size).astype(dtype)
    bias = rng.standard_normal(size).astype(dtype)
    return x, dy, scale, bias, post, size


def close(got, want, dtype, count=1):
    """got (in `dtype`) against the float64 `want`; `count`: values summed into each."""
    assert got.dtype == dtype and got.shape == want.shape
    tol = 2e-5 if dtype == np.float32 else 1e-11
    np.testing.assert_allclose(got, want, rtol=tol * 5, atol=tol * 5 * max(1.0, count) ** 0.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_forward_against_the_float64_reference(case, dtype, threads):
    x, dy, scale, bias, post, size = inputs(case, dtype)
    y, (mean, var) = norm_native.forward(x, EPS, scale, bias, post=post, size=size)
    want = reference(x, dy, scale, bias, post, size)
    close(y, want["y"], dtype)
    close(mean, want["mean"], dtype)
    close(var, want["variance"], dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES)
def test_backward_against_the_float64_reference(case, dtype, threads):
    x, dy, scale, bias, post, size = inputs(case, dtype)
    _, (mean, var) = norm_native.forward(x, EPS, want_y=False)
    got = norm_native.backward(x, dy, mean, var, EPS, scale, post=post, size=size,
                               want=("dx", "dscale", "dbias"))
    want = reference(x, dy, scale, bias, post, size, mean, var)
    close(got["dx"], want["dx"], dtype)
    for name in ("dscale", "dbias"):
        close(got[name], want[name], dtype, x.size // size)


@pytest.mark.parametrize("case", ["layer 5x7", "layer 1x5000", "group 3x6x2x25",
                                  "group 2-D 4x6x2"])
@pytest.mark.parametrize("affine", ["none", "scale", "bias"])
def test_without_scale_or_bias(case, affine, threads):
    x, dy, scale, bias, post, size = inputs(case, np.float64)
    scale = scale if affine == "scale" else None
    bias = bias if affine == "bias" else None
    y, (mean, var) = norm_native.forward(x, EPS, scale, bias, post=post, size=size)
    want = reference(x, dy, scale, bias, post, size, mean, var)
    close(y, want["y"], np.float64)
    got = norm_native.backward(x, dy, mean, var, EPS, scale, post=post, size=size,
                               want=("dx", "dbias"))
    assert set(got) == {"dx", "dbias"}
    close(got["dx"], want["dx"], np.float64)
    close(got["dbias"], want["dbias"], np.float64, x.size // size)


@pytest.mark.parametrize("want", [("dx",), ("dscale",), ("dbias",), ("dscale", "dbias")])
def test_each_gradient_alone(want, threads):
    x, dy, scale, bias, post, size = inputs("group 3x6x2x25", np.float64)
    _, (mean, var) = norm_native.forward(x, EPS, want_y=False)
    got = norm_native.backward(x, dy, mean, var, EPS, scale, post=post, size=size, want=want)
    full = reference(x, dy, scale, bias, post, size, mean, var)
    assert set(got) == set(want)
    for name in want:
        close(got[name], full[name], np.float64, x.size // size)


@pytest.mark.parametrize("case", ["layer 1x5000", "layer 64x96", "group 3x6x2x25"])
def test_offset_data_keeps_its_digits(case, threads):
    """|mean| / std = 1e4 in float32: the variance to 1e-3 relative (shifted sums,
    never E[x^2] - E[x]^2), y and dx centred before they are scaled."""
    rows, length, post, size = CASES[case]
    x = (1e4 + rng.standard_normal((rows, length))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    y, (mean, var) = norm_native.forward(x, EPS, post=post, size=size)
    want = reference(x, dy, None, None, post, size)
    np.testing.assert_allclose(var, want["variance"], rtol=1e-3)
    np.testing.assert_allclose(mean, want["mean"], rtol=1e-6)
    np.testing.assert_allclose(y, want["y"], atol=2e-3)
    dx = norm_native.backward(x, dy, mean, var, EPS, post=post, size=size)["dx"]
    np.testing.assert_allclose(dx, reference(x, dy, None, None, post, size, mean, var)["dx"],
                               atol=2e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_rows_and_empty_rows(dtype, threads):
    for shape in ((0, 7), (3, 0)):
        x = np.zeros(shape, dtype)
        y, (mean, var) = norm_native.forward(x, EPS, np.ones(shape[1], dtype))
        assert y.shape == shape and y.dtype == dtype
        np.testing.assert_array_equal(mean, np.zeros(shape[0]))
        np.testing.assert_array_equal(var, np.zeros(shape[0]))
        got = norm_native.backward(x, x, mean, var, EPS, np.ones(shape[1], dtype),
                                   want=("dx", "dscale", "dbias"))
        assert got["dx"].shape == shape
        np.testing.assert_array_equal(got["dscale"], np.zeros(shape[1]))
        np.testing.assert_array_equal(got["dbias"], np.zeros(shape[1]))


def test_rows_of_one_value(threads):
    """A row of one value: variance 0, y = bias, dx = 0 (to rounding: invstd is
    1 / sqrt(eps) there)."""
    x, dy, scale, bias, post, size = inputs(layer(5, 1), np.float32)
    y, (mean, var) = norm_native.forward(x, EPS, scale, bias)
    np.testing.assert_array_equal(var, 0)
    np.testing.assert_array_equal(mean, x[:, 0])
    np.testing.assert_allclose(y[:, 0], np.full(5, bias[0]), rtol=1e-6)
    got = norm_native.backward(x, dy, mean, var, EPS, scale, want=("dx", "dbias"))
    np.testing.assert_allclose(got["dx"], 0, atol=1e-4)
    np.testing.assert_allclose(got["dbias"], dy.sum(axis=0), rtol=1e-6)


@pytest.mark.parametrize("case", ["layer 3x1000", "layer 64x96", "group 3x6x2x25"])
def test_results_are_deterministic(case, monkeypatch):
    """One thread count gives one result, bit for bit; other thread counts differ
    only by the rounding of the sums."""
    monkeypatch.setattr(norm_native, "MIN_THREAD_VALUES", 1)
    x, dy, scale, bias, post, size = inputs(case, np.float32)

    def run(count):
        monkeypatch.setattr(blocks, "get_num_threads", lambda: count)
        y, (mean, var) = norm_native.forward(x, EPS, scale, bias, post=post, size=size)
        grads = norm_native.backward(x, dy, mean, var, EPS, scale, post=post, size=size,
                                     want=("dx", "dscale", "dbias"))
        return [y, mean, var, *grads.values()]

    one = run(1)
    for count in (1, 2, 3):
        first = run(count)
        for a, b in zip(first, run(count)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(first, one):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["layer 5x7", "layer 2x4500", "layer 64x96"])
def test_a_prepared_call_gives_forwards_bits_and_reads_its_arrays_anew(case, dtype, threads):
    """prepared_forward (a bound form's call, its arguments packed once) on 1-3 threads:
    forward's y, mean and variance bit for bit, and again after x changes in place."""
    x, _, scale, bias, _, length = inputs(case, dtype)
    rows = x.shape[0]
    y, stats = np.empty_like(x), np.empty((2, rows), dtype)
    call = norm_native.prepared_forward(x, rows, length, EPS, scale, bias, y, stats)
    for _ in range(2):
        call()
        want_y, want_stats = norm_native.forward(x, EPS, scale, bias)
        assert y.tobytes() == want_y.tobytes() and stats.tobytes() == want_stats.tobytes()
        x *= 3                                  # new values in the same array


def test_small_work_stays_on_one_thread(monkeypatch):
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 16)
    monkeypatch.setattr(norm_native, "MIN_THREAD_VALUES", 1000)
    assert norm_native.threads_for(999) == 1
    assert norm_native.threads_for(7500) == 7
    assert norm_native.threads_for(10 ** 9) == 16


def test_inputs_that_are_views_or_other_dtypes_are_copied_not_misread():
    x = rng.standard_normal((6, 40))
    view = x.astype(np.float32)[::2, 3:]                    # not C-contiguous
    scale = rng.standard_normal(37)                          # float64 for float32 x
    y, (mean, var) = norm_native.forward(view, EPS, scale)
    close(y, reference(view, view, scale, None, 1, 37)["y"], np.float32)


def test_wrong_shapes_are_an_error_naming_the_argument():
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match=r"norm_native: scale has shape \(5,\), expected \(6,\)"):
        norm_native.forward(x, EPS, np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"norm_native: dy has shape \(4, 5\), expected \(4, 6\)"):
        norm_native.backward(x, np.zeros((4, 5), np.float32), np.zeros(4), np.ones(4), EPS)
    with pytest.raises(ValueError, match=r"norm_native: mean has shape \(3,\), expected \(4,\)"):
        norm_native.backward(x, x, np.zeros(3), np.ones(4), EPS)


def test_other_dtypes_and_native_off_take_the_numpy_path(monkeypatch):
    """forward and backward return None where the native kernels take no x."""
    x = np.ones((2, 3), np.float16)
    assert norm_native.forward(x, EPS) is None
    assert norm_native.backward(x, x, np.zeros(2), np.ones(2), EPS) is None
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    x = x.astype(np.float32)
    assert norm_native.forward(x, EPS) is None
    assert not norm_native.available()


def test_calls_from_several_threads_at_once(monkeypatch):
    """One call at a time uses the kernels' worker pool; the others start threads of
    their own: every result is right."""
    monkeypatch.setattr(norm_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 2)
    x, dy, scale, bias, post, size = inputs("layer 3x1000", np.float32)
    want = norm_native.forward(x, EPS, scale, bias)[0]
    assert all_right_from_threads(
        lambda: np.array_equal(norm_native.forward(x, EPS, scale, bias)[0], want))


def _forked_norm(queue):
    norm_native.MIN_THREAD_VALUES = 1
    blocks.get_num_threads = lambda: 3
    _, (mean, var) = norm_native.forward(np.arange(40.0).reshape(2, 20), EPS, want_y=False)
    queue.put([float(v) for v in (*mean, *var)])


def test_a_forked_child_runs_threaded_kernels(monkeypatch):
    """The worker pool's threads are not in a forked child: it starts its own
    (the test fails by its timeout if the child waits on the parent's)."""
    monkeypatch.setattr(norm_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: 3)
    norm_native.forward(rng.standard_normal((3, 50)), EPS)
    code, got = run_in_forked_child(_forked_norm)
    assert code == 0
    var = np.arange(20.0).var()
    assert got == pytest.approx([9.5, 29.5, var, var])


# ---- the ops on both engines ------------------------------------------------------------

@pytest.fixture(params=["native", "numpy"])
def engine(request, monkeypatch):
    """The engine the norm ops run on: the native kernels or the numpy engine
    (MINIGRAPH_NATIVE=0); threads on small inputs."""
    monkeypatch.setattr(norm_native, "MIN_THREAD_VALUES", 1)
    if request.param == "numpy":
        monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    return request.param


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_layer_norm_op(engine, dtype):
    x = (rng.standard_normal((3, 4, 5)) * 2 + 1).astype(dtype)
    scale, bias = rng.standard_normal(20).astype(dtype), rng.standard_normal(20).astype(dtype)
    grads = ("x", "scale", "bias") if dtype == np.float64 else ()
    helper_test_op("layer_norm", {"x": x, "scale": scale, "bias": bias},
                   {"begin_norm_axis": 1, "epsilon": EPS}, ln_reference, grad_wrt=grads,
                   outputs=["y"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_group_and_instance_norm_ops(engine, dtype):
    x = (rng.standard_normal((2, 6, 3, 4)) - 1).astype(dtype)
    scale, bias = rng.standard_normal(6).astype(dtype), rng.standard_normal(6).astype(dtype)
    grads = ("x", "scale", "bias") if dtype == np.float64 else ()
    helper_test_op("group_norm", {"x": x, "scale": scale, "bias": bias},
                   {"groups": 3, "epsilon": EPS}, gn_reference, grad_wrt=grads, outputs=["y"])
    helper_test_op("instance_norm", {"x": x, "scale": scale, "bias": bias}, {"epsilon": EPS},
                   in_reference, grad_wrt=grads, outputs=["y"])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_channels_last_group_and_instance_norm_ops(engine, dtype):
    """NHWC runs batch norm's per-channel engine (native or numpy) on each sample."""
    x = (rng.standard_normal((3, 4, 5, 6)) * 2 + 5).astype(dtype)
    scale, bias = rng.standard_normal(6).astype(dtype), rng.standard_normal(6).astype(dtype)
    grads = ("x", "scale", "bias") if dtype == np.float64 else ()
    attrs = {"epsilon": EPS, "data_layout": "NHWC"}
    helper_test_op("group_norm", {"x": x, "scale": scale, "bias": bias}, {"groups": 2, **attrs},
                   gn_reference, grad_wrt=grads, outputs=["y"])
    helper_test_op("instance_norm", {"x": x, "scale": scale}, attrs, in_reference,
                   grad_wrt=grads[:2], outputs=["y"])


def test_the_engines_agree_on_the_gradients(monkeypatch):
    """layer_norm_grad and group_norm_grad in float32: native against numpy."""
    from types import SimpleNamespace

    from minigraph.kernels.cpu import group_norm, layer_norm

    x = (rng.standard_normal((4, 8, 9)) + 3).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    scale = rng.standard_normal(72).astype(np.float32)
    op = SimpleNamespace(attrs={"begin_norm_axis": 1, "epsilon": EPS}, wants=lambda s: True)
    stats = layer_norm.layer_norm_cpu(op, {"x": x, "scale": scale, "bias": None}, None)
    ins = {"x": x, "scale": scale, "mean": stats["mean"], "variance": stats["variance"],
           "dy": dy}
    native_ln = layer_norm.layer_norm_grad_cpu(op, ins, None)
    gn_args = (x, scale[:8], stats["mean"][:, None], stats["variance"][:, None], dy, 1, EPS,
               ["dx", "dscale", "dbias"])
    native_gn = group_norm.backward(*gn_args)
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    numpy_ln = layer_norm.layer_norm_grad_cpu(op, ins, None)
    numpy_gn = group_norm.backward(*gn_args)
    for got, want in ((native_ln, numpy_ln), (native_gn, numpy_gn)):
        assert set(got) == set(want) == {"dx", "dscale", "dbias"}
        for name in got:
            assert got[name].dtype == np.float32
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4,
                                       atol=1e-5 * np.abs(want[name]).max())
