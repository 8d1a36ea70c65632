"""Launchers for kernels/cuda/position_embedding.cu: a learned table of positions added
to a sequence, and the table's gradient (position_embedding's GPU kernels)."""
from __future__ import annotations

from minigraph.kernels import present
from minigraph.kernels.cpu.kv_cache import advanced
from minigraph.kernels.cpu.position_embedding import rows_of
from minigraph.kernels.cuda import fill, loader, shape_ops

MODULE = "position_embedding"
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"position_embedding_{_t}": "PPPqqqq",
                       f"position_embedding_grad_{_t}": "PPqqq"})


def add_rows(x, w, offset):
    """out = x + w[offset : offset + T] (x (N, T, D), w (P, D))."""
    n, t, d = (int(s) for s in x.shape)
    out = loader.empty((n, t, d), x.dtype)
    if out.size:
        name = f"position_embedding_{loader.suffix(x.dtype)}"
        loader.flat_go(MODULE, name, SIGNATURES[name], out.size)(
            loader.ptr(x, "position_embedding: x"), loader.ptr(w, "position_embedding: w"),
            loader.ptr(out), n, t, d, int(offset))
    return out


def rows_grad(dout, rows):
    """dw (rows, D): the batch's sum of dout in rows 0 .. T, zeros after."""
    n, t, d = (int(s) for s in dout.shape)
    dw = fill.full((rows, d), 0.0, dout.dtype)
    if t * d:
        name = f"position_embedding_grad_{loader.suffix(dout.dtype)}"
        loader.flat_go(MODULE, name, SIGNATURES[name], t * d)(
            loader.ptr(dout, "position_embedding_grad: dout"), loader.ptr(dw), n, t, d)
    return dw


def position_embedding_gpu(op, ins, ctx):
    """out = x + w[offset : offset + T] on the device; the first cached layer advances."""
    x, w, length = ins["x"], ins["w"], ins["length"]
    offset, new_length = rows_of(op, x, w, length)
    return present(out=add_rows(x, w, offset),
                   length_out=advanced(length, new_length) if new_length is not None else None)


def position_embedding_grad_gpu(op, ins, ctx):
    """dx = dout (a device copy); dw = rows_grad."""
    d, w = ins["dout"], ins["w"]
    return present(dx=shape_ops.copy(d) if op.wants("dx") else None,
                   dw=rows_grad(d, int(w.shape[0])) if op.wants("dw") else None)
