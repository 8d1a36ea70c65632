"""The native depthwise conv kernels (kernels/cpu/conv_depthwise.c) against the float64
reference: the forward pass with its epilogue, the input and filter gradients on
strides, paddings, dilations, kernel sizes and channel multipliers, rows shorter and
longer than a vector, the thread counts; and the conv ops running on them."""
from types import SimpleNamespace

import numpy as np
import pytest
from references import conv2d, conv2d_grad
from test_conv_native_nhwc import nhwc
from thread_helpers import all_right_from_threads

import minigraph as mg
from minigraph import layers
from minigraph.kernels.cpu import conv2d as conv_ops
from minigraph.kernels.cpu import conv_depthwise, conv_im2col, native

rng = np.random.default_rng(11)

pytestmark = pytest.mark.skipif(
    not conv_depthwise.available(),
    reason=f"native kernels not built: {native.reason('conv_depthwise')}")

# (x shape, channel multiplier, kernel, strides, paddings, dilations): rows of fewer
# outputs than a vector, of several vectors and a part; row counts that leave 1-3
# rows after the tiles of 4; strides across (phases) and down (row residues);
# padding past the filter's reach; multipliers 2 and 3
GEOMETRIES = [
    ((2, 4, 7, 9), 1, (3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 32, 28, 28), 1, (3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 16, 28, 28), 1, (3, 3), (2, 2), (1, 1), (1, 1)),
    ((1, 3, 14, 37), 2, (3, 3), (2, 2), (1, 1), (1, 1)),
    ((1, 5, 11, 37), 1, (5, 5), (2, 3), (2, 1), (2, 1)),
    ((3, 2, 9, 8), 3, (1, 3), (1, 2), (0, 2), (1, 2)),
    ((2, 6, 14, 14), 1, (3, 3), (3, 3), (0, 0), (1, 1)),
    ((1, 2, 5, 5), 1, (3, 3), (1, 1), (3, 3), (2, 2)),
    ((2, 3, 6, 40), 1, (7, 7), (1, 1), (3, 3), (1, 1)),
    ((1, 4, 3, 70), 2, (2, 2), (1, 2), (0, 1), (1, 1)),
    ((2, 8, 1, 1), 1, (3, 3), (1, 1), (1, 1), (1, 1)),
]


def case(x_shape, m, kernel, strides, paddings, dilations):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((x_shape[1] * m, 1, *kernel)).astype(np.float32)
    g = conv_im2col.geometry(x_shape, w.shape, strides, paddings, dilations, x_shape[1])
    attrs = {"strides": strides, "paddings": paddings, "dilations": dilations,
             "groups": x_shape[1]}
    return x, w, g, attrs


def close(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.fixture(autouse=True)
def every_call_threaded(monkeypatch):
    """Small test convs run on as many threads as asked."""
    monkeypatch.setattr(conv_depthwise, "MIN_THREAD_WORK", 1)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_forward_and_gradients_against_the_float64_reference(geometry):
    x, w, g, attrs = case(*geometry)
    want = conv2d(x, w, **attrs)
    d = rng.standard_normal(want.shape).astype(np.float32)
    dx_want, dw_want = conv2d_grad(x, w, d, **attrs)
    for threads in (1, 2, 3):
        close(conv_depthwise.forward(x, w, g, threads), want)
        close(conv_depthwise.input_grad(w, d, g, threads), dx_want)
        close(conv_depthwise.filter_grad(x, d, g, threads), dw_want)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_results_do_not_depend_on_the_thread_count(geometry):
    x, w, g, _ = case(*geometry)
    d = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32)
    runs = [(conv_depthwise.forward(x, w, g, t), conv_depthwise.input_grad(w, d, g, t),
             conv_depthwise.filter_grad(x, d, g, t)) for t in (1, 2, 5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("geometry", GEOMETRIES[:6])
@pytest.mark.parametrize("bias, residual, relu", [
    (True, False, False), (True, True, True), (False, True, False), (False, False, True)])
def test_forward_epilogue(geometry, bias, residual, relu):
    x, w, g, attrs = case(*geometry)
    b = rng.standard_normal(g.o).astype(np.float32) if bias else None
    r = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32) if residual else None
    want = conv2d(x, w, **attrs)
    if bias:
        want = want + b.reshape(-1, 1, 1)
    if residual:
        want = want + r
    close(conv_depthwise.forward(x, w, g, 2, bias=b, residual=r, relu=relu),
          np.maximum(want, 0.0) if relu else want)


def test_values_no_window_reads_stay_out_of_every_result():
    """An infinity in x's last column, which no window of this stride-2 conv reads:
    the kernels' vectors read past a row's last output, and those lanes must reach
    neither the outputs nor dfilter."""
    x, w, g, attrs = case((2, 3, 7, 8), 2, (3, 3), (2, 2), (0, 0), (1, 1))
    assert (g.ho, g.wo) == (3, 3)                    # columns 0-6 read, 7 not
    x[:, :, :, 7] = np.inf
    d = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32)
    out, dw = conv_depthwise.forward(x, w, g, 2), conv_depthwise.filter_grad(x, d, g, 2)
    assert np.isfinite(out).all() and np.isfinite(dw).all()
    close(out, conv2d(x, w, **attrs))
    close(dw, conv2d_grad(x, w, d, **attrs)[1])


def test_a_nan_reaches_the_outputs_whose_windows_read_it():
    x, w, g, attrs = case((1, 2, 6, 6), 1, (3, 3), (1, 1), (1, 1), (1, 1))
    x[0, 1, 2, 3] = np.nan
    got, want = conv_depthwise.forward(x, w, g, 1), conv2d(x, w, **attrs)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 9


def test_a_nan_reaches_the_channels_last_outputs_whose_windows_read_it():
    x, w, g, attrs = case((1, 20, 6, 6), 1, (3, 3), (1, 1), (1, 1), (1, 1))
    x[0, 17, 2, 3] = np.nan                         # a channel of the second vector
    w[3, 0, 0, 0] = np.inf                          # inf x the zero border: nan
    got = conv_depthwise.forward_nhwc(nhwc(x), w, g, 2)
    want = nhwc(conv_depthwise.forward(x, w, g, 2))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[..., 17]).sum() == 9 and np.isnan(got[0, 0, :, 3]).all()
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


def test_what_the_kernels_take():
    def geometry(x_shape, w_shape, groups):
        return conv_im2col.geometry(x_shape, w_shape, (1, 1), (1, 1), (1, 1), groups)
    assert conv_depthwise.supports(geometry((1, 4, 5, 5), (8, 1, 3, 3), 4), np.float32)
    assert not conv_depthwise.supports(geometry((1, 4, 5, 5), (8, 1, 3, 3), 4), np.float64)
    assert not conv_depthwise.supports(geometry((1, 4, 5, 5), (4, 2, 3, 3), 2), np.float32)
    assert not conv_depthwise.supports(geometry((1, 1, 5, 5), (8, 1, 3, 3), 1), np.float32)


def test_switched_off_with_the_other_native_kernels(monkeypatch):
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    g = conv_im2col.geometry((1, 4, 5, 5), (4, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4)
    assert not conv_depthwise.supports(g, np.float32)


def test_bad_shapes_name_the_argument():
    x, w, g, _ = case((1, 4, 5, 6), 1, (3, 3), (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"conv_depthwise: filter has shape \(4, 1, 2, 2\)"):
        conv_depthwise.forward(x, w[:, :, :2, :2], g, 1)
    with pytest.raises(ValueError, match=r"conv_depthwise: x has shape \(1, 4, 5, 6\), "
                                         r"expected \(1, 5, 6, 4\)"):
        conv_depthwise.forward_nhwc(x, w, g, 1)     # channels first given to channels last
    with pytest.raises(ValueError, match=r"conv_depthwise: dout has shape"):
        conv_depthwise.input_grad_nhwc(w, np.zeros((1, 4, 5, 6), np.float32), g, 1)
    with pytest.raises(ValueError, match=r"conv_depthwise: residual has shape \(1, 4, 5, 6\)"):
        conv_depthwise.forward_nhwc(nhwc(x), w, g, 1, residual=x)
    with pytest.raises(ValueError, match=r"conv_depthwise: x has shape"):
        conv_depthwise.filter_grad_nhwc(x, np.zeros((1, 5, 6, 4), np.float32), g, 1)


def test_calls_from_many_threads_at_once():
    x, w, g, attrs = case((4, 16, 14, 14), 1, (3, 3), (1, 1), (1, 1), (1, 1))
    want = conv_depthwise.forward(x, w, g, 2)
    assert all_right_from_threads(
        lambda: np.array_equal(conv_depthwise.forward(x, w, g, 2), want), calls=20)


def spy(monkeypatch, name):
    calls = []
    real = getattr(conv_depthwise, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    monkeypatch.setattr(conv_depthwise, name, counted)
    return calls


def test_the_conv_ops_run_on_the_depthwise_kernels(monkeypatch):
    """A net of depthwise convs trains on the depthwise kernels (forward, dx and
    dfilter), and its inference net's first fused conv (the batch norm folded in, then
    relu and 2x2 max pooling) runs them too, as the numpy engine would; the second, a
    depthwise conv before a 1x1 conv, runs with it as one fused_separable_conv2d."""
    counted = {n: spy(monkeypatch, n) for n in ("forward", "input_grad", "filter_grad")}
    net = mg.Net(seed=3)
    image = layers.data(net, "image", shape=(-1, 8, 12, 12))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, image, num_filters=8, filter_size=3, padding=1, groups=8,
                      bias=False)
    h = layers.pool2d(net, layers.relu(net, layers.batch_norm(net, h)), 2)
    h = layers.conv2d(net, h, num_filters=16, filter_size=3, padding=1, groups=8)
    logits = layers.fc(net, layers.conv2d(net, h, num_filters=4, filter_size=1), 10)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    feed = {"image": rng.standard_normal((4, 8, 12, 12)).astype(np.float32),
            "label": rng.integers(0, 10, 4)}
    net.train(feed=feed)
    assert {n: len(c) for n, c in counted.items()} == \
        {"forward": 2, "input_grad": 1, "filter_grad": 2}
    fast = mg.passes.optimize_for_inference(net)
    types = [op.type for op in fast.ops("infer")]
    assert types.count("fused_conv2d") == 1 and types.count("fused_separable_conv2d") == 1
    (got,) = fast.infer(feed={"image": feed["image"]}, fetch=[logits.name])
    assert len(counted["forward"]) == 3
    (want,) = net.infer(feed={"image": feed["image"]}, fetch=[logits])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    from test_bound_run import unbound

    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")         # op by op: no prepared C call
    (numpy,) = unbound(fast, {"image": feed["image"]}, [logits.name])
    assert len(counted["forward"]) == 5                  # net.infer's two, then none
    np.testing.assert_allclose(got, numpy, rtol=1e-4, atol=1e-5 * np.abs(numpy).max())


def test_small_depthwise_convs_default_to_the_kernel_untimed(monkeypatch):
    timed = []
    monkeypatch.setattr(conv_ops.choices, "pick",
                        lambda *args, **kwargs: timed.append(args) or "im2col")
    _, _, g, _ = case((1, 4, 5, 5), 1, (3, 3), (1, 1), (1, 1), (1, 1))
    op = SimpleNamespace(attrs={"data_layout": "NCHW"})
    options = {"depthwise": None, "im2col": None}
    assert conv_ops.pick("conv2d", op, g, 2, options) == "depthwise" and not timed
    _, _, g, _ = case((8, 64, 28, 28), 1, (3, 3), (1, 1), (1, 1), (1, 1))
    assert conv_ops.pick("conv2d", op, g, 2, options) == "im2col" and len(timed) == 1
    assert "|b" + native.build_key("conv_depthwise") in timed[0][1]


def test_an_inference_net_runs_its_depthwise_convs_bound(monkeypatch):
    """optimize_for_inference's depthwise fused_conv2d (bias and relu from the folded
    batch norm) runs through its bound form, prepared once, with the bits of runs op by
    op; one that pools its outputs runs its kernel (no bound form)."""
    from test_bound_run import compiled_of, unbound

    prepared = []
    prepare = conv_depthwise.prepared_forward
    monkeypatch.setattr(conv_depthwise, "prepared_forward",
                        lambda *args: prepared.append(args) or prepare(*args))
    net = mg.Net(seed=0)
    image = layers.data(net, "image", shape=(-1, 8, 12, 12))
    h = layers.conv2d(net, image, 16, 3, padding=1, groups=8, bias=False)
    h = layers.relu(net, layers.batch_norm(net, h))
    h = layers.pool2d(net, layers.relu(net, layers.conv2d(net, h, 16, 3, padding=1,
                                                          groups=16)), 2)
    logits = layers.fc(net, layers.flatten(net, h), 3)
    fast = mg.passes.optimize_for_inference(net)
    logits = fast.var(logits.name)
    fed = np.empty((2, 8, 12, 12), np.float32)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal(fed.shape).astype(np.float32)
        fed[...] = x                                  # the same array, new values
        got = fast.infer(feed={"image": fed}, fetch=[logits])[0]
        assert got.tobytes() == unbound(fast, {"image": x}, [logits])[0].tobytes()
    c = compiled_of(fast, [logits])
    forms = [f for s, f in zip(c.steps, c.bound.forms) if s.op.type == "fused_conv2d"]
    assert len(forms) == 2 and len(prepared) == 1


@pytest.mark.parametrize("shape", [(2, 7, 9, 3), (1, 1, 1, 5), (3, 17, 33, 16), (2, 4, 4, 40)])
def test_the_transposes_between_layouts(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    for threads in (1, 2, 3):
        first = conv_depthwise._channels_first(x, threads)
        assert first.flags.c_contiguous and np.array_equal(first, x.transpose(0, 3, 1, 2))
        assert np.array_equal(conv_depthwise._channels_last(first, threads), x)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_channels_last_runs_give_the_channels_first_kernels_bits(geometry):
    x, w, g, _ = case(*geometry)
    d = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32)
    b = rng.standard_normal(g.o).astype(np.float32)
    r = rng.standard_normal(d.shape).astype(np.float32)
    for threads in (1, 3):
        assert np.array_equal(conv_depthwise.forward_nhwc(nhwc(x), w, g, threads),
                              nhwc(conv_depthwise.forward(x, w, g, threads)))
        assert np.array_equal(
            conv_depthwise.forward_nhwc(nhwc(x), w, g, threads, bias=b, residual=nhwc(r),
                                        relu=True),
            nhwc(conv_depthwise.forward(x, w, g, threads, bias=b, residual=r, relu=True)))
        assert np.array_equal(conv_depthwise.input_grad_nhwc(w, nhwc(d), g, threads),
                              nhwc(conv_depthwise.input_grad(w, d, g, threads)))
        assert np.array_equal(conv_depthwise.filter_grad_nhwc(nhwc(x), nhwc(d), g, threads),
                              conv_depthwise.filter_grad(x, d, g, threads))


def test_a_channels_last_net_trains_and_infers_on_the_depthwise_kernels(monkeypatch):
    """NHWC depthwise convs train on the kernels (multiplier 1's forward channels last,
    multiplier 2's and the gradients through the transposes) with the float64
    reference's values, and the inference net's fused convs (batch norm folded, relu,
    2x2 max pooling) run them too."""
    counted = {n: spy(monkeypatch, n) for n in ("forward_nhwc", "forward", "input_grad",
                                                "filter_grad")}
    net = mg.Net(seed=5)
    image = layers.data(net, "image", shape=(-1, 12, 12, 8))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    conv = layers.conv2d(net, image, num_filters=8, filter_size=3, padding=1, groups=8,
                         bias=False, data_layout="NHWC", name="dw")
    h = layers.relu(net, layers.batch_norm(net, conv, data_layout="NHWC"))
    h = layers.pool2d(net, h, 2, data_layout="NHWC")
    h = layers.conv2d(net, h, num_filters=16, filter_size=3, padding=1, groups=8,
                      data_layout="NHWC")
    logits = layers.fc(net, h, 10)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    x = rng.standard_normal((4, 12, 12, 8)).astype(np.float32)
    (first,) = net.infer(feed={"image": x}, fetch=[conv])
    w = net.var("dw.w").get()
    close(first, nhwc(conv2d(x.transpose(0, 3, 1, 2), w, strides=(1, 1), paddings=(1, 1),
                             dilations=(1, 1), groups=8)))
    assert {n: len(c) for n, c in counted.items()} == \
        {"forward_nhwc": 1, "forward": 0, "input_grad": 0, "filter_grad": 0}
    net.train(feed={"image": x, "label": rng.integers(0, 10, 4)})
    assert {n: len(c) for n, c in counted.items()} == \
        {"forward_nhwc": 3, "forward": 1, "input_grad": 1, "filter_grad": 2}
    fast = mg.passes.optimize_for_inference(net)
    (got,) = fast.infer(feed={"image": x}, fetch=[logits.name])
    assert (len(counted["forward_nhwc"]), len(counted["forward"])) == (5, 2)
    (want,) = net.infer(feed={"image": x}, fetch=[logits])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
