"""position_embedding: out = x + w[offset : offset + T], a learned table of positions
added to a sequence (GPT's wpe).

x (N, T, D) float; w (P, D) of x's dtype. Without the optional `length` input the
offset is 0 (training, and passes without a cache). With a KV cache's `length` (int64
scalar, the positions filled, on the host) the offset follows the cache
(ops/kv_cache.py): advances=True (the first layer built with the cache) takes
offset = length and raises length by T through length_out; otherwise
offset = length - T; capacity (0: none) is the cache's, and a pass past it is an
error naming the cache. Positions past w's P rows are an error naming 'x'.
position_embedding_grad(w (shape only), dout) -> dx = dout, dw = the sum over the
batch of dout in rows 0 .. T, zeros elsewhere (the train branch binds no length).
In ONNX: Slice(w, 0, T) + Add (the exported model is stateless: offset 0).
Kernels: kernels/cpu/position_embedding.py, kernels/cuda/position_embedding.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import position_embedding as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import position_embedding as cuda
from minigraph.ops.kv_cache import check_length
from minigraph.schema import (
    Meta,
    OpDesc,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_schema,
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
    non_negative,
    str_attr,
)

TYPE = "position_embedding"


def infer_position_embedding(ins, attrs):
    x, w = ins["x"], ins["w"]
    check_float(TYPE, "x", x)
    check_rank(TYPE, "x", x, (3,))
    check_rank(TYPE, "w", w, (2,))
    check_same_dtype(TYPE, "w", w, "x", x)
    if not dims_equal(w.shape[1], x.shape[2]):
        fail(TYPE, "w", f"has rows of {w.shape[1]} values, input 'x' has {x.shape[2]} per "
                        "position: they must match")
    if ins.get("length") is None and x.shape[1] >= 0 and w.shape[0] >= 0 and \
            x.shape[1] > w.shape[0]:
        fail(TYPE, "x", f"has {x.shape[1]} positions, more than the {w.shape[0]} rows of "
                        "input 'w'")
    if ins.get("length") is not None:
        check_length(TYPE, ins["length"])
    return {"out": Meta(x.shape, x.dtype)}


def infer_position_embedding_grad(ins, attrs):
    d, w = ins["dout"], ins["w"]
    check_rank(TYPE + "_grad", "dout", d, (3,))
    return {"dx": Meta(d.shape, d.dtype), "dw": Meta(w.shape, w.dtype)}


def validate_position_embedding(op):
    if op.attrs["advances"] and (op.inputs["length"] is None or op.outputs["length_out"] is None):
        raise OpError(f"{TYPE}: advances=True needs input 'length' and output 'length_out' "
                      "(bound to it)")


def grad_position_embedding(op, dout, make_grad):
    d = dout.get("out")
    if d is None:
        return []
    if op.inputs["length"] is not None:
        raise OpError(f"{TYPE}: no gradient with a KV cache's offset (input 'length': the "
                      "infer branch's)")
    grads = {"dx": make_grad(op.inputs["x"]), "dw": make_grad(op.inputs["w"])}
    if all(g is None for g in grads.values()):
        return []
    return [OpDesc(TYPE + "_grad", dict(w=op.inputs["w"], dout=d,
                                        **{k: v for k, v in grads.items() if v is not None},
                                        **op.attrs))]


def export_position_embedding(ctx, op):
    """Add(x, Slice(w, [0], [T], axes [0])), T = Shape(x)[1] (offset 0: stateless)."""
    x, w, out = op.inputs["x"], op.inputs["w"], op.outputs["out"]
    shape, t, rows = (ctx.temp(out, s) for s in ("x_shape", "positions", "rows"))
    return [ctx.node("Shape", [ctx.value(x)], [shape]),
            ctx.node("Slice", [shape, ctx.const(out, "one", np.array([1], np.int64)),
                               ctx.const(out, "two", np.array([2], np.int64))], [t]),
            ctx.node("Slice", [ctx.value(w), ctx.const(out, "zero", np.array([0], np.int64)),
                               t, ctx.const(out, "axis", np.array([0], np.int64))], [rows]),
            ctx.node("Add", [ctx.value(x), rows], [ctx.output(out)])]


SCHEMA = register(OpSchema(
    type=TYPE, inputs=(Slot("x"), Slot("w"), Slot("length", optional=True)),
    outputs=(Slot("out"), Slot("length_out", optional=True)),
    attrs=(bool_attr("advances", False), str_attr("cache", ""),
           int_attr("capacity", 0, non_negative)),
    inplace={"length_out": "length"}, infer=infer_position_embedding,
    validate=validate_position_embedding, grad=grad_position_embedding,
    export=export_position_embedding, doc=__doc__))
register(grad_schema(SCHEMA, inputs=(Slot("w", shape_only=True), Slot("dout")),
                     outputs=(Slot("dx", optional=True), Slot("dw", optional=True)),
                     infer=infer_position_embedding_grad))
kernel(TYPE, "cpu", cpu.position_embedding_cpu, bind=cpu.bind_position_embedding)
kernel(TYPE + "_grad", "cpu", cpu.position_embedding_grad_cpu)
kernel(TYPE, "gpu", cuda.position_embedding_gpu, dtypes=GPU_FLOATS)
kernel(TYPE + "_grad", "gpu", cuda.position_embedding_grad_gpu, dtypes=GPU_FLOATS)


def position_embedding_examples(ex):
    """Cases the device tests run on every place against the CPU."""
    return [("f32", {"x": ex.r(2, 5, 3), "w": ex.r(7, 3, seed=1)}, {}, (("x", "w"), ("w",))),
            ("cached-f64", {"x": ex.r(2, 2, 4, dtype=np.float64),
                            "w": ex.r(6, 4, dtype=np.float64, seed=1),
                            "length": np.array(3, np.int64)},
             dict(advances=True, cache="c", capacity=6), ())]


examples(TYPE, position_embedding_examples)
