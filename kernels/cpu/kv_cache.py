"""CPU kernels of kv_cache_write and position_embedding's cache offset (ops/kv_cache.py,
ops/position_embedding.py): a KV cache's count of filled positions, the slabs its keys
and values are written into, and the errors that name the cache.

A cache's `length` is an int64 scalar held on the host on every place (each op reads
it once per pass; a device scalar works too, at the price of a copy). The first layer
built with a cache advances it: that op's offset is the length, which it then raises
by the pass's T; every later layer's offset is length - T (the first has advanced it
in this pass).
"""
from __future__ import annotations

import numpy as np

from minigraph.schema import OpError


def cache_offset(op_type, length, count, attrs):
    """(offset, new length or None) of a pass of `count` positions through a cached op
    whose `length` input holds the filled positions; an OpError naming the cache when the
    pass would run past its capacity (attrs: advances, cache, capacity; capacity 0:
    none)."""
    filled = host_int(length)
    name, capacity = attrs["cache"], attrs["capacity"]
    if attrs["advances"]:
        if capacity and filled + count > capacity:
            raise OpError(f"{op_type}: the KV cache {name!r} is full: it holds {capacity} "
                          f"positions, {filled} are filled and this pass adds {count}; reset "
                          "it (KVCache.reset()) or build it with a larger capacity")
        return filled, filled + count
    if capacity and filled > capacity:
        raise OpError(f"{op_type}: the KV cache {name!r} holds {filled} positions, more than "
                      f"its capacity {capacity}")
    if filled < count:
        raise OpError(f"{op_type}: the KV cache {name!r} holds {filled} positions, fewer than "
                      f"this pass's {count}: the layer that advances it (the first built "
                      "with it) has not run before this one")
    return filled - count, None


def host_int(length):
    """The value of an int64 scalar, a host array or a device one (a test's)."""
    if isinstance(length, np.ndarray):
        return int(length)
    return int(np.asarray(length.get()))


def advanced(length, new_length):
    """The length output: `length` set to new_length in place."""
    if isinstance(length, np.ndarray):
        length[...] = new_length
    else:
        length.set(np.array(new_length, np.int64))
    return length


def slab(name, cache, like, capacity, filled, what):
    """The slab to write a pass into: `cache` itself, or, when it holds another batch size
    (its first pass, or after a reset), a new zeroed one of like's batch size; an OpError
    naming the cache when the batch size changes with positions filled."""
    n, width = like.shape[0], like.shape[2]
    if cache.shape[0] == n and cache.dtype == like.dtype:
        return cache
    if filled:
        raise OpError(f"kv_cache_write: the KV cache {name!r} holds {filled} positions of a "
                      f"batch of {cache.shape[0]}, and input {what!r} has a batch of {n}; "
                      "reset it (KVCache.reset()) to start a new batch")
    return np.zeros((n, capacity, width), like.dtype)


def kv_cache_write_cpu(op, ins, ctx):
    """Write k and v at the cache's offset into its slabs; k_all and v_all are the filled
    positions (views of the slabs); the first layer raises the length."""
    a = op.attrs
    k, v, length = ins["k"], ins["v"], ins["length"]
    offset, new_length = cache_offset("kv_cache_write", length, k.shape[1], a)
    slabs = (slab(a["cache"], ins["cache_k"], k, a["capacity"], offset, "k"),
             slab(a["cache"], ins["cache_v"], v, a["capacity"], offset, "v"))
    return written(op, slabs, k, v, offset, length, new_length)


def written(op, slabs, k, v, offset, length, new_length):
    """k and v written into the slabs (cache_k's, cache_v's) at `offset`: the op's
    outputs, the length raised to new_length (None: left)."""
    end = offset + k.shape[1]
    slabs[0][:, offset:end] = k
    slabs[1][:, offset:end] = v
    out = {"cache_k_out": slabs[0], "cache_v_out": slabs[1],
           "k_all": slabs[0][:, :end], "v_all": slabs[1][:, :end]}
    if new_length is not None:
        out["length_out"] = advanced(length, new_length)
    elif op.wants("length_out"):
        out["length_out"] = length
    return out


def bind_kv_cache_write(op):
    """kv_cache_write_cpu's bound form (minigraph.bound_run): the same writes, views and
    errors; the slabs' checks (slab) skipped while they are the arrays the last run
    wrote into, for k and v of the same batch and dtype."""
    a = op.attrs
    kept = {"slabs": None, "key": None}

    def run(ins):
        k, v, length = ins["k"], ins["v"], ins["length"]
        slabs, key = (ins["cache_k"], ins["cache_v"]), (k.shape[0], k.dtype, v.dtype)
        if kept["slabs"] is None or slabs[0] is not kept["slabs"][0] or \
                slabs[1] is not kept["slabs"][1] or key != kept["key"]:
            out = kv_cache_write_cpu(op, ins, None)
            kept.update(slabs=(out["cache_k_out"], out["cache_v_out"]), key=key)
            return out
        offset, new_length = cache_offset("kv_cache_write", length, k.shape[1], a)
        return written(op, slabs, k, v, offset, length, new_length)
    return run
