"""fused_fc and fused_fc_group with a layer_norm folded in (attribute normalize: x is
normalised first), and fuse_fc's fold: against the float64 reference, with
layer_norm's bits, bad inputs, and a GPT's infer branch with an unfused twin's bits."""
import numpy as np
import pytest
from helpers import helper_test_op, same_as_twin, trained_on
from onnx_helpers import max_differences
from references_norms import layer_norm as ln_reference
from test_fused_fc import fused_reference
from test_onnx_attention import node_types

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(3)


def normalized_reference(x, y, norm_scale=None, norm_bias=None, norm_epsilon=1e-5,
                         x_num_col_dims=1, **attrs):
    xn = ln_reference(x, norm_scale, norm_bias, x_num_col_dims, norm_epsilon)["y"]
    attrs.pop("normalize")
    return fused_reference(xn, y, x_num_col_dims=x_num_col_dims, **attrs)


def group_reference(x, y, bias=None, **attrs):
    return {"out": [normalized_reference(x, w, bias=b, **attrs)["out"]
                    for w, b in zip(y, bias or [None] * len(y))]}


def inputs(x_shape, y_shape, cols, dtype, affine=True, bias=True):
    k = int(np.prod(x_shape[cols:]))
    ins = {"x": (rng.standard_normal(x_shape) * 3 + 2).astype(dtype),
           "y": rng.standard_normal(y_shape).astype(dtype)}
    if bias:
        ins["bias"] = rng.standard_normal(y_shape[1]).astype(dtype)
    if affine:
        ins["norm_scale"] = rng.uniform(0.5, 2.0, k).astype(dtype)
        ins["norm_bias"] = rng.standard_normal(k).astype(dtype)
    return ins


# a token's row (the few-rows kernel), a batch's (BLAS), the native packed kernel (a fixed
# weight, 64 rows), two normalised axes
SHAPES = [((1, 1, 32), (32, 24), 2), ((3, 5, 16), (16, 8), 2), ((64, 33), (33, 130), 1),
          ((2, 3, 4), (12, 6), 1)]


@pytest.mark.parametrize("x_shape, y_shape, cols", SHAPES)
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weight_fixed", [True, False])
def test_normalized_fused_fc_against_the_float64_reference(x_shape, y_shape, cols, activation,
                                                           dtype, weight_fixed, cpu_engine):
    ins = inputs(x_shape, y_shape, cols, dtype)
    ins["residual"] = rng.standard_normal(x_shape[:cols] + y_shape[1:]).astype(dtype)
    tol = {} if dtype == "float64" else {"atol": 5e-5, "rtol": 1e-4}
    helper_test_op("fused_fc", ins, {"x_num_col_dims": cols, "activation": activation,
                                     "weight_fixed": weight_fixed, "normalize": True,
                                     "norm_epsilon": 1e-3}, normalized_reference, **tol)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("x_shape", [(1, 1, 16), (2, 3, 16)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_normalized_group_against_the_float64_reference(affine, x_shape, dtype, cpu_engine):
    ins = inputs(x_shape, (16, 8), 2, dtype, affine, bias=False)
    ins["y"] = [ins["y"], rng.standard_normal((16, 12)).astype(dtype)]
    ins["bias"] = [rng.standard_normal(8).astype(dtype), rng.standard_normal(12).astype(dtype)]
    tol = {} if dtype == "float64" else {"atol": 5e-5, "rtol": 1e-4}
    helper_test_op("fused_fc_group", ins, {"x_num_col_dims": 2, "normalize": True},
                   group_reference, **tol)


@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("op_type", ["fused_fc", "fused_fc_group"])
def test_the_normalisation_gives_layer_norms_bits(rows, op_type):
    """float32: the op that normalises x equals layer_norm's kernel followed by the op
    on its y, bit for bit (the few-rows kernels up to 4 rows, BLAS beyond)."""
    ins = inputs((rows, 64), (64, 96), 1, np.float32)
    y = layer_norm_y(ins, eps=1e-5)
    plain = {"x": y, "y": ins["y"], "bias": ins["bias"]}
    attrs = {} if op_type == "fused_fc_group" else {"weight_fixed": False, "activation": "gelu"}
    if op_type == "fused_fc_group":
        plain = {"x": y, "y": [ins["y"], ins["y"][:, :40].copy()], "bias": None}
        ins = {**ins, "y": plain["y"], "bias": None}
    want = helper_test_op(op_type, plain, attrs)["out"]
    got = helper_test_op(op_type, ins, {**attrs, "normalize": True})["out"]
    for a, b in zip(*(w if isinstance(w, list) else [w] for w in (got, want))):
        assert a.tobytes() == b.tobytes()


def layer_norm_y(ins, eps, begin=1):
    return helper_test_op("layer_norm", {"x": ins["x"], "scale": ins["norm_scale"],
                                         "bias": ins["norm_bias"]},
                          {"begin_norm_axis": begin, "epsilon": eps})["y"]


def build(op_type, x_shape=(2, 8), scale_shape=(8,), dtype="float32", **attrs):
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare(x_shape, dtype)
    y.declare((8, 4), "float32")
    slots = {"x": x, "y": [y] if op_type == "fused_fc_group" else y}
    if scale_shape is not None:
        slots["norm_scale"] = scope.new_var("norm_scale")
        slots["norm_scale"].declare(scale_shape, "float32")
    out = scope.new_var("out")
    return mg.Operator(op_type, out=[out] if op_type == "fused_fc_group" else out, **slots,
                       **attrs)


@pytest.mark.parametrize("op_type", ["fused_fc", "fused_fc_group"])
@pytest.mark.parametrize("kwargs, match", [
    (dict(normalize=True, scale_shape=(4,)),
     r"input 'norm_scale' must have shape \(8,\) \(one value per position of axes 1\.\. of "
     r"input 'x' with shape \(2, 8\)\), got \(4,\)"),
    (dict(normalize=True, x_shape=(2, 8), dtype="int64", scale_shape=None),
     r"input 'x' must be a float tensor"),
    (dict(), r"input 'norm_scale' is bound but attribute 'normalize' is False"),
    (dict(normalize=True, norm_epsilon=-1.0), r"norm_epsilon"),
])
def test_bad_inputs_name_the_op_and_slot(op_type, kwargs, match):
    with pytest.raises(mg.OpError, match=rf"{op_type}: .*{match}|{match}"):
        build(op_type, **kwargs)


@pytest.mark.parametrize("op_type", ["fused_fc", "fused_fc_group"])
def test_a_row_of_equal_values_at_norm_epsilon_0_is_an_error_naming_it(op_type):
    x = np.ones((2, 8), np.float32)
    x[1] = np.arange(8)
    y = np.ones((8, 4), np.float32)
    with pytest.raises(mg.OpError, match=rf"{op_type}: norm_epsilon is 0 and row \(0,\) of "
                                         r"input 'x' has variance 0"):
        helper_test_op(op_type, {"x": x, "y": [y] if op_type == "fused_fc_group" else y},
                       {"normalize": True, "norm_epsilon": 0.0})


def tiny_gpt(seed=0, cache=None):
    """A training net: embedding, two pre-norm blocks (layer_norm -> attention, layer_norm
    -> gelu MLP), a final layer_norm and a tied head."""
    net = mg.Net(seed=seed)
    tok = L.data(net, "tok", shape=(-1, -1), dtype="int64")
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.dropout(net, L.embedding(net, tok, 13, 16, name="wte"), 0.1)
    for i in range(2):
        a = L.multi_head_attention(net, L.layer_norm(net, h, begin_norm_axis=2), 2,
                                   causal=True, kv_cache=cache, name=f"b{i}.attn")
        h = L.add(net, h, a)
        m = L.gelu(net, L.linear(net, L.layer_norm(net, h, begin_norm_axis=2), 32,
                                 name=f"b{i}.fc"))
        h = L.add(net, h, L.linear(net, m, 16, name=f"b{i}.proj"))
    logits = L.matmul(net, L.layer_norm(net, h, begin_norm_axis=2), net.var("wte.w"),
                      transpose_y=True)
    return trained_on(net, logits, label)


@pytest.mark.parametrize("cached", [False, True])
def test_fuse_fc_folds_a_gpts_block_norms_with_the_unfused_bits(cached):
    """In a training net's infer branch each block's two layer_norms fold into the q/k/v
    group and the gelu product after them (the final one, read by a matmul, stays);
    net.infer gives an unfused twin's bits, checked and bound runs, tokens and batches,
    as the weights train; the train branch keeps its layer_norms."""
    caches = [L.KVCache(32) if cached else None for _ in range(2)]
    plain, plain_logits = tiny_gpt(cache=caches[0])
    net, logits = tiny_gpt(cache=caches[1])
    train_ops = [op.type for op in net.section("train")]
    folds = [str(n) for n in mg.passes.fuse_fc(net) if n.ops[0] == "layer_norm"]
    assert folds == [
        "layer_norm + fused_fc_group -> fused_fc_group computing 'b0.attn.q.out, b0.attn.k.out, "
        "b0.attn.v.out'",
        "layer_norm + fused_fc -> fused_fc computing 'gelu_0.out'",
        "layer_norm + fused_fc_group -> fused_fc_group computing 'b1.attn.q.out, b1.attn.k.out, "
        "b1.attn.v.out'",
        "layer_norm + fused_fc -> fused_fc computing 'gelu_1.out'"]
    infer = [op.type for op in net.section("infer")]
    assert infer.count("layer_norm") == 1 and infer.count("fused_fc_group") == 2
    assert [op.type for op in net.section("train")] == train_ops
    r = np.random.default_rng(7)
    for step in range(3):
        shapes = ((1, 4), (1, 1), (1, 1)) if cached else ((1, 1), (3, 5))
        for cache in caches:
            if cache is not None:
                cache.reset()
        same_as_twin(net, logits, plain, plain_logits,
                     [{"tok": r.integers(0, 13, shape)} for shape in shapes],
                     runs=1 if cached else 2, what=step)
        feed = {"tok": r.integers(0, 13, (2, 3)), "label": r.integers(0, 13, 6)}
        net.train(feed=feed)
        plain.train(feed=feed)


def test_a_norm_whose_outputs_are_read_elsewhere_or_on_other_axes_is_not_folded():
    """layer_norm stays where its y has a second reader (here the same fused op, as its
    residual), or it normalises other axes than the product's x_num_col_dims."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4, 8))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.dropout(net, x, 0.1)
    twice = L.layer_norm(net, h, begin_norm_axis=2)
    a = L.add(net, L.linear(net, twice, 8, name="a"), twice)       # x and residual
    other = L.layer_norm(net, h, begin_norm_axis=1)                 # over (4, 8)
    b = L.linear(net, other, 8, name="b")                           # on the last axis
    logits = L.linear(net, L.add(net, a, b), 3, name="head")
    notes = mg.passes.fuse_fc(trained_on(net, logits, label)[0])
    assert not [n for n in notes if n.ops[0] == "layer_norm"]
    assert [op.type for op in net.section("infer")].count("layer_norm") == 2


@pytest.mark.parametrize("opset", [13, 17])
def test_an_inference_net_folds_its_norms_and_exports(tmp_path, opset):
    """optimize_for_inference folds a layer_norm into the fused product after it (a fixed
    weight: the packed kernel at 64 rows); the values equal the training net's, and
    the ONNX model's (LayerNormalization at opset 17, its moments at 13) net.infer's."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 33))
    h = L.relu(net, L.fc(net, L.layer_norm(net, x), 130, name="a"))
    net.default_fetches = (L.fc(net, h, 4, name="b"),)
    fast = mg.passes.optimize_for_inference(net)
    assert "layer_norm + fused_fc -> fused_fc computing 'relu_0.out'" in [
        str(n) for n in fast.reports["fuse_fc"]]
    assert "layer_norm" not in [op.type for op in fast.section("trunk")]
    feed = {"x": (rng.standard_normal((64, 33)) * 2 + 1).astype(np.float32)}
    (got,) = fast.infer(feed=feed)
    (want,) = net.infer(feed=feed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    path = mg.onnx.export(fast, tmp_path / "m.onnx", ["x"], [fast.default_fetches[0]],
                          opset=opset)
    assert ("LayerNormalization" in node_types(path)) == (opset >= 17)
    max_differences(fast, path, [fast.default_fetches[0].name],
                    lambda r, n: {"x": r.standard_normal((n, 33)).astype(np.float32)}, ["x"])
