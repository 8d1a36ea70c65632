"""CPU kernels of position_embedding (ops/position_embedding.py)."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import prepared, rows_native
from minigraph.kernels.cpu.kv_cache import advanced, cache_offset
from minigraph.schema import OpError


def rows_of(op, x, w, length):
    """(offset, new length or None) of a pass, checked against w's rows."""
    t = x.shape[1]
    offset, new_length = (0, None) if length is None else \
        cache_offset("position_embedding", length, t, op.attrs)
    if offset + t > w.shape[0]:
        cache = f" (KV cache {op.attrs['cache']!r})" if length is not None else ""
        raise OpError(f"position_embedding: input 'x' reaches position {offset + t - 1} "
                      f"(offset {offset} + {t} positions){cache}, past the {w.shape[0]} rows "
                      "of input 'w'")
    return offset, new_length


def position_embedding_cpu(op, ins, ctx):
    """out = x + w[offset : offset + T] (x's dtype); the first cached layer advances."""
    x, w, length = ins["x"], ins["w"], ins["length"]
    offset, new_length = rows_of(op, x, w, length)
    out = {"out": x + w[offset:offset + x.shape[1]]}
    if new_length is not None:
        out["length_out"] = advanced(length, new_length)
    return out


def bind_position_embedding(op):
    """position_embedding_cpu's bound form (minigraph.bound_run): x plus the rows into
    the same array every run, the offset and the cache's length as the kernel has
    them."""
    kept = {"key": None}

    def run(ins):
        x, w, length = ins["x"], ins["w"], ins["length"]
        key = (x.shape, x.dtype, w.dtype)
        if key != kept["key"]:
            out = prepared.aligned_empty(x.shape, np.result_type(x, w))
            if out.dtype != x.dtype:
                return None
            kept.update(key=key, out=out)
        offset, new_length = rows_of(op, x, w, length)
        np.add(x, w[offset:offset + x.shape[1]], out=kept["out"])
        outs = {"out": kept["out"]}
        if new_length is not None:
            outs["length_out"] = advanced(length, new_length)
        return outs
    return run


def position_embedding_grad_cpu(op, ins, ctx):
    """dx = dout (the same array, as elementwise_add_grad passes it on); dw = the batch's
    sum of dout in rows 0 .. T (in float64, rounded once: rows_native.sum_rows, numpy's
    bits, where it applies), zeros elsewhere."""
    d, w = ins["dout"], ins["w"]
    out = {}
    if op.wants("dx"):
        out["dx"] = d
    if op.wants("dw"):
        dw = np.zeros(w.shape, d.dtype)
        n, t = d.shape[:2]
        summed = rows_native.sum_rows(d.reshape(n, -1)) if d.flags.c_contiguous else None
        dw[:t] = d.sum(axis=0, dtype=np.float64) if summed is None else summed.reshape(d.shape[1:])
        out["dw"] = dw
    return out
