"""Generating tokens with a net's infer branch: temperature and top-k sampling, with a
KV cache (one single-token pass per new token) or without (a full pass per token).

    cache = layers.KVCache(capacity=256)          # given to the layers when building
    ...
    out = mg.generation.generate(net, "tokens", logits, prompt, 100, temperature=0.8,
                                 top_k=20, seed=0, kv_cache=cache)

`logits` is the Variable (N, T, V) of each position's next-token logits, computed by
the infer branch from the int64 data `tokens` (N, T) (declared with T = -1). With a
cache, the prompt is one pass (filling the cache from an empty one) and each new token
one pass of that token alone, so n new tokens cost n single-token passes; without,
each new token is a full pass over the sequence so far (its last `context` tokens,
when given: a net's position table ends somewhere). A cache's capacity bounds the
prompt plus the new tokens: past it the cache's ops raise an error naming it.
Training is untouched: net.train never reads the cache.
"""
from __future__ import annotations

import numpy as np

from minigraph.validators import check_number, is_int


def sample(logits, temperature=1.0, top_k=None, rng=None):
    """One token per row of `logits` (N, V): the argmax for temperature 0, else a draw
    from softmax(logits / temperature) over the top_k largest (None: all). rng: a numpy
    Generator (default: a fresh unseeded one). Returns int64 (N,)."""
    z = np.asarray(logits, np.float64)
    if z.ndim != 2:
        raise ValueError(f"sample: logits must be (N, V), got shape {z.shape}")
    temperature, top_k = _sampling(temperature, top_k, "sample")
    return _draw(z, temperature, top_k, np.random.default_rng() if rng is None else rng)


def _sampling(temperature, top_k, who):
    """temperature and top_k checked: ValueErrors naming `who`."""
    temperature = check_number(temperature, f"{who}: temperature")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"{who}: top_k must be None or an int >= 1, got {top_k!r}")
    return temperature, top_k


def _draw(z, temperature, top_k, rng):
    """sample's draw from float64 logits z (N, V), its arguments checked."""
    if temperature == 0.0:
        return z.argmax(axis=1).astype(np.int64)
    z = z / temperature
    if top_k is not None and top_k < z.shape[1]:
        kth = np.partition(z, -top_k, axis=1)[:, -top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    cumulative = np.cumsum(p, axis=1)
    u = rng.random((z.shape[0], 1)) * cumulative[:, -1:]
    return np.minimum((cumulative <= u).sum(axis=1), z.shape[1] - 1).astype(np.int64)


def generate(net, tokens, logits, prompt, max_new_tokens, temperature=1.0, top_k=None,
             seed=0, kv_cache=None, use_cache=True, context=None):
    """The prompt (N, P) int followed by max_new_tokens sampled tokens: int64 (N, P +
    max_new_tokens). tokens: the data Variable (or its name) the infer branch reads;
    logits: the Variable (or name) of the next-token logits (N, T, V). kv_cache: the
    layers.KVCache the net was built with (None: a net built without one); use_cache=False
    with a cache runs full passes anyway (emptying it before each: the reference the
    cached run equals). context: crop full passes to the last `context` tokens. seed:
    the sampling's generator (the same seed, the same tokens)."""
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or prompt.dtype.kind not in "iu":
        raise ValueError(f"generate: prompt must be an int array (N, P) with P >= 1, got "
                         f"{prompt.dtype} of shape {prompt.shape}")
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if context is not None and (not is_int(context) or context < 1):
        raise ValueError(f"generate: context must be None or an int >= 1, got {context!r}")
    temperature, top_k = _sampling(temperature, top_k, "generate")
    _check_cache(net, kv_cache)
    name = tokens.name if hasattr(tokens, "name") else tokens
    rng = np.random.default_rng(seed)
    seq = prompt.astype(np.int64)
    cached = kv_cache is not None and use_cache
    if cached:
        kv_cache.reset()
    for i in range(max_new_tokens):
        if cached:
            window = seq if i == 0 else seq[:, -1:]
        else:
            window = seq if context is None else seq[:, -context:]
            if kv_cache is not None:
                kv_cache.reset()
        (out,) = net.infer(feed={name: window}, fetch=[logits])
        nxt = _draw(np.asarray(out[:, -1], np.float64), temperature, top_k, rng)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    return seq


def _check_cache(net, kv_cache):
    """The cache a run empties and fills must be the one the net's layers were built
    with: another net's (or an unused) cache would be reset while the net's own grows."""
    from minigraph.layers.attention import KVCache

    if kv_cache is None:
        for op in net.ops("infer"):
            if any(not v.persistable for v in op.in_place_outputs()):
                raise ValueError("generate: the net was built with a KV cache (its op "
                                 f"{op.type!r} keeps one); pass it as kv_cache= (with "
                                 "use_cache=False for full passes)")
        return
    if not isinstance(kv_cache, KVCache):
        raise TypeError(f"generate: kv_cache must be a layers.KVCache or None, got "
                        f"{type(kv_cache).__name__}")
    if kv_cache.net is not net:
        raise ValueError(f"generate: argument 'kv_cache' ({kv_cache.name!r}) is not the cache "
                         "this net was built with; pass the KVCache its layers were given")
