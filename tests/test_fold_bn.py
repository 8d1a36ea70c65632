"""mg.passes.fold_batch_norm: folded nets equal net.infer; the folded weights and
biases follow w' = w * s, b' = (b - mean) * s + bias with s = scale / sqrt(var + eps);
what cannot be folded stays and is reported; the source net is untouched."""
import hashlib

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)


def randomise_estimates(net):
    """Non-trivial scale, bias and estimates in every batch norm."""
    for v in net.persistables():
        for suffix, make in ((".scale", lambda n: rng.uniform(0.5, 2, n)),
                             (".bias", lambda n: rng.normal(0, 1, n)),
                             (".estimated_mean", lambda n: rng.normal(0, 1, n)),
                             (".estimated_var", lambda n: rng.uniform(0.2, 3, n))):
            if v.name.endswith(suffix) and v.name.split(".")[-2].startswith("bn"):
                v.set(make(v.shape[0]).astype(v.dtype))


def digest(net):
    h = hashlib.sha256()
    for v in net.persistables():
        h.update(v.name.encode() + np.ascontiguousarray(v.get()).tobytes())
    return h.hexdigest()


def conv_net(dtype="float32", bias=True, groups=1, share_input=False, layout_rank=4,
             layout="NCHW"):
    net = mg.Net(seed=1)
    x = L.data(net, "x", shape=(-1, 4, 6, 6) if layout == "NCHW" else (-1, 6, 6, 4),
               dtype=dtype)
    h = L.conv2d(net, x, 6, 3, padding=1, groups=groups, bias=bias, name="c1",
                 data_layout=layout)
    y = L.batch_norm(net, h, name="bn1", data_layout=layout)
    if share_input:
        y = L.add(net, y, L.relu(net, h))
    out = L.relu(net, y)
    return net, out


def fc_net(dtype="float32", rank=2):
    net = mg.Net(seed=2)
    if rank == 2:
        x = L.data(net, "x", shape=(-1, 12), dtype=dtype)
        h = L.fc(net, x, 5, name="f1")
        return net, L.batch_norm(net, h, name="bn1", data_layout="NHWC")
    x = L.data(net, "x", shape=(-1, 3, 3, 4), dtype=dtype)      # NHWC: a 1x1 conv as an fc
    w = net.create_parameter("f1.w", (4, 5), x.dtype, mg.initializer.Xavier())
    h = net.append("mul", {"x": x, "y": w}, {"out": "f1.out"}, {"x_num_col_dims": 3})["out"]
    return net, L.batch_norm(net, h, name="bn1", data_layout="NHWC")


def check_equal(net, out, x, rtol):
    randomise_estimates(net)
    before = digest(net)
    folded = mg.passes.fold_batch_norm(net)
    (want,) = net.infer(feed={"x": x}, fetch=[out])
    (got,) = folded.infer(feed={"x": x}, fetch=[out.name])
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())
    assert digest(net) == before                       # the source is untouched
    return folded


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_folds_and_matches_a_float64_reference(bias, groups):
    x = rng.standard_normal((7, 4, 6, 6))
    net, out = conv_net("float64", bias, groups)
    folded = check_equal(net, out, x, 1e-12)
    assert [op.type for op in folded.ops("infer")] == ["conv2d", "elementwise_add", "relu"]
    assert [n.folded for n in folded.reports["fold_batch_norm"]] == [True]
    net32, out32 = conv_net("float32", bias, groups)
    check_equal(net32, out32, x.astype(np.float32), 1e-5)


def test_the_folded_parameters_follow_the_formula():
    net, out = conv_net("float64")
    randomise_estimates(net)
    w, b = net.var("c1.w").get(), net.var("c1.b").get()
    scale, bias = net.var("bn1.scale").get(), net.var("bn1.bias").get()
    mean, var = net.var("bn1.estimated_mean").get(), net.var("bn1.estimated_var").get()
    folded = mg.passes.fold_batch_norm(net)
    s = scale / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(folded.var("c1.w").get(), w * s[:, None, None, None], rtol=1e-15)
    np.testing.assert_allclose(folded.var("c1.b").get(), (b - mean) * s + bias, rtol=1e-14)
    names = {v.name for v in folded.persistables()}
    assert names == {"c1.w", "c1.b"}                  # the batch norm's state is gone


def test_a_sync_batch_norm_folds_too():
    """The pass finds batch norms by their declared role, so sync_batch_norm (after
    convert_sync_batchnorm) folds as batch_norm does."""
    net, out = conv_net("float64")
    assert mg.passes.convert_sync_batchnorm(net) == 2           # the train and infer copies
    assert "sync_batch_norm" in [op.type for op in net.ops("infer")]
    folded = check_equal(net, out, rng.standard_normal((5, 4, 6, 6)), 1e-12)
    assert [op.type for op in folded.ops("infer")] == ["conv2d", "elementwise_add", "relu"]


@pytest.mark.parametrize("rank", [2, 4])
def test_fc_folds_rank_2_and_a_channels_last_rank_4_output(rank):
    net, out = fc_net("float64", rank)
    shape = (7, 12) if rank == 2 else (7, 3, 3, 4)
    folded = check_equal(net, out, rng.standard_normal(shape), 1e-12)
    assert "batch_norm" not in [op.type for op in folded.ops("infer")]


def test_the_example_nets_fold_to_1e_5(tmp_path):
    from minigraph.examples import train_digits, train_resnet_digits

    for build in (train_digits.build_net, train_resnet_digits.build_net):
        net, h = build(seed=0)
        for _ in range(3):
            net.train(feed={"image": rng.random((16, 1, 8, 8), dtype=np.float32),
                            "label": rng.integers(0, 10, 16)})
        x = rng.random((7, 1, 8, 8), dtype=np.float32)
        folded = mg.passes.fold_batch_norm(net)
        (want,) = net.infer(feed={"image": x}, fetch=[h["logits"]])
        (got,) = folded.infer(feed={"image": x}, fetch=[h["logits"].name])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_what_cannot_be_folded_stays_and_the_report_says_why(capsys):
    net, out = conv_net(share_input=True)
    folded = check_equal(net, out, rng.standard_normal((2, 4, 6, 6)).astype(np.float32), 1e-5)
    (note,) = folded.reports["fold_batch_norm"]
    assert not note.folded and "is also read by relu" in note.reason
    assert "batch_norm" in [op.type for op in folded.ops("infer")]

    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 3, 4, 4))
    out = L.batch_norm(net, L.pool2d(net, x, 2), name="bn1")
    folded = mg.passes.fold_batch_norm(net, verbose=True)
    assert "kept (its input comes from pool2d, not a conv2d or fc)" in capsys.readouterr().out
    (want,) = net.infer(feed={"x": np.ones((2, 3, 4, 4), np.float32)}, fetch=[out])
    (got,) = folded.infer(feed={"x": np.ones((2, 3, 4, 4), np.float32)}, fetch=[out.name])
    np.testing.assert_array_equal(got, want)

    net = mg.Net()                                   # channels on the wrong axis for a conv
    x = L.data(net, "x", shape=(-1, 2, 4, 4))
    h = L.conv2d(net, x, 4, 1, name="c")
    L.batch_norm(net, h, data_layout="NHWC", name="bn")
    (note,) = mg.passes.fold_batch_norm(net).reports["fold_batch_norm"]
    assert "NHWC batch norm after conv2d" in note.reason


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_channels_last_conv_folds(bias, groups):
    """conv2d NHWC -> batch_norm NHWC folds into the filter (per output channel, its
    axis 0 as in NCHW) and a bias added on the last axis; nothing is transposed."""
    net, out = conv_net(bias=bias, groups=groups, layout="NHWC")
    x = rng.standard_normal((3, 6, 6, 4)).astype(np.float32)
    folded = check_equal(net, out, x, 1e-5)
    (note,) = folded.reports["fold_batch_norm"]
    assert note.folded
    types = [op.type for op in folded.ops("infer")]
    assert "batch_norm" not in types and "transpose" not in types
    (add,) = [op for op in folded.ops("infer") if op.type == "elementwise_add"]
    assert add.attrs["axis"] == 3


def test_an_nchw_batch_norm_after_a_channels_last_conv_is_kept():
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 4, 4, 2))
    h = L.conv2d(net, x, 4, 1, name="c", data_layout="NHWC")
    L.batch_norm(net, h, name="bn")                                 # channels on axis 1
    (note,) = mg.passes.fold_batch_norm(net).reports["fold_batch_norm"]
    assert "NCHW batch norm after conv2d (whose channels are on axis 3" in note.reason


def test_the_folded_net_is_infer_only_and_the_source_still_trains():
    net, out = conv_net()
    loss = L.mean(net, out)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    folded = mg.passes.fold_batch_norm(net)
    assert folded.applied == ("fold_batch_norm",) and folded.optimizer is None
    assert folded.section("train") == () and folded.section("update") == ()
    net.train(feed={"x": np.ones((2, 4, 6, 6), np.float32)})
    assert int(net.var("bn1.num_batches").get()) == 1


# ---- arguments, and a folded net that cannot train ----------------------------------------

@pytest.mark.parametrize("fn", [mg.passes.fold_batch_norm, mg.passes.fuse_conv2d,
                                mg.passes.fuse_fc, mg.passes.optimize_for_inference,
                                mg.passes.convert_sync_batchnorm])
def test_a_pass_needs_a_net(fn):
    """fold_batch_norm("net") raised an AttributeError."""
    with pytest.raises(TypeError, match=f"{fn.__name__}: net must be a minigraph Net, got str"):
        fn("net")


def test_the_folded_net_refuses_to_train():
    """The folded net's train() used to run its inference ops and return as if trained."""
    net, out = conv_net()
    folded = mg.passes.fold_batch_norm(net)
    x = rng.standard_normal((2, 4, 6, 6)).astype(np.float32)
    before = digest(folded)
    with pytest.raises(RuntimeError, match=r"train: this is an inference net \(made by fold_batch_norm\): it computes "
                                             "'relu_0.out'"):
        folded.train(feed={"x": x}, fetch=[out.name])
    assert digest(folded) == before
    (y,) = folded.infer(feed={"x": x}, fetch=[out.name])       # it still infers
    assert y.shape[0] == 2


def test_an_inference_net_computes_the_predictions_not_the_loss():
    """fold_batch_norm kept the loss ops and the label input: fast.train() then said the
    net had no loss while its op list held softmax_with_cross_entropy and mean."""
    net = mg.Net(seed=3)
    x = L.data(net, "x", shape=(-1, 6))
    target = L.data(net, "target", shape=(-1, 2))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.relu(net, L.batch_norm(net, L.fc(net, x, 4, name="f1"), name="bn1"))
    pred = L.fc(net, h, 2, name="head")
    loss = L.add(net, L.mse_loss(net, pred, target),
                 L.mean(net, L.softmax_with_cross_entropy(net, pred, label)))
    L.accuracy(net, pred, label)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    folded = mg.passes.fold_batch_norm(net)
    assert [v.name for v in folded.default_fetches] == ["head.out"]
    assert list(folded.data_vars) == ["x"]                     # no target, no label
    types = [op.type for op in folded.ops("infer")]
    assert "softmax_with_cross_entropy" not in types and "accuracy" not in types
    xb = rng.standard_normal((5, 6)).astype(np.float32)
    (want,) = net.infer(feed={"x": xb}, fetch=[pred])
    (got,) = folded.infer(feed={"x": xb})                      # the default fetches
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # fetches chosen by name or Variable: pruned to them
    mid = mg.passes.optimize_for_inference(net, fetches=["bn1.y"])
    assert [v.name for v in mid.default_fetches] == ["bn1.y"]
    assert "head.w" not in [v.name for v in mid.persistables()]
    with pytest.raises(TypeError, match="optimize_for_inference: fetches must be a list"):
        mg.passes.optimize_for_inference(net, fetches="head.out")
    with pytest.raises(KeyError, match="fetch 'nothing'"):
        mg.passes.fold_batch_norm(net, fetches=["nothing"])


def test_a_net_without_a_loss_keeps_its_final_outputs():
    net, out = conv_net()
    folded = mg.passes.fold_batch_norm(net)
    assert [v.name for v in folded.default_fetches] == [out.name]
    empty = mg.Net(seed=0)
    L.data(empty, "x", shape=(-1, 3))
    with pytest.raises(ValueError, match="cannot tell what the inference net computes; pass "
                                         "fetches="):
        mg.passes.fold_batch_norm(empty)


def test_default_fetches_of_the_train_branch_or_of_nothing_computed():
    """A default fetch set to a train-branch Variable (a layer's output after a dropout
    forks the net) stands for its infer copy, as a fetch does; one the infer branch
    neither computes nor reads is an error naming it (both were a bare KeyError)."""
    net = mg.Net(seed=3)
    x = L.data(net, "x", shape=(-1, 6))
    h = L.dropout(net, L.fc(net, x, 4, name="f1"), 0.5, name="d1")
    pred = L.fc(net, h, 2, name="head")
    mg.optimizer.SGD(0.1).minimize(net, L.mean(net, pred))
    train_copy = net.scopes["train"].find_var("head.out")
    assert train_copy is not None and net.twin(train_copy) is not None
    net.default_fetches = (train_copy,)
    folded = mg.passes.fold_batch_norm(net)
    assert [v.name for v in folded.default_fetches] == ["head.out"]
    xb = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_allclose(folded.infer(feed={"x": xb})[0],
                               net.infer(feed={"x": xb}, fetch=[pred])[0], rtol=1e-6)
    net.default_fetches = (net.var("head.w"),)                 # no infer op writes it
    with pytest.raises(ValueError, match="fold_batch_norm: no op of the infer branch "
                                         "computes or reads 'head.w'"):
        mg.passes.fold_batch_norm(net)
