"""A small GPT of the transformer layers and generation (minigraph.generation): weight
tying through a name, the KV cache (cached passes equal full ones, never persistable,
training untouched, a full cache named in the error, reset, a new batch, one cache to
a net, the kv_cache_write op against its reference), sampling, generation with and
without the cache, and inference models of a cached net refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg
from minigraph import layers as L
from minigraph.generation import generate, sample

rng = np.random.default_rng(7)


def gpt(seed=0, cache=None, vocab=11, width=8, layers_=2, dtype="float32", dropout=0.0):
    """(net, tokens, logits, loss): embedding, position table, pre-norm blocks, logits tied
    to the embedding table through a transposed matmul."""
    net = mg.Net(seed=seed)
    tok = L.data(net, "tok", (-1, -1), "int64")
    tgt = L.data(net, "tgt", (-1, -1), "int64")
    h = L.embedding(net, tok, vocab, width, dtype=dtype, name="wte")
    h = L.position_embedding(net, h, 16, kv_cache=cache, name="wpe")
    for i in range(layers_):
        a = L.multi_head_attention(net, L.layer_norm(net, h, begin_norm_axis=2), 2,
                                   causal=True, dropout=dropout, kv_cache=cache, name=f"b{i}")
        h = L.add(net, h, a)
        m = L.linear(net, L.gelu(net, L.linear(net, L.layer_norm(net, h, begin_norm_axis=2),
                                               4 * width, name=f"b{i}.fc")), width,
                     name=f"b{i}.proj")
        h = L.add(net, h, m)
    logits = L.matmul(net, L.layer_norm(net, h, begin_norm_axis=2), net.var("wte.w"),
                      transpose_y=True)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.reshape(net, logits, (-1, vocab)),
                                                    L.reshape(net, tgt, (-1,))))
    return net, tok, logits, loss


def test_weight_tying_sums_both_uses_gradients():
    """The table wte.w is read by the embedding and by the transposed matmul of the logits:
    its gradient is the sum of both (checked against central differences of the loss)."""
    net, tok, logits, loss = gpt(dtype="float64", layers_=1)
    mg.append_backward(net, loss)
    feed = {"tok": rng.integers(0, 11, (2, 5)), "tgt": rng.integers(0, 11, (2, 5))}
    (grad,) = net.train(feed=feed, fetch=[net.grad("wte.w")])
    w = net.var("wte.w")
    base = w.get()
    for idx in [(3, 1), (feed["tok"][0, 0], 4), (7, 7)]:
        def at(delta, idx=idx):
            moved = base.copy()
            moved[idx] += delta
            w.set(moved)
            return float(net.infer(feed=feed, fetch=[loss])[0])
        numeric = (at(1e-6) - at(-1e-6)) / 2e-6
        w.set(base)
        np.testing.assert_allclose(grad[idx], numeric, rtol=1e-5, atol=1e-8)


def test_cached_passes_equal_full_passes_and_training_ignores_the_cache():
    cache = L.KVCache(16)
    net, tok, logits, loss = gpt(cache=cache)
    mg.optimizer.AdamW(1e-2).minimize(net, loss)
    seq = rng.integers(0, 11, (3, 12))
    net.train(feed={"tok": seq[:, :-1], "tgt": seq[:, 1:]}, fetch=[loss])
    assert cache.filled == 0                                     # training never touches it
    full = net.infer(feed={"tok": seq}, fetch=[logits])[0]
    assert cache.filled == 12
    cache.reset()
    parts = [net.infer(feed={"tok": seq[:, :5]}, fetch=[logits])[0]]
    parts += [net.infer(feed={"tok": seq[:, t:t + 1]}, fetch=[logits])[0] for t in range(5, 9)]
    parts.append(net.infer(feed={"tok": seq[:, 9:]}, fetch=[logits])[0])
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-5, atol=1e-5)
    net.train(feed={"tok": seq[:, :-1], "tgt": seq[:, 1:]}, fetch=[loss])
    assert cache.filled == 12                                    # nor resets it
    state = [v.name for s in (net.scope, *net.scopes.values()) for v in s.vars.values()
             if "cache" in v.name]
    assert state and not any(net.var(n, "infer").persistable for n in state)
    assert not any("cache" in v.name for v in net.persistables())


def test_the_cache_is_not_in_checkpoints(tmp_path):
    cache = L.KVCache(16)
    net, tok, logits, loss = gpt(cache=cache)
    net.infer(feed={"tok": rng.integers(0, 11, (1, 4))}, fetch=[logits])
    mg.io.save(net, tmp_path / "ckpt.npz")
    with np.load(tmp_path / "ckpt.npz") as saved:
        assert not [n for n in saved.files if "cache" in n]
    other, tok2, logits2, _ = gpt(seed=9)
    mg.io.load(other, tmp_path / "ckpt.npz")                    # the same parameters
    seq = rng.integers(0, 11, (2, 6))
    cache.reset()
    np.testing.assert_allclose(other.infer(feed={"tok": seq}, fetch=[logits2])[0],
                               net.infer(feed={"tok": seq}, fetch=[logits])[0], rtol=1e-6)


def test_a_full_cache_is_an_error_naming_it_and_nothing_wraps():
    cache = L.KVCache(6, name="gen_cache")
    net, tok, logits, _ = gpt(cache=cache)
    net.infer(feed={"tok": rng.integers(0, 11, (2, 5))}, fetch=[logits])
    with pytest.raises(mg.OpError, match=r"the KV cache 'gen_cache' is full: it holds 6 "
                                         r"positions, 5 are filled and this pass adds 2"):
        net.infer(feed={"tok": rng.integers(0, 11, (2, 2))}, fetch=[logits])
    assert cache.filled == 5                                     # the failed pass left it
    net.infer(feed={"tok": rng.integers(0, 11, (2, 1))}, fetch=[logits])
    with pytest.raises(mg.OpError, match="'gen_cache' is full"):
        net.infer(feed={"tok": rng.integers(0, 11, (2, 1))}, fetch=[logits])
    cache.reset()
    net.infer(feed={"tok": rng.integers(0, 11, (4, 6))}, fetch=[logits])    # a new batch
    with pytest.raises(mg.OpError, match=r"'gen_cache' holds 2 positions of a batch of 4"):
        cache.length.set(np.array(2, np.int64))
        net.infer(feed={"tok": rng.integers(0, 11, (3, 1))}, fetch=[logits])


def test_a_cache_serves_one_net():
    cache = L.KVCache(8)
    gpt(cache=cache)
    with pytest.raises(ValueError, match=r"argument 'kv_cache' .* belongs to another net"):
        gpt(cache=cache)
    with pytest.raises(ValueError, match=r"KVCache: capacity must be an int >= 1"):
        L.KVCache(0)


def test_sampling_temperature_and_top_k():
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]))
    np.testing.assert_array_equal(sample(logits, temperature=0), [3, 0])
    g = np.random.default_rng(0)
    draws = np.array([sample(logits, 1.0, rng=g) for _ in range(20000)])
    np.testing.assert_allclose(np.bincount(draws[:, 0], minlength=4) / 20000,
                               [0.1, 0.2, 0.3, 0.4], atol=0.015)
    top2 = np.array([sample(logits, 1.0, top_k=2, rng=g) for _ in range(5000)])
    assert set(top2[:, 0]) == {2, 3}
    np.testing.assert_allclose((top2[:, 0] == 3).mean(), 4 / 7, atol=0.03)
    cold = np.array([sample(logits, 0.05, rng=g) for _ in range(200)])
    assert (cold[:, 0] == 3).all()
    with pytest.raises(ValueError, match="sample: top_k must be None or an int >= 1"):
        sample(logits, top_k=0)


def test_generation_with_the_cache_equals_without():
    cache = L.KVCache(16)
    net, tok, logits, _ = gpt(cache=cache, seed=3)
    prompt = rng.integers(0, 11, (2, 3))
    cached = generate(net, tok, logits, prompt, 10, temperature=0.9, top_k=5, seed=4,
                      kv_cache=cache)
    full = generate(net, "tok", logits, prompt, 10, temperature=0.9, top_k=5, seed=4,
                    kv_cache=cache, use_cache=False)
    np.testing.assert_array_equal(cached, full)
    assert cached.shape == (2, 13) and (cached[:, :3] == prompt).all()
    with pytest.raises(mg.OpError, match="KV cache 'kv_cache_0' is full"):
        generate(net, tok, logits, prompt, 15, kv_cache=cache)
    for bad, said in (({"top_k": 0}, "generate: top_k must be None or an int >= 1"),
                      ({"temperature": float("nan")}, "generate: temperature")):
        with pytest.raises(ValueError, match=said):      # before any pass, 0 tokens too
            generate(net, tok, logits, prompt, 0, kv_cache=cache, **bad)


def test_generation_takes_only_the_cache_the_net_was_built_with():
    """generate() with another net's cache reset that cache while the net's own grew:
    wrong tokens and no error."""
    cache = L.KVCache(16)
    net, tok, logits, _ = gpt(cache=cache, seed=3)
    prompt = rng.integers(0, 11, (1, 3))
    want = generate(net, tok, logits, prompt, 4, temperature=0, kv_cache=cache)
    unused, elsewhere = L.KVCache(16), L.KVCache(16)
    gpt(cache=elsewhere, seed=3)                          # another net's cache
    for other, shown in ((unused, "None"), (elsewhere, "'kv_cache_0'")):
        with pytest.raises(ValueError, match=rf"argument 'kv_cache' \({shown}\) is not the "
                                             "cache this net was built with"):
            generate(net, tok, logits, prompt, 4, temperature=0, kv_cache=other)
    assert elsewhere.length.get() == 0                    # left as it was
    with pytest.raises(ValueError, match="generate: the net was built with a KV cache"):
        generate(net, tok, logits, prompt, 4, temperature=0)
    with pytest.raises(TypeError, match="generate: kv_cache must be a layers.KVCache"):
        generate(net, tok, logits, prompt, 4, kv_cache="cache")
    np.testing.assert_array_equal(
        generate(net, tok, logits, prompt, 4, temperature=0, kv_cache=cache), want)


def test_generation_without_a_cache_crops_to_the_context():
    net, tok, logits, _ = gpt(seed=4)
    out = generate(net, tok, logits, rng.integers(0, 11, (1, 10)), 12, temperature=0,
                   context=16)
    assert out.shape == (1, 22)


def test_inference_models_of_a_cached_net_are_refused_by_name(tmp_path):
    """A KV cache lives in the net that built it: an inference model or an inference
    pass of its infer branch would read state nothing there computes (ONNX export is
    stateless and works; tests/test_onnx_attention.py)."""
    net, tok, logits, _ = gpt(cache=L.KVCache(16))
    with pytest.raises(mg.io.InferenceModelError, match=r"op 'position_embedding' keeps state "
                                                        r"of the infer branch in "
                                                        r"'kv_cache_0.length'"):
        mg.io.save_inference(net, tmp_path / "m", feeds=["tok"], fetches=[logits])
    assert not (tmp_path / "m").exists()
    with pytest.raises(ValueError, match=r"optimize_for_inference: op .position_embedding. "
                                         r"keeps state .* without kv_cache"):
        mg.passes.optimize_for_inference(net)
    plain, _, plain_logits, _ = gpt()
    mg.io.save_inference(plain, tmp_path / "m", feeds=["tok"], fetches=[plain_logits])


def kv_cache_reference(k, v, cache_k, cache_v, length, capacity, advances, cache):
    t = k.shape[1]
    offset = int(length) if advances else int(length) - t
    ck, cv = cache_k.copy(), cache_v.copy()
    ck[:, offset:offset + t], cv[:, offset:offset + t] = k, v
    return {"k_all": ck[:, :offset + t], "v_all": cv[:, :offset + t], "cache_k_out": ck,
            "cache_v_out": cv, "length_out": np.array(int(length) + t if advances else length)}


@pytest.mark.parametrize("advances, length", [(True, 1), (False, 5)])
def test_kv_cache_write_op_against_its_reference(advances, length):
    """The op alone (and, through the helper, its bound form over three passes, each
    advancing the same cache), a first layer's and a later one's."""
    r = np.random.default_rng(9)
    ins = {"k": r.standard_normal((2, 2, 4)).astype(np.float32),
           "v": r.standard_normal((2, 2, 6)).astype(np.float32),
           "cache_k": r.standard_normal((2, 9, 4)).astype(np.float32),
           "cache_v": r.standard_normal((2, 9, 6)).astype(np.float32),
           "length": np.array(length, np.int64)}
    helper_test_op("kv_cache_write", ins, dict(capacity=9, advances=advances, cache="c"),
                   kv_cache_reference)
