"""Launchers for kernels/cuda/kv_cache.cu: a pass's keys or values into a KV cache's
slab on the device, and the filled rows out of it (kv_cache_write's GPU kernel)."""
from __future__ import annotations

from minigraph.kernels.cpu.kv_cache import advanced, cache_offset
from minigraph.kernels.cuda import loader
from minigraph.schema import OpError

MODULE = "kv_cache"
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"kv_cache_put_{_t}": "PPqqqqq", f"kv_cache_take_{_t}": "PPqqqq"})


def put(src, slab, offset):
    """slab[:, offset : offset + T] = src (src (N, T, C), slab (N, capacity, C))."""
    n, t, c = (int(s) for s in src.shape)
    if src.size:
        name = f"kv_cache_put_{loader.suffix(src.dtype)}"
        loader.flat_go(MODULE, name, SIGNATURES[name], src.size)(
            loader.ptr(src, "kv_cache: src"), loader.ptr(slab, "kv_cache: slab"), n, t, c,
            int(slab.shape[1]), int(offset))


def take(slab, rows):
    """A new (N, rows, C) device array of slab[:, :rows]."""
    n, capacity, c = (int(s) for s in slab.shape)
    out = loader.empty((n, rows, c), slab.dtype)
    if out.size:
        name = f"kv_cache_take_{loader.suffix(slab.dtype)}"
        loader.flat_go(MODULE, name, SIGNATURES[name], out.size)(
            loader.ptr(slab, "kv_cache: slab"), loader.ptr(out), n, rows, c, capacity)
    return out


def kv_cache_write_gpu(op, ins, ctx):
    """kv_cache_write on the device (see kernels/cpu/kv_cache.py)."""
    a = op.attrs
    k, v, length = ins["k"], ins["v"], ins["length"]
    t = int(k.shape[1])
    offset, new_length = cache_offset("kv_cache_write", length, t, a)
    out = {}
    for key, src, slot in (("k", k, "cache_k"), ("v", v, "cache_v")):
        s = ins[slot]
        if int(s.shape[0]) != int(src.shape[0]) or s.dtype != src.dtype or \
                not hasattr(s, "gpudata"):          # the cache's first pass: a host stand-in
            if offset:
                raise OpError(f"kv_cache_write: the KV cache {a['cache']!r} holds {offset} "
                              f"positions of a batch of {int(s.shape[0])}, and input {key!r} "
                              f"has a batch of {int(src.shape[0])}; reset it (KVCache.reset()) "
                              "to start a new batch")
            s = loader.empty((int(src.shape[0]), a["capacity"], int(src.shape[2])), src.dtype)
        put(src, s, offset)
        out[f"{slot}_out"] = s
        out[f"{key}_all"] = take(s, offset + t)
    if new_length is not None:
        out["length_out"] = advanced(length, new_length)
    elif op.wants("length_out"):
        out["length_out"] = length
    return out
