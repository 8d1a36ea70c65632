"""fused_fc_group (several products of one x, inference-only) and how fuse_fc builds it
in a training net's infer branch (a multi_head_attention's q, k and v)."""
import numpy as np
import pytest
from helpers import helper_test_op, same_as_twin, trained_on

import minigraph as mg
from minigraph import layers as L
from minigraph.kernels.cpu import fc_native

rng = np.random.default_rng(0)


def group_reference(x, y, bias=None, x_num_col_dims=1):
    lead = x.shape[:x_num_col_dims]
    x2 = x.reshape(int(np.prod(lead)), -1)
    biases = bias or [None] * len(y)
    return {"out": [(x2 @ w + (0.0 if b is None else b)).reshape(lead + (w.shape[1],))
                    for w, b in zip(y, biases)]}


@pytest.mark.parametrize("x_shape, cols", [((1, 16), 1), ((2, 1, 16), 2), ((3, 5, 16), 2),
                                           ((6, 70), 1)])
@pytest.mark.parametrize("widths", [(16, 16, 16), (5,), (33, 8)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_fc_group_against_the_float64_reference(x_shape, cols, widths, bias, dtype,
                                                      cpu_engine):
    k = int(np.prod(x_shape[cols:]))
    ins = {"x": rng.standard_normal(x_shape).astype(dtype),
           "y": [rng.standard_normal((k, m)).astype(dtype) for m in widths]}
    if bias:
        ins["bias"] = [rng.standard_normal(m).astype(dtype) for m in widths]
    tol = {} if dtype == "float64" else {"atol": 2e-5, "rtol": 1e-4}
    outs = helper_test_op("fused_fc_group", ins, {"x_num_col_dims": cols}, group_reference,
                          **tol)["out"]
    assert [o.shape for o in outs] == [x_shape[:cols] + (m,) for m in widths]


@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize("count", [3, fc_native.GROUP_MAX + 1])
def test_each_product_has_the_bits_of_its_fused_fc(rows, count):
    """float32, on the group kernel (rows <= 4, at most GROUP_MAX products), on BLAS
    (more rows) and product by product (more products)."""
    r = np.random.default_rng(rows)
    x = r.standard_normal((rows, 64)).astype(np.float32)
    ys = [r.standard_normal((64, 24 + g)).astype(np.float32) for g in range(count)]
    bs = [r.standard_normal(24 + g).astype(np.float32) for g in range(count)]
    got = helper_test_op("fused_fc_group", {"x": x, "y": ys, "bias": bs}, {},
                         group_reference, atol=1e-4, rtol=1e-4)["out"]
    for g, (y, b) in enumerate(zip(ys, bs)):
        want = helper_test_op("fused_fc", {"x": x, "y": y, "bias": b},
                              {"weight_fixed": False})["out"]
        assert got[g].tobytes() == want.tobytes(), g


def build(x_shape, widths, bias_widths=None, k=6, **attrs):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare(x_shape, "float32")
    ys = []
    for g, (rows, m) in enumerate(widths):
        ys.append(scope.new_var(f"y{g}"))
        ys[-1].declare((rows, m), "float32")
    slots = {"x": x, "y": ys}
    if bias_widths is not None:
        slots["bias"] = []
        for g, m in enumerate(bias_widths):
            slots["bias"].append(scope.new_var(f"b{g}"))
            slots["bias"][-1].declare((m,), "float32")
    outs = [scope.new_var(f"out{g}") for g in range(len(widths))]
    return mg.Operator("fused_fc_group", out=outs, **slots, **attrs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(widths=[]), r"fused_fc_group: input 'y' must list at least one weight"),
    (dict(widths=[(6, 4), (7, 4)]), r"fused_fc_group: input 'y'\[1\] must have 6 rows"),
    (dict(widths=[(6, 4), (6, 3)], bias_widths=[4]),
     r"fused_fc_group: input 'bias' must list one bias per weight \(2\), got 1"),
    (dict(widths=[(6, 4), (6, 3)], bias_widths=[4, 4]),
     r"fused_fc_group: input 'bias'\[1\] must have shape \(3,\) \(one value per column"),
])
def test_bad_inputs_name_the_op_the_slot_and_the_product(kwargs, match):
    with pytest.raises(mg.OpError, match=match):
        build((2, 6), **kwargs)


def test_it_has_no_gradient():
    op = build((2, 6), [(6, 4), (6, 3)])
    with pytest.raises(mg.OpError, match="fused_fc_group: an inference-only op, it has no "
                                         "gradient"):
        op.schema.grad(op, {"out": op.outputs["out"]}, lambda v: v)


def attention_net(seed=0, cache=None):
    """A training net with one causal multi_head_attention on (N, T, 16) and a head; a
    dropout on x forks the net before the attention's products."""
    net = mg.Net(seed=seed)
    x = L.dropout(net, L.data(net, "x", shape=(-1, -1, 16)), 0.1)
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.multi_head_attention(net, L.layer_norm(net, x, begin_norm_axis=2), 2, causal=True,
                               dropout=0.1, kv_cache=cache, name="attn")
    logits = L.linear(net, L.add(net, x, h), 5, name="head")
    return trained_on(net, logits, label)


@pytest.mark.parametrize("cached", [False, True])
def test_fuse_fc_groups_q_k_and_v_with_the_unfused_bits(cached):
    """In a training net's infer branch the q, k and v products become one
    fused_fc_group (the layer's, at q's place); net.infer gives an unfused twin's bits,
    checked and bound runs, a token's shape (the group kernel) and a batch's (BLAS), as
    the weights train; the train branch keeps its ops. With a KV cache, cached tokens
    too."""
    caches = [L.KVCache(32) if cached else None for _ in range(2)]
    plain, plain_logits = attention_net(cache=caches[0])
    net, logits = attention_net(cache=caches[1])
    train_ops = [op.type for op in net.section("train")]
    notes = mg.passes.fuse_fc(net)
    assert [str(n) for n in notes][-2:] == [
        "fused_fc + fused_fc + fused_fc -> fused_fc_group computing 'attn.q.out, attn.k.out, "
        "attn.v.out'",
        "layer_norm + fused_fc_group -> fused_fc_group computing 'attn.q.out, attn.k.out, "
        "attn.v.out'"]
    group = [op for op in net.section("infer") if op.type == "fused_fc_group"]
    assert len(group) == 1 and group[0].layer == "attn" and group[0].attrs["normalize"]
    assert "layer_norm" not in [op.type for op in net.section("infer")]
    assert [v.name for v in group[0].inputs["y"]] == ["attn.q.w", "attn.k.w", "attn.v.w"]
    assert [op.type for op in net.section("train")] == train_ops
    r = np.random.default_rng(7)
    for step in range(3):
        shapes = ((1, 4, 16), (1, 1, 16), (1, 1, 16)) if cached else ((1, 1, 16), (3, 5, 16))
        for cache in caches:
            if cache is not None:
                cache.reset()
        same_as_twin(net, logits, plain, plain_logits,
                     [{"x": r.standard_normal(shape).astype(np.float32)} for shape in shapes],
                     runs=1 if cached else 2, what=step)
        feed = {"x": r.standard_normal((2, 3, 16)).astype(np.float32),
                "label": r.integers(0, 5, 6)}
        net.train(feed=feed)
        plain.train(feed=feed)


def test_products_of_other_inputs_layers_or_with_an_activation_are_not_grouped():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 8))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.dropout(net, x, 0.1)
    a = L.relu(net, L.linear(net, h, 8, name="a"))            # an activation
    b, c = L.linear(net, h, 8, name="b"), L.linear(net, h, 8, name="c")   # two layers
    logits = L.linear(net, L.add(net, L.add(net, a, b), c), 3, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Adam(1e-2).minimize(net, loss)
    mg.passes.fuse_fc(net)
    assert "fused_fc_group" not in [op.type for op in net.section("infer")]


def test_a_fused_branch_saves_and_loads_as_an_inference_model(tmp_path):
    """mg.io.save_inference of a net whose infer branch holds a fused_fc_group (its
    lists of weights, biases and outputs) loads into a net with the same bits."""
    net, logits = attention_net()
    mg.passes.fuse_fc(net)
    x = np.random.default_rng(8).standard_normal((2, 3, 16)).astype(np.float32)
    (want,) = net.infer(feed={"x": x}, fetch=[logits])
    mg.io.save_inference(net, tmp_path / "model", ["x"], [logits])
    loaded = mg.io.load_inference(tmp_path / "model")
    assert "fused_fc_group" in [op.type for op in loaded.ops("infer")]
    (got,) = loaded.infer(feed={"x": x}, fetch=[logits.name])
    assert got.tobytes() == want.tobytes()
