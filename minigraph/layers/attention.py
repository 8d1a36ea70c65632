"""Attention layers: scaled_dot_product_attention, multi_head_attention, a learned
position_embedding, and KVCache, the key/value cache of generation.

    cache = layers.KVCache(capacity=128)                  # positions it can hold
    h = layers.position_embedding(net, tok, 128, kv_cache=cache, name="wpe")
    h = layers.multi_head_attention(net, h, num_heads=4, causal=True, kv_cache=cache,
                                    name="block0.attn")

A KVCache is state of the infer branch, never of training and never persistable (it
is not in checkpoints): the layers built with it add, to their infer copies only,
ops that append each pass's keys and values to the cache and read every position
so far, so a pass of one new token costs one token's work. The first layer built
with the cache advances its count of positions by each pass's length (the position
embedding, when there is one: it reads the count as its offset); later layers read
it. A pass that would run past the capacity is an error naming the cache (nothing
wraps around); `cache.reset()` empties it for a new sequence or batch. Training
(`net.train`) never reads or changes it. minigraph.generation.generate drives it.
"""
from __future__ import annotations

import zlib

import numpy as np

from minigraph.initializer import Constant, Normal
from minigraph.layers.base import float_arg, int_arg, known_rank, layer, parameter, tensor
from minigraph.layers.nn import project
from minigraph.validators import is_int


class KVCache:
    """The key/value cache of the layers built with it (see the module doc).

    capacity: how many positions it holds (a pass past it is an error); name: the
    prefix of its state Variables (None: `kv_cache_k`, unique in the net). One cache
    serves one net (all its layers); its state lives in the net's infer scope:
    `<name>.length` (int64, the positions filled, on the host) and each layer's
    `<layer>.cache_k` / `<layer>.cache_v` slabs (batch, capacity, width).
    """

    def __init__(self, capacity, name=None):
        if not is_int(capacity) or capacity < 1:
            raise ValueError(f"KVCache: capacity must be an int >= 1, got {capacity!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"KVCache: name must be a non-empty str or None, got {name!r}")
        self.capacity, self.name = int(capacity), name
        self.net = None
        self.length = None

    def attach(self, net, kind):
        """(length Variable, advances) for a layer `kind` being built in `net`: the first
        layer (or the first after a failed build removed the state) advances the cache."""
        if self.net is not None and self.net is not net:
            raise ValueError(f"{kind}: argument 'kv_cache' ({self.name!r}) belongs to another "
                             "net; make a KVCache per net")
        scope = net.scopes["infer"]
        if self.length is not None and scope.find_local_var(self.length.name) is self.length:
            return self.length, False
        if self.net is None:
            if self.name is None:
                self.name = net.unique_name("kv_cache")
            elif net.name_taken(self.name):
                raise ValueError(f"{kind}: the KV cache's name {self.name!r} is already used "
                                 "in this net; pick another")
        self.net = net
        self.length = scope.new_var(f"{self.name}.length")
        self.length.set(np.array(0, np.int64))
        return self.length, True

    def slab(self, net, layer_name, width, dtype, key):
        """A new slab Variable `<layer_name>.cache_<key>` (empty until the first pass)."""
        var = net.scopes["infer"].new_var(f"{layer_name}.cache_{key}")
        var.set(np.zeros((0, self.capacity, width), dtype))
        return var

    @property
    def filled(self):
        """How many positions the cache holds now (0 before its net is built)."""
        if self.length is None or self.length.value is None:
            return 0
        return int(np.asarray(self.length.get()))

    def reset(self):
        """Empty the cache (a new sequence, or a new batch size)."""
        if self.length is not None:
            self.length.set(np.array(0, np.int64))

    def __repr__(self):
        return f"KVCache(capacity={self.capacity}, name={self.name!r}, filled={self.filled})"


def _cache_arg(kind, kv_cache):
    if kv_cache is not None and not isinstance(kv_cache, KVCache):
        raise TypeError(f"{kind}: argument 'kv_cache' must be a layers.KVCache or None, got "
                        f"{type(kv_cache).__name__}")
    return kv_cache


def _dropout_state(net, name, p):
    """(step counter, seed) of a layer that drops with probability p > 0, as dropout's:
    the persistable `name.step` and the net's seed mixed with the layer's name."""
    step = net.create_parameter(f"{name}.step", (), "int64", Constant(0), trainable=False)
    return step, (net.seed ^ zlib.crc32(name.encode())) % 2 ** 32


def _attention(net, kind, name, q, k, v, attrs, mask=None):
    """The scaled_dot_product_attention op (a step counter when it drops); its out."""
    inputs = {"q": q, "k": k, "v": v}
    outputs = {"out": f"{name}.out", "lse": f"{name}.lse"}
    if mask is not None:
        inputs["attn_mask"] = mask
    if attrs["dropout_p"] > 0:
        step, attrs["seed"] = _dropout_state(net, name, attrs["dropout_p"])
        inputs["step"] = step
        outputs.update(step_out=step, dropout_step=f"{name}.dropout_step")
    return net.append("scaled_dot_product_attention", inputs, outputs, attrs)["out"]


@layer("scaled_dot_product_attention")
def scaled_dot_product_attention(net, q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0,
                                 scale=None, name=None):
    """softmax(q k^T * scale + mask) v on (N, heads, T, d) tensors: torch's
    F.scaled_dot_product_attention (see ops/attention.py). attn_mask: bool (True: the
    pair takes part) or a float added to the scores, broadcastable to (N, heads, Tq,
    Tk); is_causal: query i sees keys j <= i (top-left aligned, as torch's), with a
    mask too both apply; scale: None for 1 / sqrt(d); dropout_p: dropout on the
    weights in training (the net forks here; masks from the net's seed, the layer's
    name and its step counter `name.step`). Never more than a block of the score
    matrix is held: memory grows with T, not T^2. A query with no key left gets 0."""
    kind = "scaled_dot_product_attention"
    for arg, x in (("q", q), ("k", k), ("v", v)):
        tensor(net, kind, arg, x, float_only=True)
        if len(known_rank(kind, x)) != 4:
            raise ValueError(f"{kind}: argument '{arg}' ({x.name!r}) must be (N, heads, T, d) "
                             f"(rank 4), got shape {x.shape}")
    if attn_mask is not None:
        tensor(net, kind, "attn_mask", attn_mask)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"{kind}: argument 'is_causal' must be True or False, got "
                         f"{is_causal!r}")
    attrs = {"is_causal": bool(is_causal),
             "dropout_p": float_arg(kind, "dropout_p", dropout_p, 0.0, 1.0, high_open=True),
             "scale": None if scale is None else float_arg(kind, "scale", scale, 0.0)}
    if attrs["scale"] == 0.0:
        raise ValueError(f"{kind}: argument 'scale' must be > 0 (or None for 1 / sqrt(d)), "
                         f"got {scale!r}")
    return _attention(net, kind, name, q, k, v, attrs, attn_mask)


def _sequence(net, kind, x):
    """x's declared shape, checked to be a float sequence (N, T, D) with D known."""
    tensor(net, kind, "x", x, float_only=True)
    shape = known_rank(kind, x)
    if len(shape) != 3 or shape[2] < 0:
        raise ValueError(f"{kind}: argument 'x' ({x.name!r}) must be (N, T, D) with D known, "
                         f"got shape {shape}")
    return shape


@layer("multi_head_attention")
def multi_head_attention(net, x, num_heads, causal=False, dropout=0.0, kv_cache=None,
                         name=None):
    """Self-attention of a sequence x (N, T, D) with num_heads heads of D / num_heads:
    q, k and v projections (`name.q`, `name.k`, `name.v`: linear layers of D, each with
    `.w` (D, D) and `.b`), scaled dot-product attention per head (causal: position i
    sees positions <= i; dropout on the weights in training), and the output projection
    `name.out`. Returns (N, T, D). kv_cache: a KVCache; the infer branch then appends
    each pass's keys and values to it and attends to every cached position (a pass of
    the new tokens only; see the module doc)."""
    kind = "multi_head_attention"
    shape = _sequence(net, kind, x)
    width = shape[2]
    heads = int_arg(kind, "num_heads", num_heads)
    if width % heads:
        raise ValueError(f"{kind}: argument 'num_heads' ({heads}) must divide the {width} "
                         f"features of {x.name!r}")
    p = float_arg(kind, "dropout", dropout, 0.0, 1.0, high_open=True)
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"{kind}: argument 'causal' must be True or False, got {causal!r}")
    cache = _cache_arg(kind, kv_cache)
    q, k, v = (project(net, kind, x, width, f"{name}.{part}") for part in "qkv")
    if cache is not None:
        length, advances = cache.attach(net, kind)
        slabs = {key: cache.slab(net, name, width, x.dtype, key) for key in "kv"}
        outputs = {"k_all": f"{name}.k_all", "v_all": f"{name}.v_all",
                   "cache_k_out": slabs["k"], "cache_v_out": slabs["v"], "length_out": length}
        net.append_infer("kv_cache_write", {"k": k, "v": v, "cache_k": slabs["k"],
                                            "cache_v": slabs["v"], "length": length},
                         outputs, {"capacity": cache.capacity, "advances": advances,
                                   "cache": cache.name}, twins={"k_all": k, "v_all": v})
    attrs = {"is_causal": bool(causal), "causal_variant": "lower_right", "dropout_p": p,
             "packed_heads": heads}
    h = _attention(net, kind, f"{name}.attention", q, k, v, attrs)
    return project(net, kind, h, width, f"{name}.out")


@layer("position_embedding")
def position_embedding(net, x, max_positions, kv_cache=None, param_attr=None, name=None):
    """x (N, T, D) + a learned table's rows 0 .. T (GPT's wpe): `name.w` (max_positions,
    D), initialised N(0, 1) as torch.nn.Embedding (param_attr: a ParamAttr, its name, or
    None; GPT-2 uses Normal(0, 0.02)). kv_cache: a KVCache; the infer branch's rows then
    start at the cache's filled positions (the first layer built with it advances it)."""
    kind = "position_embedding"
    shape = _sequence(net, kind, x)
    rows = int_arg(kind, "max_positions", max_positions)
    if shape[1] > rows:
        raise ValueError(f"{kind}: argument 'x' ({x.name!r}) has {shape[1]} positions, more "
                         f"than max_positions={rows}")
    cache = _cache_arg(kind, kv_cache)
    w = parameter(net, kind, "param_attr", param_attr, f"{name}.w", (rows, shape[2]), x.dtype,
                  Normal(0.0, 1.0))
    infer = None
    if cache is not None:
        length, advances = cache.attach(net, kind)
        infer = {"inputs": {"length": length},
                 "attrs": {"advances": advances, "cache": cache.name,
                           "capacity": cache.capacity},
                 "outputs": {"length_out": length}}
    return net.append("position_embedding", {"x": x, "w": w}, {"out": f"{name}.out"},
                      infer=infer)["out"]
