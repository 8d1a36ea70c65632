"""The layer API: every layer on a net, names, all-or-nothing building, eager values,
the seed, summary, and the misuse that must be an error naming the layer and argument."""
import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)


def image_net(seed=0, shape=(-1, 3, 8, 8)):
    net = mg.Net(seed=seed)
    return net, L.data(net, "image", shape=shape), L.data(net, "label", shape=(-1,),
                                                         dtype="int64")


def residual_net(seed=0, p=0.25):
    """conv-bn-relu, a residual block (add), a concat branch, dropout, global avg pool, fc."""
    net, img, lbl = image_net(seed)
    h = L.relu(net, L.batch_norm(net, L.conv2d(net, img, 4, 3, padding=1), name="bn0"))
    r = L.conv2d(net, L.relu(net, h), 4, 3, padding=1, bias=False, name="res")
    h = L.add(net, h, r)
    h = L.concat(net, [h, L.gelu(net, h), L.tanh(net, h)], axis=1)
    h = L.dropout(net, h, p=p, name="drop")
    h = L.flatten(net, L.pool2d(net, h, global_pooling=True, pool_type="avg"))
    logits = L.fc(net, L.leaky_relu(net, h, 0.1), 5, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    return net, logits, loss, L.accuracy(net, logits, lbl)


def batch(n=8, seed=0):
    r = np.random.default_rng(seed)
    return {"image": r.standard_normal((n, 3, 8, 8)).astype(np.float32),
            "label": r.integers(0, 5, n)}


def test_every_layer_builds_trains_and_infers():
    net, logits, loss, acc = residual_net()
    mg.optimizer.AdamW(0.01, grad_clip=mg.optimizer.ClipGradByGlobalNorm(1.0)).minimize(net, loss)
    feed = batch()
    losses = [float(net.train(feed=feed, fetch=[loss])[0]) for _ in range(30)]
    assert losses[-1] < losses[0]
    (p, a) = net.infer(feed={"image": feed["image"]}, fetch=[logits, L.softmax(net, logits)])
    assert p.shape == (8, 5) and np.allclose(a.sum(axis=1), 1, atol=1e-6)
    (lbl,) = net.infer(feed=feed, fetch=[L.argmax(net, logits)])
    np.testing.assert_array_equal(lbl, p.argmax(axis=1))
    assert lbl.dtype == np.int64


def test_a_net_whose_only_mode_op_is_dropout_forks():
    net = mg.Net(seed=1)
    x = L.data(net, "x", shape=(-1, 6))
    h = L.fc(net, x, 6)
    assert not net.forked
    out = L.dropout(net, L.sigmoid(net, h), p=0.5)
    assert net.forked
    assert [op.type for op in net.section("trunk")] == ["mul", "elementwise_add", "sigmoid"]
    assert [op.type for op in net.section("train")] == ["dropout"]
    train_op = [op for op in net.section("train") if op.type == "dropout"][0]
    infer_op = [op for op in net.section("infer") if op.type == "dropout"][0]
    assert train_op.attrs["is_infer"] is False and infer_op.attrs["is_infer"] is True
    xb = np.ones((4, 6), np.float32)
    (a,) = net.infer(feed={"x": xb}, fetch=[out])
    (b,) = net.infer(feed={"x": xb}, fetch=[out])
    np.testing.assert_array_equal(a, b)                    # inference: the identity
    (t,) = net.train(feed={"x": xb}, fetch=[out])
    assert set(np.unique(np.round(t / np.where(a == 0, 1, a), 5))) <= {0.0, 2.0}


def test_dropout_statistics_and_determinism():
    def run(seed, steps=2):
        net = mg.Net(seed=seed)
        x = L.data(net, "x", shape=(-1, 1000))
        out = L.dropout(net, x, p=0.3, name="d")
        xb = np.full((100, 1000), 2.0, np.float32)
        return [net.train(feed={"x": xb}, fetch=[out])[0] for _ in range(steps)], net

    (a1, a2), net = run(7)
    (b1, b2), _ = run(7)
    np.testing.assert_array_equal(a1, b1)                  # the seed repeats exactly
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, a2)                      # a new mask every step
    kept = a1 != 0
    assert abs(kept.mean() - 0.7) < 4 * np.sqrt(0.7 * 0.3 / kept.size)
    np.testing.assert_allclose(a1[kept], 2.0 / 0.7, rtol=1e-6)
    assert abs(a1.mean() - 2.0) < 0.02
    assert int(net.var("d.step").get()) == 2
    (c1, _), _ = run(8)
    assert not np.array_equal(a1, c1)


def test_parameters_have_values_as_soon_as_the_layer_returns_and_the_seed_fixes_them():
    def build(seed):
        net, img, _ = image_net(seed)
        L.conv2d(net, img, 4, 3, name="c1")
        return net

    a, b, c = build(3), build(3), build(4)
    w = a.var("c1.w").get()
    assert w.shape == (4, 3, 3, 3) and np.abs(w).max() > 0
    np.testing.assert_array_equal(w, b.var("c1.w").get())
    assert not np.array_equal(w, c.var("c1.w").get())
    np.testing.assert_array_equal(a.var("c1.b").get(), b.var("c1.b").get())


def test_summary_lists_layers_and_totals():
    net, logits, loss, acc = residual_net()
    text = net.summary()
    assert "bn0 (batch_norm)" in text and "batch_norm" in text
    assert "head (fc)" in text and "mul, elementwise_add" in text and "(N, 5)" in text
    head = 12 * 5 + 5
    conv = 4 * 3 * 9 + 4
    res = 4 * 4 * 9
    bn_trainable, bn_other = 8, 4 + 4 + 1
    assert f"trainable parameters:     {head + conv + res + bn_trainable:,}" in text
    assert f"non-trainable values:     {bn_other + 1:,}" in text      # + dropout's step
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["layer", "ops", "output", "shape"]


def test_automatic_names_skip_names_the_user_took():
    net, img, _ = image_net()
    flat = L.flatten(net, img)
    L.fc(net, flat, 3, name="fc_0")
    h = L.fc(net, flat, 3)
    assert h.name == "fc_1.out"
    with pytest.raises(ValueError, match="fc: the name 'fc_0' is already used"):
        L.fc(net, flat, 3, name="fc_0")


def test_a_failing_layer_leaves_nothing_behind_and_a_retry_works():
    net, img, _ = image_net()
    before = (set(net.scope.vars), {s: net.section(s) for s in ("init", "trunk", "train")})
    with pytest.raises(mg.OpError):
        L.conv2d(net, img, 4, 9, name="big")     # an 8x8 image is smaller than the filter
    assert (set(net.scope.vars), {s: net.section(s) for s in ("init", "trunk", "train")}) \
        == before
    assert not net.layers
    out = L.conv2d(net, img, 4, 3, name="big")
    assert out.shape == (-1, 4, 6, 6) and net.layers[-1].name == "big"
    h = L.conv2d(net, img, 4, 3)
    assert h.name == "conv2d_0.out"


@pytest.mark.parametrize("call, message", [
    (lambda n, x: L.fc(n, x, 0), "fc: argument 'size' must be an int >= 1, got 0"),
    (lambda n, x: L.fc(n, x, 2.5), "fc: argument 'size' must be an int >= 1"),
    (lambda n, x: L.conv2d(n, x, 0, 3), "conv2d: argument 'num_filters' must be an int >= 1"),
    (lambda n, x: L.conv2d(n, x, 4, 3, groups=0), "conv2d: argument 'groups' must be an int >= 1"),
    (lambda n, x: L.conv2d(n, x, 4, 2.5), "conv2d: argument 'filter_size' must be an int or a pair"),
    (lambda n, x: L.conv2d(n, x, 4, -3), "conv2d: argument 'filter_size' must be an int or a pair"),
    (lambda n, x: L.conv2d(n, x, 4, 3, groups=2), "conv2d: argument 'groups' \\(2\\) must divide"),
    (lambda n, x: L.conv2d(n, x, 4, 3, padding=-1), "conv2d: argument 'padding' must be an int"),
    (lambda n, x: L.pool2d(n, x, 0), "pool2d: argument 'pool_size' must be an int or a pair"),
    (lambda n, x: L.pool2d(n, x, 2, "median"), "pool2d: argument 'pool_type' must be 'max' or 'avg'"),
    (lambda n, x: L.dropout(n, x, 1.0), r"dropout: argument 'p' must be a finite number in \[0, 1\)"),
    (lambda n, x: L.dropout(n, x, float("nan")), "dropout: argument 'p' must be a finite number"),
    (lambda n, x: L.dropout(n, x, -0.1), "dropout: argument 'p'"),
    (lambda n, x: L.leaky_relu(n, x, "a"), "leaky_relu: argument 'alpha' must be a number"),
    (lambda n, x: L.softmax(n, x, axis=4), r"softmax: argument 'axis' must be an int in \[-4, 4\)"),
    (lambda n, x: L.argmax(n, x, axis=-5), "argmax: argument 'axis'"),
    (lambda n, x: L.concat(n, [], axis=1), "concat: argument 'xs' must hold at least one"),
    (lambda n, x: L.concat(n, [x, x], axis=7), "concat: argument 'axis'"),
    (lambda n, x: L.transpose(n, x, (0, 1, 2)), "transpose: argument 'perm' must be a permutation"),
    (lambda n, x: L.flatten(n, x, 3, 1), "flatten: argument 'start_axis' \\(3\\) must not come"),
    (lambda n, x: L.reshape(n, x, "12"), "reshape: argument 'shape' must be a tuple of ints"),
    (lambda n, x: L.batch_norm(n, x, data_layout="CHWN"), "batch_norm: argument 'data_layout'"),
    (lambda n, x: L.relu(n, "x"), "relu: argument 'x' must be a Variable of the net, got str"),
    (lambda n, x: L.fc(n, x, 3, name=""), "fc: name must be a non-empty str"),
    (lambda n, x: L.fc(x, x, 3), "fc: the first argument must be the Net"),
])
def test_bad_arguments_name_the_layer_and_the_argument(call, message):
    net, img, _ = image_net()
    with pytest.raises((ValueError, TypeError), match=message):
        call(net, img)
    assert not net.layers and len(net.section("init")) == 0


def test_float_layers_refuse_integer_data_and_labels_must_be_int64():
    net = mg.Net()
    ints = L.data(net, "ints", shape=(-1, 4), dtype="int64")
    with pytest.raises(TypeError, match="fc: argument 'x' must be a float tensor, got 'ints' of "
                                        "dtype int64"):
        L.fc(net, ints, 3)
    x = L.data(net, "x", shape=(-1, 4))
    with pytest.raises(TypeError, match="softmax_with_cross_entropy: argument 'label' must be "
                                        "int64 class indices"):
        L.softmax_with_cross_entropy(net, x, x)
    other = mg.Net()
    y = L.data(other, "y", shape=(-1, 4))
    with pytest.raises(ValueError, match="add: argument 'y' \\('y'\\) is a Variable of another net"):
        L.add(net, x, y)
    with pytest.raises(mg.OpError, match="add: input 'y'"):
        L.add(net, x, L.data(net, "z", shape=(-1, 3)))


def test_layers_with_parameters_after_minimize_are_errors_and_metrics_are_not():
    net, img, lbl = image_net()
    logits = L.fc(net, img, 5)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    with pytest.raises(ValueError, match="cannot add a trainable parameter after minimize"):
        L.fc(net, logits, 3)
    assert [r.kind for r in net.layers][-1] == "mean"
    acc = L.accuracy(net, logits, lbl)                    # no parameters: fine
    feed = batch()
    (a,) = net.train(feed=feed, fetch=[acc])
    assert a.dtype == np.float32 and 0 <= a <= 1


def test_minimize_needs_a_scalar_loss():
    net, img, lbl = image_net()
    per_row = L.softmax_with_cross_entropy(net, L.fc(net, img, 5), lbl)
    with pytest.raises(ValueError, match=r"the loss must be a scalar \(shape \(\)\), got "
                                         r"'softmax_with_cross_entropy_0.loss' of shape \(-1,\)"):
        mg.optimizer.SGD(0.1).minimize(net, per_row)


def test_feeds_take_data_variables_as_keys_and_fetches_refuse_other_nets():
    net, img, lbl = image_net()
    logits = L.fc(net, img, 5)
    feed = batch()
    (a,) = net.infer(feed={img: feed["image"]}, fetch=[logits])
    (b,) = net.infer(feed={"image": feed["image"]}, fetch=["fc_0.out"])
    np.testing.assert_array_equal(a, b)
    twin, timg, _ = image_net()
    tlogits = L.fc(twin, timg, 5)
    with pytest.raises(KeyError, match="belongs to another net"):
        net.infer(feed={img: feed["image"]}, fetch=[tlogits])
    with pytest.raises(KeyError, match="feed 'image': this Variable is not a data variable of "
                                       "this net"):
        net.infer(feed={timg: feed["image"]}, fetch=[logits])


@pytest.mark.parametrize("shape, call, message", [
    ((-1, 0), lambda n, x: L.fc(n, x, 3),
     r"fc: argument 'x' \('x', shape \(-1, 0\)\) has no features"),
    ((-1, 4, 0, 2), lambda n, x: L.fc(n, x, 3), "fc: argument 'x' .* has no features"),
    ((-1, 0, 5, 5), lambda n, x: L.conv2d(n, x, 4, 3),
     r"conv2d: argument 'x' \('x', shape \(-1, 0, 5, 5\)\) has 0 channels"),
    ((-1, 5, 5, 0), lambda n, x: L.conv2d(n, x, 4, 3, data_layout="NHWC"),
     "conv2d: argument 'x' .* has 0 channels"),
])
def test_layers_on_empty_feature_axes_are_named_errors(shape, call, message):
    """fc on (N, 0) and conv2d on 0 channels raised ZeroDivisionError (the initializer's
    fan_in)."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape)
    with pytest.raises(ValueError, match=message):
        call(net, x)
    assert not net.layers and len(net.section("init")) == 0


def test_channels_last_conv_and_pool_layers():
    """data_layout="NHWC": x (N, H, W, C) -> (N, Ho, Wo, out); the filter keeps the
    NCHW layout (out, in/groups, kh, kw) and the bias is added on the last axis; the
    channels-last chain conv -> batch_norm -> relu -> pool has no transpose."""
    net = mg.Net(seed=0)
    img = L.data(net, "image", (-1, 9, 8, 6))
    h = L.conv2d(net, img, 4, (3, 1), stride=(2, 1), padding=(1, 0), groups=2, name="c",
                 data_layout="NHWC")
    assert h.shape == (-1, 5, 8, 4)
    assert net.var("c.w").shape == (4, 3, 3, 1) and net.var("c.b").shape == (4,)
    add = next(op for op in net.ops("train") if op.type == "elementwise_add")
    assert add.attrs["axis"] == 3
    h = L.relu(net, L.batch_norm(net, h, name="bn", data_layout="NHWC"))
    p = L.pool2d(net, h, 2, pool_type="avg", data_layout="NHWC")
    assert p.shape == (-1, 2, 4, 4)
    g = L.pool2d(net, h, global_pooling=True, data_layout="NHWC")
    assert g.shape == (-1, 1, 1, 4)
    for mode in ("train", "infer"):
        types = [op.type for op in net.ops(mode)]
        assert types == ["conv2d", "elementwise_add", "batch_norm", "relu", "pool2d",
                         "pool2d"], mode
        assert {op.attrs["data_layout"] for op in net.ops(mode) if "data_layout" in op.attrs} \
            == {"NHWC"}
    (out,) = net.infer(feed={"image": np.ones((2, 9, 8, 6), np.float32)}, fetch=[p])
    assert out.shape == (2, 2, 4, 4)


@pytest.mark.parametrize("call, message", [
    (lambda n, x: L.conv2d(n, x, 4, 3, data_layout="NCWH"),
     "conv2d: argument 'data_layout' must be 'NCHW' or 'NHWC', got 'NCWH'"),
    (lambda n, x: L.pool2d(n, x, 2, data_layout=None),
     "pool2d: argument 'data_layout' must be 'NCHW' or 'NHWC', got None"),
    (lambda n, x: L.conv2d(n, L.flatten(n, x), 4, 3),
     r"conv2d: argument 'x' \('flatten_0.out'\) must be NCHW \(rank 4\)"),
    (lambda n, x: L.pool2d(n, L.flatten(n, x), 2, data_layout="NHWC"),
     r"pool2d: argument 'x' .* must be NHWC \(rank 4\)"),
])
def test_bad_layouts_name_the_layer(call, message):
    net, img, _ = image_net()
    with pytest.raises(ValueError, match=message):
        call(net, img)


def test_a_checkpoint_of_an_nchw_net_loads_into_its_channels_last_twin(tmp_path):
    """The filter is (out, in/groups, kh, kw) in both layouts: the NCHW net's checkpoint
    loads into the NHWC net (strictly: same names, shapes and dtypes), which then gives
    the same logits on the transposed images."""
    def build(layout, seed):
        net = mg.Net(seed=seed)
        img = L.data(net, "image", (-1, 3, 6, 6) if layout == "NCHW" else (-1, 6, 6, 3))
        h = L.conv2d(net, img, 5, 3, padding=1, name="c", data_layout=layout)
        h = L.relu(net, L.batch_norm(net, h, name="bn", data_layout=layout))
        h = L.pool2d(net, h, global_pooling=True, pool_type="avg", data_layout=layout)
        return net, L.fc(net, h, 2, name="head")

    a, logits_a = build("NCHW", 1)
    b, logits_b = build("NHWC", 2)
    mg.io.save(a, tmp_path / "ck.npz")
    mg.io.load(b, tmp_path / "ck.npz")
    x = np.random.default_rng(0).standard_normal((3, 3, 6, 6)).astype(np.float32)
    (want,) = a.infer(feed={"image": x}, fetch=[logits_a])
    (got,) = b.infer(feed={"image": x.transpose(0, 2, 3, 1)}, fetch=[logits_b])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
