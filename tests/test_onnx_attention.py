"""The ONNX mapping of attention: scaled_dot_product_attention decomposed into MatMul /
Softmax (+ the masks) at opset 17, and as the Attention op from opset 23 (float32), each
run in onnxruntime and onnx's reference evaluator against net.infer; a small GPT (linear,
position_embedding, multi_head_attention with a KV cache, tied logits) exported whole."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx_helpers import max_differences

import minigraph as mg
from minigraph import layers as L

# onnx's reference Softmax subtracts the row's maximum: -inf - -inf on a row with no key
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")


def node_types(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def sdpa_net(dtype="float32", mask=None, heads=0, **kwargs):
    """q, k, v data (batch -1) -> scaled_dot_product_attention; masks: 'bool', 'float',
    'bool4d' fed, or None. heads: the packed layout through multi_head_attention's op."""
    net = mg.Net(seed=0)
    if heads:
        q, k, v = (L.data(net, s, (-1, 5, 12), dtype) for s in "qkv")
        attrs = {"packed_heads": heads, "is_causal": kwargs.get("is_causal", False),
                 "causal_variant": kwargs.get("variant", "upper_left")}
        out = net.append("scaled_dot_product_attention", {"q": q, "k": k, "v": v},
                         {"out": "att.out"}, attrs)["out"]
        return net, out, ["q", "k", "v"]
    q = L.data(net, "q", (-1, 2, 4, 6), dtype)
    k, v = (L.data(net, s, (-1, 2, 7, 6), dtype) for s in "kv")
    feeds = ["q", "k", "v"]
    m = None
    if mask is not None:
        shape = {"bool": (4, 7), "float": (1, 7), "bool4d": (-1, 1, 4, 7)}[mask]
        m = L.data(net, "mask", shape, "bool" if mask.startswith("bool") else dtype)
        feeds.append("mask")
    out = L.scaled_dot_product_attention(net, q, k, v, attn_mask=m,
                                         is_causal=kwargs.get("is_causal", False),
                                         scale=kwargs.get("scale"))
    return net, out, feeds


def feed_for(net, feeds):
    def make(rng, n):
        out = {}
        for name in feeds:
            var = net.var(name)
            shape = tuple(n if d < 0 else d for d in var.shape)
            if var.dtype == np.bool_:
                m = rng.random(shape) > 0.3
                m[..., 1, :] = False                      # a query that sees no key
                out[name] = m
            else:
                out[name] = rng.standard_normal(shape).astype(var.dtype)
        return out
    return make


CASES = [dict(), dict(is_causal=True), dict(mask="bool"), dict(mask="float", is_causal=True),
         dict(mask="bool4d", is_causal=True, scale=0.4), dict(heads=3, is_causal=True),
         dict(heads=2, is_causal=True, variant="lower_right")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
                         or "plain")
@pytest.mark.parametrize("opset", [17, 23])
def test_attention_matches_net_infer(tmp_path, case, opset):
    net, out, feeds = sdpa_net(**case)
    path = mg.onnx.export(net, tmp_path / "att.onnx", feeds, [out], opset=opset)
    types = node_types(path)
    assert ("Attention" in types) == (opset >= 23)
    assert ("Softmax" in types) == (opset < 23)
    max_differences(net, path, [out], feed_for(net, feeds), feeds, sizes=(1, 3))


def test_float64_attention_is_decomposed_at_any_opset(tmp_path):
    """ONNX's Attention takes no float64: the decomposition serves it at opset 23 too."""
    net, out, feeds = sdpa_net("float64", mask="bool", is_causal=True)
    path = mg.onnx.export(net, tmp_path / "att64.onnx", feeds, [out], opset=23)
    assert "Attention" not in node_types(path) and "Softmax" in node_types(path)
    max_differences(net, path, [out], feed_for(net, feeds), feeds, sizes=(2,))


def tiny_gpt(cache=True):
    net = mg.Net(seed=0)
    tok = L.data(net, "tok", (-1, -1), "int64")
    kv = L.KVCache(16) if cache else None
    h = L.embedding(net, tok, 13, 8, name="wte")
    h = L.position_embedding(net, h, 16, kv_cache=kv, name="wpe")
    for i in range(2):
        a = L.multi_head_attention(net, L.layer_norm(net, h, begin_norm_axis=2), 2,
                                   causal=True, kv_cache=kv, name=f"b{i}.attn")
        h = L.add(net, h, a)
        m = L.linear(net, L.gelu(net, L.linear(net, L.layer_norm(net, h, begin_norm_axis=2),
                                               32, name=f"b{i}.fc")), 8, name=f"b{i}.proj")
        h = L.add(net, h, m)
    logits = L.matmul(net, L.layer_norm(net, h, begin_norm_axis=2), net.var("wte.w"),
                      transpose_y=True)
    return net, logits, kv


@pytest.mark.parametrize("opset", [13, 17, 23])
@pytest.mark.parametrize("cache, fused", [(False, False), (True, False), (True, True)])
def test_a_small_gpt_exports_whole(tmp_path, opset, cache, fused):
    """A net built with a KV cache exports as one pass over an empty cache: the model is
    stateless and equals net.infer on an empty cache, at any sequence length; also with
    its infer branch fused (fuse_fc: q, k and v as a fused_fc_group, the residual adds
    and gelu in the products, the blocks' layer_norms folded into the products after
    them: LayerNormalization, or its moments at opset < 17, before each MatMul)."""
    net, logits, kv = tiny_gpt(cache)
    if fused:
        notes = [n.ops[0] for n in mg.passes.fuse_fc(net)]
        assert notes.count("fused_fc") == 2 and notes.count("layer_norm") == 4
        types = [op.type for op in net.section("infer")]
        assert types.count("fused_fc_group") == 2 and types.count("layer_norm") == 1
    path = mg.onnx.export(net, tmp_path / "gpt.onnx", ["tok"], [logits], opset=opset)
    for t in (1, 6):
        def feed(rng, n, t=t):
            if kv is not None:
                kv.reset()
            return {"tok": rng.integers(0, 13, (n, t))}
        max_differences(net, path, [logits], feed, ["tok"], sizes=(2,))
