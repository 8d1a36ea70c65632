"""CPU kernels of embedding (ops/embedding.py): rows of the table gathered by id, and
the table's gradient summed back row by row (the padding row gets none)."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import prepared
from minigraph.schema import OpError


def check_ids(op, ids, rows):
    """OpError naming the first id outside [0, rows)."""
    if not ids.size or (ids.min() >= 0 and ids.max() < rows):
        return
    bad = np.flatnonzero((ids < 0) | (ids >= rows))
    if bad.size:
        i = int(bad[0])
        raise OpError(f"{op.type}: input 'ids' has value {int(ids.reshape(-1)[i])} at flat "
                      f"position {i}, outside [0, {rows}) for a table of {rows} rows")


def embedding_cpu(op, ins, ctx):
    """out[..., :] = w[ids[...], :]."""
    ids, w = ins["ids"], ins["w"]
    check_ids(op, ids, w.shape[0])
    return {"out": np.take(w, ids, axis=0)}


def bind_embedding(op):
    """embedding_cpu's bound form (minigraph.bound_run): the rows gathered into the
    same array every run, the ids checked as the kernel checks them."""
    kept = {"key": None}

    def run(ins):
        ids, w = ins["ids"], ins["w"]
        key = (ids.shape, w.shape, w.dtype)
        if key != kept["key"]:
            out = prepared.aligned_empty(ids.shape + w.shape[1:], w.dtype)
            kept.update(key=key, out=out, outs={"out": out})
        if ids.size == 1:               # a generated token's: one row, one check
            i = int(ids.reshape(-1)[0])
            if not 0 <= i < w.shape[0]:
                check_ids(op, ids, w.shape[0])
            kept["out"].reshape(w.shape[1:])[...] = w[i]
        else:
            check_ids(op, ids, w.shape[0])
            np.take(w, ids, axis=0, out=kept["out"])
        return kept["outs"]
    return run


def embedding_grad_cpu(op, ins, ctx):
    """dw[r] = the sum of dout over the positions whose id is r (in float64); the
    padding row's stays 0."""
    ids, w, d = ins["ids"], ins["w"], ins["dout"]
    if not op.wants("dw"):
        return {}
    check_ids(op, ids, w.shape[0])
    flat = ids.reshape(-1)
    dw = np.zeros(w.shape, np.float64)
    if flat.size:                   # rows of each id summed in order (np.add.at's, faster)
        order = np.argsort(flat, kind="stable")
        rows, starts = np.unique(flat[order], return_index=True)
        # cast once: reduceat with dtype=float64 casts as it goes, the same sums slower
        gathered = d.reshape(flat.size, w.shape[1])[order].astype(np.float64, copy=False)
        dw[rows] = np.add.reduceat(gathered, starts, axis=0)
    if op.attrs["padding_idx"] >= 0:
        dw[op.attrs["padding_idx"]] = 0.0
    return {"dw": dw.astype(w.dtype)}
