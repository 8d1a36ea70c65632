"""kv_cache_write: a layer's keys and values of a pass appended to a KV cache (the infer
branch of a net built with layers.KVCache; generation).

Inputs k (N, T, C) and v (N, T, Cv) (a multi-head layer's packed projections), the
cache's slabs cache_k (N, capacity, C) and cache_v (N, capacity, Cv) (updated in place;
a slab of another batch size is replaced by a new one while nothing is filled), and
`length` (int64 scalar, the positions filled; kept on the host). The pass's positions
go to rows offset .. offset + T of the slabs; outputs k_all and v_all are rows
0 .. offset + T (every position so far), which the layer's attention reads.
Attributes: capacity, advances and cache (the cache's name, for errors). The first layer
built with a cache advances it (offset = length, then length += T, in place through
length_out); each later one has offset = length - T. A pass past the capacity is an
error naming the cache: nothing wraps around.
In ONNX the cache is empty (the model is stateless): k_all = k, v_all = v.
No gradient (inference only). Kernels: kernels/cpu/kv_cache.py, kernels/cuda/kv_cache.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import kv_cache as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import kv_cache as cuda
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    kernel,
    register,
)
from minigraph.validators import (
    bool_attr,
    check_float,
    check_rank,
    check_same_dtype,
    dims_equal,
    fail,
    int_attr,
    positive,
    str_attr,
)

TYPE = "kv_cache_write"


def check_length(op_type, length):
    if tuple(length.shape) != () or length.dtype != np.int64:
        fail(op_type, "length", f"must be an int64 scalar (the KV cache's filled positions), "
                                f"got {length.dtype} of shape {tuple(length.shape)}")


def infer_kv_cache(ins, attrs):
    k, v = ins["k"], ins["v"]
    check_float(TYPE, "k", k)
    check_same_dtype(TYPE, "v", v, "k", k)
    for slot in ("k", "v", "cache_k", "cache_v"):
        check_rank(TYPE, slot, ins[slot], (3,))
    for slot, axis, what in (("v", 0, "batch size"), ("v", 1, "positions")):
        if not dims_equal(v.shape[axis], k.shape[axis]):
            fail(TYPE, slot, f"has {what} {v.shape[axis]}, input 'k' has {k.shape[axis]}")
    for slot, src in (("cache_k", k), ("cache_v", v)):
        c = ins[slot]
        check_same_dtype(TYPE, slot, c, "k", k)
        if not dims_equal(c.shape[1], attrs["capacity"]) or not dims_equal(c.shape[2],
                                                                            src.shape[2]):
            fail(TYPE, slot, f"must be (N, capacity {attrs['capacity']}, {src.shape[2]}), got "
                             f"{tuple(c.shape)}")
    check_length(TYPE, ins["length"])
    n = k.shape[0]
    return {"k_all": Meta((n, -1, k.shape[2]), k.dtype),
            "v_all": Meta((n, -1, v.shape[2]), v.dtype)}


def validate_kv_cache(op):
    if op.attrs["advances"] and op.outputs["length_out"] is None:
        raise OpError(f"{TYPE}: output 'length_out' must be bound to input 'length' when the "
                      "op advances the cache (advances=True)")


def export_kv_cache(ctx, op):
    """Identity: the exported model is one pass over an empty cache (stateless)."""
    nodes = []
    for src, dst in (("k", "k_all"), ("v", "v_all")):
        if ctx.wants(op.outputs[dst]):
            nodes.append(ctx.node("Identity", [ctx.value(op.inputs[src])],
                                  [ctx.output(op.outputs[dst])]))
    return nodes


def no_grad(op, dout, make_grad):
    if any(d is not None for d in dout.values()):
        raise OpError(f"{TYPE}: a KV cache is inference state; it has no gradient (build the "
                      "cache into the infer branch only: layers.multi_head_attention does)")
    return []


SCHEMA = register(OpSchema(
    type=TYPE,
    inputs=(Slot("k"), Slot("v"), Slot("cache_k"), Slot("cache_v"), Slot("length")),
    outputs=(Slot("k_all"), Slot("v_all"), Slot("cache_k_out"), Slot("cache_v_out"),
             Slot("length_out", optional=True)),
    attrs=(int_attr("capacity", 1, positive), bool_attr("advances", False),
           str_attr("cache", "kv_cache")),
    inplace={"cache_k_out": "cache_k", "cache_v_out": "cache_v", "length_out": "length"},
    infer=infer_kv_cache, validate=validate_kv_cache, grad=no_grad, export=export_kv_cache,
    doc=__doc__))
kernel(TYPE, "cpu", cpu.kv_cache_write_cpu, bind=cpu.bind_kv_cache_write)
kernel(TYPE, "gpu", cuda.kv_cache_write_gpu, dtypes=GPU_FLOATS)


def kv_cache_examples(ex):
    """Cases the device tests run on every place against the CPU (a first pass that
    advances the cache, a later layer's)."""
    return [("first-f32", {"k": ex.r(2, 3, 4), "v": ex.r(2, 3, 6, seed=1),
                           "cache_k": np.zeros((2, 5, 4), np.float32),
                           "cache_v": np.zeros((2, 5, 6), np.float32),
                           "length": np.array(0, np.int64)},
             dict(capacity=5, advances=True, cache="c"), ()),
            ("later-f64", {"k": ex.r(1, 2, 3, dtype=np.float64),
                           "v": ex.r(1, 2, 3, dtype=np.float64, seed=1),
                           "cache_k": ex.r(1, 4, 3, dtype=np.float64, seed=2),
                           "cache_v": ex.r(1, 4, 3, dtype=np.float64, seed=3),
                           "length": np.array(3, np.int64)},
             dict(capacity=4, advances=False, cache="c"), ())]


examples(TYPE, kv_cache_examples)
