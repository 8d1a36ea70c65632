"""fused_fc (mul + bias + residual + relu or gelu, inference-only) and the pass that
builds it: fuse_fc, part of optimize_for_inference."""
import math

import numpy as np
import pytest
from helpers import helper_test_op, same_as_twin, trained_on

import minigraph as mg
from minigraph import layers as L
from minigraph.initializer import Normal
from minigraph.kernels.cpu import blocks, choices

rng = np.random.default_rng(0)


def fused_reference(x, y, bias=None, residual=None, activation="none", x_num_col_dims=1,
                    weight_fixed=True):
    rows = int(np.prod(x.shape[:x_num_col_dims]))
    out = (x.reshape(rows, -1) @ y).reshape(x.shape[:x_num_col_dims] + (y.shape[1],))
    if bias is not None:
        out = out + bias
    if residual is not None:
        out = out + residual
    if activation == "relu":
        out = np.maximum(out, 0.0)
    if activation == "gelu":
        out = out * 0.5 * np.vectorize(math.erfc)(-out / math.sqrt(2.0))
    return {"out": out}


SHAPES = [((5, 7), (7, 3), 1), ((2, 3, 4), (12, 6), 1), ((2, 3, 4), (4, 5), 2),
          ((1, 1), (1, 1), 1), ((64, 33), (33, 130), 1)]


@pytest.mark.parametrize("x_shape, y_shape, cols", SHAPES)
@pytest.mark.parametrize("bias, activation", [(True, "relu"), (True, "none"), (False, "relu"),
                                              (False, "none")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weight_fixed", [True, False])
def test_fused_fc_against_the_float64_reference(x_shape, y_shape, cols, bias, activation,
                                                dtype, weight_fixed, cpu_engine):
    ins = {"x": rng.standard_normal(x_shape).astype(dtype),
           "y": rng.standard_normal(y_shape).astype(dtype)}
    if bias:
        ins["bias"] = rng.standard_normal(y_shape[1]).astype(dtype)
    tol = {} if dtype == "float64" else {"atol": 1e-5, "rtol": 1e-4}
    out = helper_test_op("fused_fc", ins, {"x_num_col_dims": cols, "activation": activation,
                                           "weight_fixed": weight_fixed},
                         fused_reference, **tol)["out"]
    if activation == "relu":
        assert (out >= 0).all()


@pytest.mark.parametrize("x_shape, y_shape, cols, residual_shape", [
    ((3, 16), (16, 8), 1, (3, 8)),                  # float32: the few-rows kernel adds it
    ((1, 2, 16), (16, 8), 2, (1, 2, 8)),
    ((2, 3, 16), (16, 8), 2, (2, 3, 8)),            # 6 rows: BLAS's product
    ((4, 16), (16, 8), 1, (8,)),                    # broadcast to the product's shape
    ((4, 16), (16, 8), 1, (2, 1, 1)),               # broadcast beyond it: out (2, 4, 8)
    ((64, 33), (33, 130), 1, (64, 130))])           # the native kernel, for a fixed weight
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weight_fixed", [True, False])
def test_fused_fc_with_a_residual_and_gelu_against_the_float64_reference(
        x_shape, y_shape, cols, residual_shape, activation, dtype, weight_fixed, cpu_engine):
    ins = {"x": rng.standard_normal(x_shape).astype(dtype),
           "y": rng.standard_normal(y_shape).astype(dtype),
           "bias": rng.standard_normal(y_shape[1]).astype(dtype),
           "residual": rng.standard_normal(residual_shape).astype(dtype)}
    tol = {} if dtype == "float64" else {"atol": 2e-5, "rtol": 1e-4}
    out = helper_test_op("fused_fc", ins, {"x_num_col_dims": cols, "activation": activation,
                                           "weight_fixed": weight_fixed},
                         fused_reference, **tol)["out"]
    assert out.shape == np.broadcast_shapes(x_shape[:cols] + y_shape[1:], residual_shape)


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_each_step_gives_the_bits_of_the_op_it_replaces(rows):
    """float32 fused_fc with a bias, a residual and gelu (or relu) equals the unfused
    ops' kernels run one after the other, bit for bit, on the few-rows kernel (rows
    <= 4) and on BLAS's product."""
    r = np.random.default_rng(rows)
    x, y = r.standard_normal((rows, 64)).astype(np.float32), r.standard_normal(
        (64, 96)).astype(np.float32)
    bias, res = r.standard_normal(96).astype(np.float32), r.standard_normal(
        (rows, 96)).astype(np.float32)
    for act in ("gelu", "relu"):
        want = helper_test_op("fused_fc", {"x": x, "y": y, "bias": bias},
                              {"weight_fixed": False})["out"]
        want = helper_test_op("add", {"x": res, "y": want})["out"]
        want = helper_test_op(act, {"x": want})["out"]
        got = helper_test_op("fused_fc", {"x": x, "y": y, "bias": bias, "residual": res},
                             {"weight_fixed": False, "activation": act})["out"]
        assert got.tobytes() == want.tobytes(), act


def test_relu_keeps_nan_and_zeroes_minus_infinity():
    x = np.array([[np.nan], [-np.inf], [2.0]], np.float32)
    out = helper_test_op("fused_fc", {"x": x, "y": np.ones((1, 1), np.float32),
                                      "bias": np.ones(1, np.float32)},
                         {"activation": "relu"})["out"]
    assert np.isnan(out[0, 0]) and out[1:, 0].tolist() == [0.0, 3.0]


def build(x_shape, y_shape, bias_shape=None, dtype="float32", residual_shape=None,
          dtype_residual="float32", **attrs):
    scope = mg.Scope()
    slots = {}
    dtypes = {"bias": "float32", "residual": dtype_residual}
    for name, shape in (("x", x_shape), ("y", y_shape), ("bias", bias_shape),
                        ("residual", residual_shape)):
        if shape is not None:
            slots[name] = scope.new_var(name)
            slots[name].declare(shape, dtypes.get(name, dtype))
    return mg.Operator("fused_fc", out=scope.new_var("out"), **slots, **attrs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias_shape=(5,)), r"fused_fc: input 'bias' must have shape \(4,\) \(one value per "
                            r"column of 'y'\)"),
    (dict(y_shape=(7, 4)), r"fused_fc: input 'y' must have 6 rows"),
    (dict(activation="tanh"), r"fused_fc: attribute 'activation' must be one of"),
    (dict(residual_shape=(2, 4), dtype_residual="float64"),
     r"fused_fc: input 'residual'.*float64.*float32"),
    (dict(residual_shape=(3, 4)), r"fused_fc: input 'residual' with shape \(3, 4\) does not "
                                  r"broadcast with the product with shape \(2, 4\)"),
    (dict(x_num_col_dims=0), r"fused_fc: attribute 'x_num_col_dims'"),
    (dict(weight_fixed="no"), r"fused_fc: attribute 'weight_fixed'"),
    (dict(bias_shape=(4,), dtype="float64"), r"fused_fc: input 'bias'.*float32.*float64"),
])
def test_fused_fc_bad_inputs_name_the_op_and_slot(kwargs, match):
    args = dict(x_shape=(2, 6), y_shape=(6, 4))
    args.update({k: kwargs.pop(k) for k in ("y_shape", "bias_shape", "dtype", "residual_shape",
                                            "dtype_residual") if k in kwargs})
    with pytest.raises(mg.OpError, match=match):
        build(**args, **kwargs)


def test_fused_fc_has_no_gradient():
    op = build((2, 6), (6, 4), bias_shape=(4,))
    with pytest.raises(mg.OpError, match="fused_fc: an inference-only op, it has no gradient"):
        op.schema.grad(op, {"out": op.outputs["out"]}, lambda v: v)


def mlp(seed=0, steps=3):
    """784-wide input scaled down: fc-BN-ReLU twice, then an fc head, trained a little."""
    net = mg.Net(seed=seed)
    x = L.data(net, "x", shape=(-1, 12))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = x
    for i in range(2):
        h = L.relu(net, L.batch_norm(net, L.fc(net, h, 16, name=f"fc{i}"), name=f"bn{i}"))
    logits = L.fc(net, h, 5, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Adam(1e-2).minimize(net, loss)
    r = np.random.default_rng(seed)
    for _ in range(steps):
        net.train(feed={"x": r.standard_normal((8, 12)).astype(np.float32),
                        "label": r.integers(0, 5, 8)})
    return net, logits


def test_optimize_for_inference_fuses_each_fc_layer():
    net, logits = mlp()
    x = np.random.default_rng(1).standard_normal((9, 12)).astype(np.float32)
    (want,) = net.infer(feed={"x": x}, fetch=[logits])
    fast = mg.passes.optimize_for_inference(net)
    (got,) = fast.infer(feed={"x": x}, fetch=[logits.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    types = [op.type for op in fast.section("trunk")]
    assert types == ["fused_fc"] * 3             # the loss is left out: what it reads is computed
    assert list(fast.data_vars) == ["x"] and [v.name for v in fast.default_fetches] == ["head.out"]
    assert [op.layer for op in fast.section("trunk")] == ["fc0", "fc1", "head"]
    assert [str(n) for n in fast.reports["fuse_fc"]] == [
        "mul + elementwise_add + relu -> fused_fc computing 'relu_0.out'",
        "mul + elementwise_add + relu -> fused_fc computing 'relu_1.out'",
        "mul + elementwise_add -> fused_fc computing 'head.out'"]
    assert fast.applied == ("fold_batch_norm", "remove_dropout", "fuse_conv2d", "fuse_fc",
                            "fuse_separable_conv2d")
    assert "fused_fc" not in [op.type for op in net.ops("infer")]      # source untouched


def test_a_value_read_twice_or_fetched_by_default_ends_the_chain():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 6))
    h = L.fc(net, x, 4, name="a")                       # a.out: read by relu and add
    s = L.add(net, L.relu(net, h), h)
    g = L.relu(net, L.fc(net, s, 4, name="b"))
    c = L.relu(net, L.fc(net, g, 3, name="c", bias=False))
    net.default_fetches = (s, net.var("b.out"), c)       # b.out: fetched
    fast = mg.passes.fold_batch_norm(net)
    mg.passes.fuse_fc(fast)
    assert [op.type for op in fast.section("trunk")] == \
        ["fused_fc", "relu", "add", "fused_fc", "relu", "fused_fc"]
    assert [str(n) for n in fast.reports["fuse_fc"]] == [
        "mul + elementwise_add -> fused_fc computing 'a.out'",
        "mul + elementwise_add -> fused_fc computing 'b.out'",
        "mul + relu -> fused_fc computing 'relu_2.out'"]
    v = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    for got, want in zip(fast.infer(feed={"x": v}), net.infer(feed={"x": v})):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_bias_add_on_another_axis_is_not_fused():
    """mul with x_num_col_dims=2 makes (N, T, M); a bias of T values added on axis 1
    (T = M here, so the shapes agree) is not the layer's bias: the product and
    relu fuse, the add stays."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 3, 4))
    w = net.create_parameter("w", (4, 3), "float32", Normal(0.0, 1.0))
    b = net.create_parameter("b", (3,), "float32", Normal(0.0, 1.0))
    m = net.append("mul", {"x": x, "y": w}, {"out": "m"}, {"x_num_col_dims": 2})["out"]
    s = net.append("elementwise_add", {"x": m, "y": b}, {"out": "s"}, {"axis": 1})["out"]
    r = L.relu(net, s)
    r2 = L.relu(net, net.append("mul", {"x": x, "y": w}, {"out": "m2"},
                                {"x_num_col_dims": 2})["out"])
    net.default_fetches = (r, r2)
    fast = mg.passes.fold_batch_norm(net)
    mg.passes.fuse_fc(fast)
    assert [op.type for op in fast.section("trunk")] == \
        ["mul", "elementwise_add", "relu", "fused_fc"]
    v = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32)
    for got, want in zip(fast.infer(feed={"x": v}), net.infer(feed={"x": v})):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_fuse_fc_runs_once_and_fuse_conv2d_refuses_a_training_net():
    net, _ = mlp(steps=1)
    with pytest.raises(ValueError, match="fuse_conv2d: needs an infer-only net"):
        mg.passes.fuse_conv2d(net)
    fast = mg.passes.optimize_for_inference(net)
    with pytest.raises(ValueError, match="fuse_fc: already applied"):
        mg.passes.fuse_fc(fast)
    mg.passes.fuse_fc(net)
    with pytest.raises(ValueError, match="fuse_fc: already applied"):
        mg.passes.fuse_fc(net)


def wide_net(seed=0):
    """A training net (forked by its dropout) with linear layers on (N, T, 16) whose
    products are large enough for the native kernel (which packs a fixed weight); the
    layer before the dropout is in the trunk, which training runs too."""
    net = mg.Net(seed=seed)
    x = L.data(net, "x", shape=(-1, 32, 16))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.dropout(net, L.linear(net, x, 16, name="pre"), 0.2)   # in the trunk: training's too
    h = L.relu(net, L.linear(net, h, 256, name="a"))
    h = L.relu(net, L.linear(net, h, 64, name="b"))
    logits = L.fc(net, h, 5, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Adam(1e-2).minimize(net, loss)
    return net, logits


def test_in_a_training_net_fuse_fc_fuses_the_infer_branch_and_leaves_the_weights_trainable():
    """The infer branch's chains become fused_fc ops with weight_fixed=False: net.infer
    gives an unfused twin's bits (its products on BLAS) before and after training
    steps (the weights are never packed nor made read-only, so the optimizer's
    in-place updates show), and the train branch, backward and updates keep their
    ops."""
    plain, plain_logits = wide_net()
    net, logits = wide_net()
    before = {s: [op.type for op in net.section(s)] for s in ("train", "backward", "update")}
    notes = mg.passes.fuse_fc(net)
    assert [str(n) for n in notes] == [
        "mul + elementwise_add + relu -> fused_fc computing 'relu_0.out'",
        "mul + elementwise_add + relu -> fused_fc computing 'relu_1.out'",
        "mul + elementwise_add -> fused_fc computing 'head.out'"]
    fused = [op for op in net.section("infer") if op.type == "fused_fc"]
    assert len(fused) == 3 and not any(op.attrs["weight_fixed"] for op in fused)
    assert "mul" not in [op.type for op in net.section("infer")]
    assert [op.type for op in net.section("trunk")] == ["mul", "elementwise_add"]
    assert {s: [op.type for op in net.section(s)] for s in before} == before
    r = np.random.default_rng(4)
    x = r.standard_normal((24, 32, 16)).astype(np.float32)
    # the twin's products on BLAS, as fused_fc's with a trainable weight, and one
    # thread, whose steps choose no threads per op (each net would choose its own)
    with choices.forcing({"mm": "blas"}), blocks.num_threads(1):
        for step in range(3):
            (got,) = net.infer(feed={"x": x}, fetch=[logits])
            (want,) = plain.infer(feed={"x": x}, fetch=[plain_logits])
            assert got.tobytes() == want.tobytes(), step
            assert net.var("a.w").get().flags.writeable
            assert net.var("b.w").get().flags.writeable
            feed = {"x": x, "label": r.integers(0, 5, 24)}
            net.train(feed=feed)
            plain.train(feed=feed)
    fast = mg.passes.optimize_for_inference(net)       # a copy: its weights are fixed
    assert [op.attrs["weight_fixed"] for op in fast.section("trunk")
            if op.type == "fused_fc"] == [True] * 4     # "pre" fused there too
    (got,) = fast.infer(feed={"x": x})
    np.testing.assert_allclose(got, net.infer(feed={"x": x}, fetch=[logits])[0],
                               rtol=1e-5, atol=1e-6)
    assert net.var("a.w").get().flags.writeable


def block_net(seed=0):
    """A training net (forked by its dropout) with a transformer block's MLP on (N, T,
    16): h + proj(gelu(fc(h)))."""
    net = mg.Net(seed=seed)
    x = L.data(net, "x", shape=(-1, -1, 16))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.dropout(net, L.linear(net, x, 16, name="inp"), 0.1)
    m = L.gelu(net, L.linear(net, h, 64, name="fc"))
    h = L.add(net, h, L.linear(net, m, 16, name="proj"), name="res")
    logits = L.linear(net, h, 5, name="head")
    return trained_on(net, logits, label)


def test_a_transformer_mlp_fuses_its_gelu_and_residual_with_the_unfused_bits():
    """fc -> gelu and proj -> residual add fuse in a training net's infer branch; net.infer
    gives an unfused twin's bits on the few-rows kernel (2 rows, a generated token's)
    and on BLAS (15 rows), as the weights train."""
    plain, plain_logits = block_net()
    net, logits = block_net()
    assert [str(n) for n in mg.passes.fuse_fc(net)] == [
        "mul + elementwise_add + gelu -> fused_fc computing 'gelu_0.out'",
        "mul + elementwise_add + add -> fused_fc computing 'res.out'",
        "mul + elementwise_add -> fused_fc computing 'head.out'"]
    assert [op.type for op in net.section("infer")][:4] == ["dropout"] + ["fused_fc"] * 3
    r = np.random.default_rng(5)
    for step in range(3):
        same_as_twin(net, logits, plain, plain_logits, [
            {"x": r.standard_normal(shape).astype(np.float32)}
            for shape in ((2, 1, 16), (3, 5, 16))], what=step)
        feed = {"x": r.standard_normal((4, 3, 16)).astype(np.float32),
                "label": r.integers(0, 5, 12)}
        net.train(feed=feed)
        plain.train(feed=feed)


def test_a_residual_that_broadcasts_is_added_as_add_adds_it():
    """A parameter of one value per column added with add (not a bias add) is fused as a
    residual, and a value that broadcasts the product to more rows too: the fused net
    gives the unfused one's values and shapes."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 6))
    extra = net.create_parameter("extra", (4,), "float32", Normal(0.0, 1.0))
    wide = L.data(net, "wide", shape=(3, 1, 1))
    a = L.relu(net, L.add(net, L.fc(net, x, 4, name="a"), extra))
    b = L.gelu(net, L.add(net, wide, L.fc(net, a, 4, name="b", bias=False)))
    net.default_fetches = (b,)
    fast = mg.passes.fold_batch_norm(net)
    assert [str(n) for n in mg.passes.fuse_fc(fast)] == [
        "mul + elementwise_add + add + relu -> fused_fc computing 'relu_0.out'",
        "mul + add + gelu -> fused_fc computing 'gelu_0.out'"]
    r = np.random.default_rng(6)
    feed = {"x": r.standard_normal((5, 6)).astype(np.float32),
            "wide": r.standard_normal((3, 1, 1)).astype(np.float32)}
    (got,), (want,) = fast.infer(feed=feed), net.infer(feed=feed)
    assert got.shape == want.shape == (3, 5, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
