"""ONNX export (minigraph/onnx_export.py and the ops' exporters): every test net
passes the full ONNX check, and onnxruntime and onnx's reference evaluator
both give net.infer's outputs at batch sizes 1 and 7 from one file."""
import subprocess
import sys

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L
from minigraph.schema import Meta, OpSchema, Slot, kernel, register

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx_helpers import assert_close, max_differences, onnx_outputs  # noqa: E402

from minigraph.examples import train_digits, train_resnet_digits  # noqa: E402

register(OpSchema(type="test_onnx_unmapped", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  infer=lambda ins, attrs: {"out": Meta(ins["x"].shape, ins["x"].dtype)},
                  no_export="a test op that says why"))


@kernel("test_onnx_unmapped", "cpu")
def _unmapped(op, ins, ctx):
    return {"out": ins["x"] * 2}


# ---- nets ----------------------------------------------------------------------------

def trained(net, loss, feeds, steps=3):
    for k in range(steps):
        net.train(feed=feeds(np.random.default_rng(100 + k), 16), fetch=[loss])
    return net


def digits_feed(rng, n):
    return {"image": rng.standard_normal((n, 1, 8, 8)).astype("float32"),
            "label": rng.integers(0, 10, n)}


def zoo_feed(rng, n):
    return {"image": rng.standard_normal((n, 3, 8, 8)).astype("float32"),
            "label": rng.integers(0, 10, n)}


@pytest.fixture(scope="module")
def digits():
    net, h = train_digits.build_net(seed=0)
    return trained(net, h["loss"], digits_feed), h


@pytest.fixture(scope="module")
def resnet():
    net, h = train_resnet_digits.build_net(seed=0, epochs=3, steps_per_epoch=2)
    return trained(net, h["loss"], digits_feed), h


def build_zoo(seed=0):
    """Every activation, softmax, argmax, transpose, reshape, flatten(1, 2), multiply
    (broadcast), add, sum, avg pool with padding, max pool with stride != size,
    global max pool, grouped dilated conv, NHWC batch norm, a computed
    elementwise_add y, fill_constant, cross entropy, mean and accuracy."""
    net = mg.Net(seed=seed)
    img = L.data(net, "image", shape=(-1, 3, 8, 8))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    c = L.conv2d(net, img, 6, 3, padding=2, dilation=2, groups=3, name="gconv")   # (N,6,8,8)
    a = L.sigmoid(net, L.pool2d(net, c, 3, "avg", pool_stride=2, pool_padding=1))  # (N,6,4,4)
    m = L.tanh(net, L.relu(net, L.pool2d(net, c, 3, "max", pool_stride=2,
                                         pool_padding=1)))                        # (N,6,4,4)
    g = L.pool2d(net, c, pool_type="max", global_pooling=True)                    # (N,6,1,1)
    p = L.multiply(net, a, L.gelu(net, g))                                          # broadcast
    p = L.add(net, p, m)
    t = L.transpose(net, p, (0, 2, 3, 1))                                           # NHWC
    b = L.batch_norm(net, t, data_layout="NHWC", name="bn_nhwc")                    # forks
    two = net.append("fill_constant", {}, {"out": "two"},
                     {"shape": (1,), "dtype": "float32", "value": 2.0})["out"]
    b = L.multiply(net, b, two)
    v = L.flatten(net, L.pool2d(net, c, pool_type="avg", global_pooling=True))      # (N,6)
    nchw = L.transpose(net, b, (0, 3, 1, 2))
    e = net.append("elementwise_add", {"x": nchw, "y": v}, {"out": "ew.out"},
                   {"axis": 0})["out"]                                              # y (N,6)
    s = net.append("sum", {"x": [e, nchw]}, {"out": "sum.out"})["out"]
    f = L.flatten(net, s, start_axis=1, stop_axis=2)                                # (N,24,4)
    r = L.leaky_relu(net, L.reshape(net, f, (-1, 96)), alpha=0.2)
    logits = L.fc(net, r, 10, name="head")
    probs = L.softmax(net, logits, axis=-1)
    pred = L.argmax(net, probs)
    xent = L.softmax_with_cross_entropy(net, logits, lbl)
    loss = L.mean(net, xent)
    acc = L.accuracy(net, logits, lbl)
    mg.optimizer.Momentum(learning_rate=0.05).minimize(net, loss)
    return net, {"flat": f, "logits": logits, "probs": probs, "pred": pred, "xent": xent,
                 "loss": loss, "acc": acc}


@pytest.fixture(scope="module")
def zoo():
    net, h = build_zoo()
    return trained(net, h["loss"], zoo_feed), h


# ---- the nets export and run -----------------------------------------------------------

def test_digits_net(digits, tmp_path):
    net, h = digits
    path = mg.onnx.export(net, tmp_path / "digits.onnx", feeds=["image"], fetches=[h["logits"]])
    assert path == tmp_path / "digits.onnx"
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["image"]
    assert [o.name for o in model.graph.output] == [h["logits"].name]
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["N", 1, 8, 8]
    out_dims = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in out_dims] == ["N", 10]
    names = {i.name for i in model.graph.initializer}
    assert {"conv1.w", "bn1.estimated_mean", "bn2.estimated_var", "fc2.w"} <= names
    assert not any(n.endswith(".num_batches") for n in names)
    types = [n.op_type for n in model.graph.node]
    assert types.count("BatchNormalization") == 2 and "Conv" in types and "MaxPool" in types
    mean = next(i for i in model.graph.initializer if i.name == "bn1.estimated_mean")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(mean),
                                  net.var("bn1.estimated_mean").get())
    assert np.abs(net.var("bn1.estimated_mean").get()).max() > 0      # trained estimates
    max_differences(net, path, [h["logits"]], digits_feed, ["image"])


def test_resnet_net(resnet, tmp_path):
    net, h = resnet
    path = mg.onnx.export(net, tmp_path / "resnet.onnx", feeds=[net.data_vars["image"]],
                          fetches=[h["logits"].name])
    types = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Conv", "BatchNormalization", "Add", "Concat", "GlobalAveragePool", "Flatten",
            "Identity", "MatMul"} <= types
    max_differences(net, path, [h["logits"]], digits_feed, ["image"])


def test_every_layer_net(zoo, tmp_path):
    net, h = zoo
    fetches = [h[k] for k in ("flat", "logits", "probs", "pred", "xent", "loss", "acc")]
    path = mg.onnx.export(net, tmp_path / "zoo.onnx", feeds=["image", "label"], fetches=fetches)
    model = onnx.load(str(path))
    types = {n.op_type for n in model.graph.node}
    assert {"AveragePool", "MaxPool", "GlobalMaxPool", "Sigmoid", "Tanh", "Erf", "LeakyRelu",
            "Relu", "Softmax", "ArgMax", "Transpose", "Reshape", "Mul", "Unsqueeze", "Sum",
            "GatherElements", "ReduceMean", "Constant"} <= types
    avg = next(n for n in model.graph.node if n.op_type == "AveragePool")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in avg.attribute}
    assert attrs["count_include_pad"] == 0 and list(attrs["pads"]) == [1, 1, 1, 1]
    out_types = [o.type.tensor_type.elem_type for o in model.graph.output]
    assert out_types[3] == onnx.TensorProto.INT64 and out_types[6] == onnx.TensorProto.FLOAT
    flat_dims = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in flat_dims] == ["N", 24, 4]
    max_differences(net, path, fetches, zoo_feed, ["image", "label"])


@pytest.mark.parametrize("opset", [13, 20, 23, 24])
def test_other_opsets(zoo, tmp_path, opset):
    net, h = zoo
    fetches = [h["probs"], h["loss"]]
    path = mg.onnx.export(net, tmp_path / "zoo.onnx", ["image", "label"], fetches, opset=opset)
    assert onnx.load(str(path)).opset_import[0].version == opset
    # onnx.reference's BatchNormalization-9 (opsets 9-13) takes the schema's default
    # momentum for training mode and blends in batch statistics (onnx/onnx PR #8442),
    # so below opset 14 only onnxruntime is the judge
    runtimes = ("ort", "reference") if opset >= 14 else ("ort",)
    max_differences(net, path, fetches, zoo_feed, ["image", "label"], sizes=(7,),
                    runtimes=runtimes)


def test_folded_batch_norms(digits, tmp_path):
    net, h = digits
    folded = mg.passes.fold_batch_norm(net)
    path = mg.onnx.export(folded, tmp_path / "folded.onnx", feeds=["image"],
                          fetches=[h["logits"].name])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "BatchNormalization" not in types
    worst = {}
    for n in (1, 7):
        x = digits_feed(np.random.default_rng(n), n)["image"]
        (want,) = net.infer(feed={"image": x}, fetch=[h["logits"]])
        for runtime, (got,) in onnx_outputs(path, {"image": x}).items():
            assert_close(got, want, f"{runtime}, N={n}")
            worst[runtime, n] = float(np.abs(got - want).max())
    assert worst


def test_optimize_for_inference_of_a_residual_net(resnet, tmp_path):
    """fused_conv2d exports as Conv (its bias as Conv's third input), Add and Relu;
    the fused net's ONNX file equals net.infer (and the fused net) to 1e-5."""
    net, h = resnet
    fast = mg.passes.optimize_for_inference(net)
    notes = fast.reports["fuse_conv2d"]
    assert any("add" in n.ops and "relu" in n.ops for n in notes)      # a residual chain
    path = mg.onnx.export(fast, tmp_path / "fast.onnx", feeds=["image"],
                          fetches=[h["logits"].name])
    graph = onnx.load(str(path)).graph
    types = [n.op_type for n in graph.node]
    assert types.count("BatchNormalization") == sum(op.schema.has_role("batch_norm")
                                                    for op in fast.ops("infer"))
    assert types.count("Conv") == sum(op.type in ("conv2d", "fused_conv2d")
                                      for op in fast.ops("infer"))
    assert any(len(n.input) == 3 for n in graph.node if n.op_type == "Conv")
    for n in (1, 7):
        x = digits_feed(np.random.default_rng(n), n)["image"]
        (want,) = net.infer(feed={"image": x}, fetch=[h["logits"]])
        (fused,) = fast.infer(feed={"image": x}, fetch=[h["logits"].name])
        assert_close(fused, want)
        for runtime, (got,) in onnx_outputs(path, {"image": x}).items():
            assert_close(got, want, f"{runtime}, N={n}")


def norms_net():
    """layer_norm (with and without affine), group_norm, instance_norm and batch norms
    without scale and bias, and without running estimates, trained a few steps."""
    net = mg.Net(seed=3)
    img = L.data(net, "image", shape=(-1, 4, 5, 5))
    h = L.group_norm(net, L.conv2d(net, img, 6, 3, padding=1, name="c1"), 3, name="gn")
    h = L.instance_norm(net, L.relu(net, h), name="inn")
    h = L.batch_norm(net, h, affine=False, name="bn_plain")
    h = L.batch_norm(net, h, track_running_stats=False, name="bn_batch")
    h = L.batch_norm(net, L.transpose(net, h, (0, 2, 3, 1)), data_layout="NHWC",
                     track_running_stats=False, affine=False, name="bn_nhwc")
    f = L.layer_norm(net, L.flatten(net, h), name="ln")
    r = L.layer_norm(net, L.reshape(net, f, (-1, 6, 25)), begin_norm_axis=2, scale=False,
                     shift=False, name="ln_bare")
    logits = L.fc(net, r, 3, name="head")
    loss = L.mean(net, L.multiply(net, logits, logits))
    mg.optimizer.SGD(0.05).minimize(net, loss)
    feed = lambda rng, n: {"image": rng.standard_normal((n, 4, 5, 5)).astype("float32")}  # noqa
    return trained(net, loss, feed), logits, feed


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_the_normalisations_and_batch_norm_options(tmp_path, opset):
    """LayerNormalization (opset 17+; its moments spelled out before), group_norm as
    InstanceNormalization of a reshape, InstanceNormalization, a batch norm without
    scale and bias as BatchNormalization with ones and zeros, one without estimates
    as the batch's moments: onnxruntime and the reference evaluator equal net.infer
    at batch sizes 2 and 7 (the batch-statistics ones need more than one row)."""
    net, logits, feed = norms_net()
    path = mg.onnx.export(net, tmp_path / "norms.onnx", ["image"], [logits], opset=opset)
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types.count("InstanceNormalization") == 2
    assert types.count("LayerNormalization") == (2 if opset >= 17 else 0)
    assert types.count("BatchNormalization") == 1
    max_differences(net, path, [logits], feed, ["image"], sizes=(2, 7))


def test_silu_exports_as_x_times_sigmoid(tmp_path):
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 5))
    y = L.fc(net, L.silu(net, L.fc(net, x, 8, name="a")), 3, name="b")
    path = mg.onnx.export(net, tmp_path / "silu.onnx", ["x"], [y])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "Sigmoid" in types and "Mul" in types
    feed = lambda rng, n: {"x": 4 * rng.standard_normal((n, 5)).astype("float32")}  # noqa: E731
    max_differences(net, path, [y], feed, ["x"])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mul_with_several_row_dims(tmp_path, dtype):
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 2, 3, 4), dtype=dtype)
    c = L.conv2d(net, x, 3, 3, padding=1, name="c")                     # (N, 3, 3, 4)
    p = L.pool2d(net, c, 2, "avg")                                      # (N, 3, 1, 2)
    w2 = net.create_parameter("w2", (2, 5), dtype, mg.initializer.Normal(0.0, 1.0))
    w3 = net.create_parameter("w3", (12, 5), dtype, mg.initializer.Normal(0.0, 1.0))
    y = net.append("mul", {"x": p, "y": w2}, {"out": "m3.out"}, {"x_num_col_dims": 3})["out"]
    z = net.append("mul", {"x": c, "y": w3}, {"out": "m2.out"}, {"x_num_col_dims": 2})["out"]
    path = mg.onnx.export(net, tmp_path / "m.onnx", ["x"], [y, z])
    model = onnx.load(str(path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype))

    def feed(rng, n):
        return {"x": rng.standard_normal((n, 2, 3, 4)).astype(dtype)}
    # onnxruntime's CPU provider has no float64 Conv kernel; the reference evaluator has
    runtimes = ("ort", "reference") if dtype == "float32" else ("reference",)
    max_differences(net, path, [y, z], feed, ["x"], runtimes=runtimes)


def test_optimize_for_inference_of_an_mlp_with_fused_fc(tmp_path):
    """fused_fc exports as MatMul, Add of the bias and Relu (a Flatten first for x of
    rank 3); the ONNX file equals net.infer to 1e-5."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 2, 6))
    h = L.relu(net, L.batch_norm(net, L.fc(net, x, 8, name="a"), name="a_bn"))
    h = L.relu(net, L.fc(net, h, 8, name="b", bias=False))
    y = L.fc(net, h, 3, name="c")
    fast = mg.passes.optimize_for_inference(net)
    assert [op.type for op in fast.section("trunk")] == ["fused_fc"] * 3
    path = mg.onnx.export(fast, tmp_path / "mlp.onnx", ["x"], [y.name])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types == ["Flatten", "MatMul", "Add", "Relu", "MatMul", "Relu", "MatMul", "Add"]
    for n in (1, 5):
        v = np.random.default_rng(n).standard_normal((n, 2, 6)).astype(np.float32)
        (want,) = net.infer(feed={"x": v}, fetch=[y])
        for runtime, (got,) in onnx_outputs(path, {"x": v}).items():
            assert_close(got, want, f"{runtime}, N={n}")


def test_fused_fc_with_a_residual_and_gelu(tmp_path):
    """A transformer MLP's fused_fc ops export as MatMul, Add of the bias, then gelu's
    five nodes, and MatMul, Add of the bias, Add of the residual; equal to net.infer."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, -1, 6))
    h = L.linear(net, x, 6, name="inp")
    m = L.gelu(net, L.linear(net, h, 12, name="fc"))
    y = L.add(net, h, L.linear(net, m, 6, name="proj"), name="res")
    fast = mg.passes.optimize_for_inference(net)
    assert [op.type for op in fast.section("trunk")] == ["fused_fc"] * 3
    assert [op.attrs["activation"] for op in fast.section("trunk")] == ["none", "gelu", "none"]
    path = mg.onnx.export(fast, tmp_path / "mlp.onnx", ["x"], [y.name])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types == ["MatMul", "Add", "MatMul", "Add", "Div", "Erf", "Add", "Mul", "Mul",
                     "MatMul", "Add", "Add"]
    for shape in ((1, 1, 6), (3, 5, 6)):
        v = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
        (want,) = net.infer(feed={"x": v}, fetch=[y])
        for runtime, (got,) in onnx_outputs(path, {"x": v}).items():
            assert_close(got, want, f"{runtime}, shape {shape}")


# ---- errors ----------------------------------------------------------------------------

def test_an_op_without_an_exporter_is_an_error_naming_it_and_why(tmp_path):
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4))
    y = net.append("test_onnx_unmapped", {"x": x}, {"out": "odd.out"})["out"]
    out = L.relu(net, y)
    with pytest.raises(mg.onnx.ExportError,
                       match=r"'test_onnx_unmapped'.*'odd\.out'.*no ONNX exporter \(a test op"):
        mg.onnx.export(net, tmp_path / "m.onnx", ["x"], [out])
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("opset", [12, 25, "17", 17.0, True])
def test_a_bad_opset_is_an_error(digits, tmp_path, opset):
    net, h = digits
    with pytest.raises(mg.onnx.ExportError, match="opset must be an int from 13 to 24"):
        mg.onnx.export(net, tmp_path / "m.onnx", ["image"], [h["logits"]], opset=opset)


def test_a_train_only_fetch_is_an_error(digits, tmp_path):
    net, h = digits
    grad = net.grad(net.var("fc2.w"))
    with pytest.raises(mg.onnx.ExportError, match=repr(grad.name)):
        mg.onnx.export(net, tmp_path / "m.onnx", ["image"], [grad])


def test_a_persistable_or_training_output_fetch_is_an_error(digits, tmp_path):
    net, h = digits
    with pytest.raises(mg.onnx.ExportError, match=r"computes the fetch 'fc2\.w'"):
        mg.onnx.export(net, tmp_path / "m.onnx", ["image"], [net.var("fc2.w")])
    with pytest.raises(mg.onnx.ExportError, match=r"'batch_mean'.*not computed in inference"):
        mg.onnx.export(net, tmp_path / "m.onnx", ["image"], [net.var("bn1.batch_mean", "infer")])


def test_feeds_must_be_data(digits, tmp_path):
    net, h = digits
    for bad in ("conv1.w", net.var("conv1.w"), "nope", h["logits"]):
        with pytest.raises(mg.onnx.ExportError, match="is not a data variable"):
            mg.onnx.export(net, tmp_path / "m.onnx", [bad], [h["logits"]])
    with pytest.raises(mg.onnx.ExportError, match="given twice"):
        mg.onnx.export(net, tmp_path / "m.onnx", ["image", "image"], [h["logits"]])


def test_a_needed_data_variable_must_be_fed(digits, tmp_path):
    net, h = digits
    with pytest.raises(mg.onnx.ExportError, match="need the data 'label'") as info:
        mg.onnx.export(net, tmp_path / "m.onnx", ["image"], [h["loss"]])
    assert str(info.value).count("onnx.export") == 1


def test_the_file_is_written_atomically(digits, tmp_path):
    net, h = digits
    path = tmp_path / "m.onnx"
    path.write_bytes(b"old")
    with pytest.raises(mg.onnx.ExportError):
        mg.onnx.export(net, path, ["image"], [h["logits"]], opset=99)
    assert path.read_bytes() == b"old"
    mg.onnx.export(net, path, ["image"], [h["logits"]])
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


# ---- the optional dependency -----------------------------------------------------------

def test_importing_minigraph_imports_no_onnx():
    code = ("import sys, minigraph as mg; m = mg.onnx; assert callable(m.export); "
            "from minigraph import onnx as o; assert o is m; "
            "assert 'onnx' not in sys.modules, 'onnx imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_export_without_onnx_says_how_to_install_it(digits, tmp_path, monkeypatch):
    net, h = digits
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match=r"pip install 'minigraph\[onnx\]'"):
        mg.onnx.export(net, tmp_path / "m.onnx", ["image"], [h["logits"]])

