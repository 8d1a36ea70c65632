"""The transformer layers (minigraph.layers.attention, layers.linear): linear on the
last axis of any rank, multi_head_attention and position_embedding against float64
numpy references, and bad arguments. A GPT of them, its KV cache and generation are in
test_generation.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import helper_test_op
from references import scaled_dot_product_attention

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(7)


def r(*shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def params(net, prefix):
    return {v.name[len(prefix):]: v.get().astype(np.float64) for v in net.parameters()
            if v.name.startswith(prefix)}


# ---- linear -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6,), (4, 6), (2, 3, 6), (2, 3, 2, 6), (-1, -1, 6)], ids=str)
def test_linear_acts_on_the_last_axis_of_any_rank(shape):
    net = mg.Net(seed=1)
    x = L.data(net, "x", shape, "float64")
    y = L.linear(net, x, 5, name="lin")
    assert y.shape == tuple(shape[:-1]) + (5,)
    w, b = net.var("lin.w").get(), net.var("lin.b").get()
    assert w.shape == (6, 5) and b.shape == (5,)
    bound = 1 / math.sqrt(6)                         # nn.Linear's init, as fc's
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    xb = r(*(3 if d < 0 else d for d in shape))
    (got,) = net.infer(feed={"x": xb}, fetch=[y])
    np.testing.assert_allclose(got, xb @ w + b, rtol=1e-12)


def test_linear_gradients_and_no_bias():
    net = mg.Net(seed=2)
    x = L.data(net, "x", (2, 3, 4), "float64")
    y = L.linear(net, x, 3, bias_attr=False, name="lin")
    assert [p.name for p in net.parameters()] == ["lin.w"]
    weight = r(2, 3, 3)
    loss = L.reduce_sum(net, L.multiply(net, y, L.data(net, "g", (2, 3, 3), "float64")))
    mg.append_backward(net, loss)
    xb = r(2, 3, 4)
    (dw,) = net.train(feed={"x": xb, "g": weight}, fetch=[net.grad("lin.w")])
    np.testing.assert_allclose(dw, np.einsum("nti,nto->io", xb, weight), rtol=1e-12)


def test_linear_shares_a_named_parameter_and_checks_its_shape():
    net = mg.Net(seed=3)
    x = L.data(net, "x", (-1, 5, 4))
    a = L.linear(net, x, 4, param_attr="shared.w", bias_attr=False)
    L.linear(net, a, 4, param_attr=mg.ParamAttr(name="shared.w"), bias_attr=False)
    assert [p.name for p in net.parameters()] == ["shared.w"]
    with pytest.raises(ValueError, match=r"linear: argument 'param_attr' names the shared "
                                         r"parameter 'shared.w' of shape \(4, 4\)"):
        L.linear(net, x, 3, param_attr="shared.w")


def test_linear_bad_arguments():
    net = mg.Net()
    x = L.data(net, "x", (-1, -1))
    with pytest.raises(ValueError, match=r"linear: argument 'x' .* needs a known last axis"):
        L.linear(net, x, 3)
    with pytest.raises(ValueError, match=r"linear: argument 'size' must be an int >= 1"):
        L.linear(net, L.data(net, "y", (-1, 4)), 0)


def test_linear_exports_to_onnx(tmp_path):
    from onnx_helpers import max_differences

    net = mg.Net(seed=4)
    x = L.data(net, "x", (-1, -1, 6))
    y = L.linear(net, L.gelu(net, L.linear(net, x, 8)), 3)
    path = mg.onnx.export(net, tmp_path / "lin.onnx", ["x"], [y])
    max_differences(net, path, [y], lambda g, n: {"x": g.standard_normal((n, 4, 6))
                                                  .astype(np.float32)}, ["x"], sizes=(1, 3))


# ---- position_embedding -------------------------------------------------------------------

def position_reference(x, w, length=None, advances=False, cache="", capacity=0):
    t = x.shape[1]
    offset = 0 if length is None else int(length) if advances else int(length) - t
    out = {"out": x + w[offset:offset + t]}
    if length is not None and advances:
        out["length_out"] = length + t
    return out


def test_position_embedding_op_and_its_gradients():
    helper_test_op("position_embedding", {"x": r(2, 4, 3), "w": r(6, 3)}, {},
                   position_reference, grad_wrt=("x", "w"), outputs=("out",))
    helper_test_op("position_embedding", {"x": r(2, 2, 3), "w": r(6, 3),
                                          "length": np.array(3, np.int64)},
                   {"advances": True, "cache": "c"}, position_reference)
    helper_test_op("position_embedding", {"x": r(1, 2, 3), "w": r(6, 3),
                                          "length": np.array(5, np.int64)},
                   {"cache": "c"}, position_reference)


def test_position_embedding_grad_float32_bits():
    """The float32 table gradient is numpy's float64 batch sum rounded once, bit for bit
    (the native sum over rows where it applies, numpy's where not); dx is dout itself."""
    from minigraph.kernels.cpu.position_embedding import position_embedding_grad_cpu

    class Op:
        def wants(self, slot):
            return True

    for shape in ((16, 64, 128), (3, 5, 1), (2, 7, 9)):
        d = (np.random.default_rng(1).standard_normal(shape)
             * np.random.default_rng(2).choice([1e-3, 1.0, 1e4, 1e30], size=shape)
             ).astype(np.float32)
        got = position_embedding_grad_cpu(Op(), {"dout": d, "w": np.zeros((80, shape[2]),
                                                                          np.float32)}, None)
        want = np.zeros((80, shape[2]), np.float32)
        want[:shape[1]] = d.sum(axis=0, dtype=np.float64)
        np.testing.assert_array_equal(got["dw"].view(np.int32), want.view(np.int32))
        assert got["dx"] is d


def test_position_embedding_layer_and_its_limits():
    net = mg.Net(seed=5)
    x = L.data(net, "x", (-1, -1, 4))
    out = L.position_embedding(net, x, 6, name="wpe")
    assert net.var("wpe.w").get().shape == (6, 4)
    xb = r(2, 5, 4).astype(np.float32)
    (got,) = net.infer(feed={"x": xb}, fetch=[out])
    np.testing.assert_allclose(got, xb + net.var("wpe.w").get()[:5], rtol=1e-6)
    with pytest.raises(mg.OpError, match=r"position_embedding: input 'x' has 7 positions, "
                                         r"more than the 6 rows of input 'w'"):
        net.infer(feed={"x": r(1, 7, 4).astype(np.float32)}, fetch=[out])
    with pytest.raises(ValueError, match=r"position_embedding: argument 'x' .* has 9 positions, "
                                         r"more than max_positions=6"):
        L.position_embedding(net, L.data(net, "long", (-1, 9, 4)), 6)


# ---- multi_head_attention ------------------------------------------------------------------

def mha_reference(x, p, heads, causal):
    """multi_head_attention in float64 from its parameters."""
    n, t, d = x.shape
    proj = {s: x @ p[f"{s}.w"] + p[f"{s}.b"] for s in "qkv"}
    split = {s: a.reshape(n, t, heads, d // heads).transpose(0, 2, 1, 3) for s, a in
             proj.items()}
    o = scaled_dot_product_attention(split["q"], split["k"], split["v"], is_causal=causal)
    merged = o["out"].transpose(0, 2, 1, 3).reshape(n, t, d)
    return merged @ p["out.w"] + p["out.b"]


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_attention_against_a_reference(causal):
    net = mg.Net(seed=6)
    x = L.data(net, "x", (-1, -1, 12), "float64")
    y = L.multi_head_attention(net, x, num_heads=3, causal=causal, name="mha")
    p = params(net, "mha.")
    assert sorted(p) == sorted(f"{s}.{w}" for s in ("q", "k", "v", "out") for w in "wb")
    xb = r(2, 5, 12)
    (got,) = net.infer(feed={"x": xb}, fetch=[y])
    np.testing.assert_allclose(got, mha_reference(xb, p, 3, causal), rtol=1e-10, atol=1e-12)
    (train,) = net.train(feed={"x": xb}, fetch=[y])
    np.testing.assert_allclose(train, got, rtol=1e-12)


def test_multi_head_attention_trains_and_dropout_forks():
    net = mg.Net(seed=7)
    x = L.data(net, "x", (-1, 6, 8))
    y = L.multi_head_attention(net, x, num_heads=2, causal=True, dropout=0.2, name="mha")
    loss = L.mean(net, L.square(net, y))
    mg.optimizer.Adam(0.01).minimize(net, loss)
    assert net.forked and int(net.var("mha.attention.step").get()) == 0
    xb = r(4, 6, 8).astype(np.float32)
    losses = [float(net.train(feed={"x": xb}, fetch=[loss])[0]) for _ in range(20)]
    assert losses[-1] < losses[0] and int(net.var("mha.attention.step").get()) == 20
    a, b = (net.infer(feed={"x": xb}, fetch=[y])[0] for _ in range(2))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_heads=5), ValueError, r"argument 'num_heads' \(5\) must divide the 12 features"),
    (dict(num_heads=0), ValueError, r"argument 'num_heads' must be an int >= 1"),
    (dict(num_heads=2, dropout=1.5), ValueError, r"argument 'dropout' must be a finite number"),
    (dict(num_heads=2, causal="yes"), ValueError, r"argument 'causal' must be True or False"),
    (dict(num_heads=2, kv_cache=8), TypeError, r"argument 'kv_cache' must be a layers.KVCache"),
])
def test_multi_head_attention_bad_arguments(kwargs, error, match):
    net = mg.Net()
    x = L.data(net, "x", (-1, 4, 12))
    with pytest.raises(error, match=f"multi_head_attention: {match}"):
        L.multi_head_attention(net, x, **kwargs)
    assert not net.layers and not net.parameters()


@pytest.mark.parametrize("kind", ["multi_head_attention", "position_embedding"])
@pytest.mark.parametrize("shape", [(-1, 12), (-1, 4, -1)])
def test_sequence_layers_need_n_t_d(kind, shape):
    net = mg.Net()
    x = L.data(net, "x", shape)
    with pytest.raises(ValueError, match=rf"{kind}: argument 'x' .* must be \(N, T, D\) "
                                         "with D known"):
        getattr(L, kind)(net, x, 2)
    assert not net.layers and not net.parameters()
