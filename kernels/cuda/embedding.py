"""Launchers for kernels/cuda/embedding.cu: rows of a table gathered by int64 id, and
the table's gradient scattered back (added in double); the op kernels of
ops/embedding.py.

An id outside [0, rows) cannot raise at launch time without a host round trip:
its row of out is NaN, it adds nothing to the gradient, and an `IdStatus` on the
device counts it; `IdStatus.check()` (a synchronising read, meant for fetch
time: minigraph.device.check_flags) raises an OpError naming input 'ids'.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader
from minigraph.schema import OpError

MODULE = "embedding"
SIGNATURES = {**{f"embedding_{t}": "PPPqqqP" for t in ("f32", "f64")},
              **{f"embedding_grad_{t}": "PPPqqqqP" for t in ("f32", "f64")},
              "embedding_zero": "Pq", "embedding_to_f32": "PPq"}


class IdStatus:
    """Device counters of out-of-range ids: [count, 1 + some flagged flat position,
    the table's rows there]."""

    def __init__(self):
        from minigraph.kernels.cuda import fill

        self.array = fill.full((3,), 0, np.uint32)

    def check(self, what="embedding"):
        """Raise OpError if any launch since the last check saw an id outside the table
        (reads three words from the device: synchronises), then reset."""
        count, position, rows = (int(v) for v in self.array.get())
        if count:
            from minigraph.kernels.cuda import fill

            fill.fill_constant(self.array, 0)
            raise OpError(f"{what}: input 'ids' had {count} value(s) outside [0, {rows}) for "
                          f"a table of {rows} rows, e.g. at flat position {position - 1}")


def default_status():
    """The IdStatus shared by launches that are not given one (per device)."""
    return loader.cached("embedding.default_status", IdStatus)


def _go(name, items, *args):
    loader.flat_go(MODULE, name, SIGNATURES[name], items)(*args)


def embedding(ids, w, status=None):
    """out (ids.shape + (dim,)) = w[ids] for int64 `ids` of any shape and a (rows, dim)
    float table `w`. Bad ids: see IdStatus."""
    launch.check_contiguous("embedding: ids", ids)
    launch.check_contiguous("embedding: w", w)
    if np.dtype(ids.dtype) != np.int64 or len(w.shape) != 2:
        raise ValueError(f"embedding: ids must be int64 and w 2-D, got {np.dtype(ids.dtype)} "
                         f"and w of shape {tuple(w.shape)}")
    rows, dim = (int(n) for n in w.shape)
    status = default_status() if status is None else status
    out = loader.empty(tuple(ids.shape) + (dim,), w.dtype)
    if out.size:
        _go(f"embedding_{loader.suffix(w.dtype)}", out.size, loader.ptr(ids), loader.ptr(w),
            loader.address(out), ids.size, rows, dim, loader.address(status.array))
    return out


def embedding_grad(ids, w_shape, dout, padding_idx=-1, status=None):
    """dw (w_shape, dout's dtype): dw[r] = the sum of dout[..., :] over the positions whose
    id is r, added in double (atomics: the order of the additions varies); row
    padding_idx (-1: none) stays 0. Bad ids: see IdStatus (they add nothing)."""
    rows, dim = (int(n) for n in w_shape)
    launch.check_contiguous("embedding_grad: ids", ids)
    if np.dtype(ids.dtype) != np.int64:
        raise ValueError(f"embedding_grad: ids must be int64, got {np.dtype(ids.dtype)}")
    launch.check_array("embedding_grad: dout", dout, tuple(ids.shape) + (dim,), dout.dtype)
    status = default_status() if status is None else status
    dw = loader.empty((rows, dim), dout.dtype)
    if dw.size == 0:
        return dw
    sfx = loader.suffix(dout.dtype)
    acc = loader.address(dw) if sfx == "f64" else loader.scratch(dw.size, np.float64)
    _go("embedding_zero", dw.size, acc, dw.size)
    if dout.size:
        _go(f"embedding_grad_{sfx}", dout.size, loader.ptr(ids), loader.ptr(dout), acc,
            ids.size, rows, dim, int(padding_idx), loader.address(status.array))
    if sfx == "f32":
        _go("embedding_to_f32", dw.size, acc, loader.address(dw), dw.size)
    return dw


# ---- op kernels -------------------------------------------------------------------

def id_status(what):
    """The device-side record of out-of-range ids met by the `what` kernels; the place's
    check_errors() (at fetch time) raises for them."""
    return loader.error_flag(what, IdStatus)


def embedding_gpu(op, ins, ctx):
    """out = w[ids] on the device; an id outside the table gives a NaN row and is flagged
    on the device (the error raises when the step checks its flags, not here)."""
    return {"out": embedding(ins["ids"], ins["w"], id_status(op.type))}


def embedding_grad_gpu(op, ins, ctx):
    """dw on the device (rows summed in double, the padding row 0), when bound."""
    if not op.wants("dw"):
        return {}
    return {"dw": embedding_grad(ins["ids"], ins["w"].shape, ins["dout"],
                                 op.attrs["padding_idx"], id_status(op.type))}
