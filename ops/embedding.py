"""embedding: rows of a table looked up by integer id (torch.nn.functional.embedding).

ids: int64 of any shape, each in [0, rows); w: the (rows, dim) table; out:
ids.shape + (dim,), out[..., :] = w[ids[...], :]. padding_idx (-1: none) names a row
whose gradient is always 0. An id outside [0, rows) is an error naming 'ids'.
embedding_grad(ids, w, dout) -> dw: dw[r] = the sum of dout over the positions whose id
is r (padding_idx's stays 0); ids have no gradient. In ONNX: Gather(w, ids, axis 0).
Kernels: kernels/cpu/embedding.py, kernels/cuda/embedding.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import embedding as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import embedding as cuda
from minigraph.schema import (
    Meta,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_maker,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import check_float, check_rank, fail, int_attr

TYPE = "embedding"


def infer_embedding(ins, attrs):
    ids, w = ins["ids"], ins["w"]
    if ids.dtype != np.int64:
        fail(TYPE, "ids", f"must have dtype int64 (row indices), got {ids.dtype}")
    check_rank(TYPE, "w", w, (2,))
    check_float(TYPE, "w", w)
    return {"out": Meta(tuple(ids.shape) + (w.shape[1],), w.dtype)}


def validate_embedding(op):
    w, pad = op.inputs["w"], op.attrs["padding_idx"]
    rows = w.shape[0] if w.shape is not None else -1
    if pad < -1 or (rows >= 0 and pad >= rows):
        raise OpError(f"{TYPE}: attribute 'padding_idx' must be -1 (none) or a row of the "
                      f"{rows}-row table 'w', got {pad}")


def export_embedding(ctx, op):
    """Gather(w, ids, axis 0)."""
    return [ctx.node("Gather", [ctx.value(op.inputs["w"]), ctx.value(op.inputs["ids"])],
                     [ctx.output(op.outputs["out"])], axis=0)]


SCHEMA = register(OpSchema(
    type=TYPE, inputs=(Slot("ids"), Slot("w")), outputs=(Slot("out"),),
    attrs=(int_attr("padding_idx", -1),), infer=infer_embedding, validate=validate_embedding,
    grad=grad_maker("embedding_grad", keep=("ids", "w"), wrt=("w",)),
    export=export_embedding, doc=__doc__))
register(grad_schema(SCHEMA, inputs=(Slot("ids"), Slot("w", shape_only=True), Slot("dout")),
                     outputs=(Slot("dw", optional=True),),
                     infer=lambda ins, attrs: {"dw": Meta(ins["w"].shape, ins["w"].dtype)}))
kernel(TYPE, "cpu", cpu.embedding_cpu, bind=cpu.bind_embedding)
kernel(TYPE + "_grad", "cpu", cpu.embedding_grad_cpu)
kernel(TYPE, "gpu", cuda.embedding_gpu, dtypes=GPU_FLOATS)
kernel(TYPE + "_grad", "gpu", cuda.embedding_grad_gpu, dtypes=GPU_FLOATS)


def embedding_examples(ex):
    """Cases the device tests run on every place against the CPU (ids repeat, so the
    table's gradient sums)."""
    ids = ex.labels(12, 7).reshape(3, 4)
    return [("f32", {"ids": ids, "w": ex.r(7, 5)}, {}, (("w",),)),
            ("padding-f64", {"ids": ids, "w": ex.r(7, 3, dtype=np.float64)},
             dict(padding_idx=int(ids[0, 0])), (("w",),))]


examples(TYPE, embedding_examples)
