"""Launchers for kernels/cuda/attention.cu: scaled_dot_product_attention tiled with an
online softmax, and its gradient recomputed from the saved log-sum-exp.

Arrays are contiguous in the op's layout ((N, H, T, d), or (N, T, H*d) with `packed`);
the mask is any contiguous array broadcastable to (N, H, Tq, Tk). The dropout mask is
the CPU's bit for bit (kernels/cpu/attention.py): drawn from (seed, step) on the
device, the step an int64 device scalar. Head sizes up to ATT_DMAX.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import broadcast, fill, loader

MODULE = "attention"
ATT_ROWS = 64            # attention.cu's threads per block (one row each)
ATT_DMAX = 128           # attention.cu's largest head size
NO_STEP = -1             # dropout_step when no mask was drawn (kernels/cpu/attention.py's)
DIMS = "qqqqqqiiqqqqiqddI"
SIGNATURES = {"attention_advance": "PP"}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"attention_forward_{_t}": "P" * 7 + DIMS,
                       f"attention_rowdot_{_t}": "PPPqqqqi",
                       f"attention_dkdv_{_t}": "P" * 11 + DIMS,
                       f"attention_dq_{_t}": "P" * 9 + DIMS})


def logical_shape(a, heads):
    """(N, H, T, d) of a device array in the op's layout."""
    if heads:
        n, t, hd = a.shape
        return n, heads, t, hd // heads
    return tuple(int(s) for s in a.shape)


def mask_strides(mask, target):
    """(kind, four element strides) of `mask` broadcast to `target` (N, H, Tq, Tk); kind
    0 for None, 1 for bool, 2 for a float mask."""
    if mask is None:
        return 0, (0, 0, 0, 0)
    shape = (1,) * (4 - len(mask.shape)) + tuple(int(s) for s in mask.shape)
    strides, step = [0] * 4, 1
    for axis in range(3, -1, -1):
        strides[axis] = step if shape[axis] != 1 else 0
        step *= shape[axis]
    kind = 1 if np.dtype(mask.dtype) == np.bool_ else 2
    return kind, tuple(strides)


class Problem:
    """What every launch of one attention shares: shapes, layout, mask, causal offset,
    scale and dropout, as the kernels' trailing arguments."""

    def __init__(self, q, k, v, mask, heads, causal, variant, scale, p, seed):
        self.n, self.h, self.tq, self.d = logical_shape(q, heads)
        self.tk, self.dv = logical_shape(k, heads)[2], logical_shape(v, heads)[3]
        what = "scaled_dot_product_attention"
        if max(self.d, self.dv) > ATT_DMAX:
            raise ValueError(f"{what}: the GPU kernels take head sizes up to {ATT_DMAX}, got "
                             f"d={self.d}, dv={self.dv}")
        if self.n * self.h > 65535:
            raise ValueError(f"{what}: the GPU kernels take at most 65535 (batch x heads), "
                             f"got {self.n * self.h}")
        self.kind, self.ms = mask_strides(mask, (self.n, self.h, self.tq, self.tk))
        offset = 0 if variant == "upper_left" else self.tk - self.tq
        self.scale = scale if scale is not None else 1.0 / math.sqrt(self.d)
        self.p, self.seed = float(p), int(seed)
        self.args = (self.n, self.h, self.tq, self.tk, self.d, self.dv, int(bool(heads)),
                     self.kind, *self.ms, int(bool(causal)), int(offset), float(self.scale),
                     self.p, self.seed)

    def grid(self, rows):
        return (-(-rows // ATT_ROWS), self.n * self.h, 1)


def _kernel(name, dtype):
    name = f"{name}_{loader.suffix(dtype)}"
    return loader.kernel(MODULE, name, SIGNATURES[name])


def forward(q, k, v, mask, heads, causal, variant, scale, p=0.0, seed=0, step=None,
            want_lse=True):
    """(out, lse or None) of the attention; with p > 0, the dropout mask of (seed,
    step[0]) (step: an int64 device scalar, read here, not changed)."""
    pr = Problem(q, k, v, mask, heads, causal, variant, scale, p, seed)
    out_shape = (pr.n, pr.tq, pr.h * pr.dv) if heads else (pr.n, pr.h, pr.tq, pr.dv)
    out = loader.empty(out_shape, q.dtype)
    lse = loader.empty((pr.n, pr.h, pr.tq), q.dtype) if want_lse else None
    if out.size == 0 and (lse is None or lse.size == 0):
        return out, lse
    _kernel("attention_forward", q.dtype).launch(
        pr.grid(pr.tq), (ATT_ROWS, 1, 1), loader.ptr(q, "attention: q"),
        loader.ptr(k, "attention: k"), loader.ptr(v, "attention: v"),
        loader.ptr(mask, "attention: attn_mask"), loader.ptr(out), loader.ptr(lse),
        loader.ptr(step) if p > 0 else 0, *pr.args)
    return out, lse


def advance(step):
    """A device copy of the int64 scalar `step` (the step a mask was drawn with), then
    step += 1 on the device."""
    saved = loader.empty((), np.int64)
    k = loader.kernel(MODULE, "attention_advance", SIGNATURES["attention_advance"])
    k.launch((1, 1, 1), (32, 1, 1), loader.ptr(step, "attention: step"), loader.ptr(saved))
    return saved


def backward(q, k, v, mask, out, lse, dout, heads, causal, variant, scale, p=0.0, seed=0,
             dropout_step=None, wants=("dq", "dk", "dv")):
    """{dq, dk, dv, dmask} for the names in `wants` (dmask: a float mask's gradient,
    summed to its shape)."""
    pr = Problem(q, k, v, mask, heads, causal, variant, scale, p, seed)
    made = {}
    for name, like in (("dq", q), ("dk", k), ("dv", v)):
        if name in wants:
            made[name] = loader.empty(tuple(like.shape), q.dtype)
    ds = None
    if "dmask" in wants:
        ds = fill.full((pr.n, pr.h, pr.tq, pr.tk), 0.0, q.dtype)
    if pr.n * pr.h == 0 or (pr.tq == 0 and pr.tk == 0):
        return _finish(made, ds, mask)
    for name in ("dq", "dk", "dv"):
        if name in made and (pr.tq == 0 or pr.tk == 0):
            fill.fill_constant(made[name], 0.0)
    if pr.tq == 0 or pr.tk == 0:
        return _finish(made, ds, mask)
    big_d = loader.empty((pr.n, pr.h, pr.tq), q.dtype)
    rows = pr.n * pr.h * pr.tq
    go = loader.flat_go(MODULE, f"attention_rowdot_{loader.suffix(q.dtype)}",
                        SIGNATURES[f"attention_rowdot_{loader.suffix(q.dtype)}"], rows)
    go(loader.ptr(out, "attention_grad: out"), loader.ptr(dout, "attention_grad: dout"),
       loader.ptr(big_d), pr.n, pr.h, pr.tq, pr.dv, int(bool(heads)))
    common = (loader.ptr(q, "attention_grad: q"), loader.ptr(k, "attention_grad: k"),
              loader.ptr(v, "attention_grad: v"), loader.ptr(mask, "attention_grad: attn_mask"),
              loader.ptr(lse, "attention_grad: lse"), loader.ptr(dout), loader.ptr(big_d),
              loader.ptr(dropout_step) if p > 0 else 0)
    if "dk" in made or "dv" in made or ds is not None:
        _kernel("attention_dkdv", q.dtype).launch(
            pr.grid(pr.tk), (ATT_ROWS, 1, 1), *common, loader.ptr(made.get("dk")),
            loader.ptr(made.get("dv")), loader.ptr(ds), *pr.args)
    if "dq" in made:
        _kernel("attention_dq", q.dtype).launch(pr.grid(pr.tq), (ATT_ROWS, 1, 1), *common,
                                                loader.ptr(made["dq"]), *pr.args)
    return _finish(made, ds, mask)


def _finish(made, ds, mask):
    if ds is not None:
        made["dmask"] = broadcast.reduce_to(ds, tuple(mask.shape), what="attention_grad: mask")
    return made


# ---- op kernels -------------------------------------------------------------------

def _dropout(op):
    a = op.attrs
    return 0.0 if a["is_infer"] else a["dropout_p"]


def attention_gpu(op, ins, ctx):
    """out and lse on the device; with dropout in training, dropout_step = step and
    step += 1 there."""
    a = op.attrs
    p = _dropout(op)
    step = ins["step"]
    out, lse = forward(ins["q"], ins["k"], ins["v"], ins["attn_mask"], a["packed_heads"],
                       a["is_causal"], a["causal_variant"], a["scale"], p, a["seed"],
                       step, op.wants("lse"))
    saved = advance(step) if p > 0 else None
    if saved is None and op.wants("dropout_step"):
        saved = fill.full((), NO_STEP, np.int64)
    return present(out=out, lse=lse, dropout_step=saved,
                   step_out=step if step is not None else None)


def attention_grad_gpu(op, ins, ctx):
    """dq, dk, dv (and a float mask's gradient) on the device."""
    a = op.attrs
    wants = [s for s, slot in (("dq", "dq"), ("dk", "dk"), ("dv", "dv"),
                               ("dmask", "dattn_mask")) if op.wants(slot)]
    if not wants:
        return {}
    step = ins["dropout_step"]
    done = backward(ins["q"], ins["k"], ins["v"], ins["attn_mask"], ins["out"], ins["lse"],
                    ins["dout"], a["packed_heads"], a["is_causal"], a["causal_variant"],
                    a["scale"], _dropout(op) if step is not None else 0.0, a["seed"], step,
                    wants)
    return present(dq=done.get("dq"), dk=done.get("dk"), dv=done.get("dv"),
                   dattn_mask=done.get("dmask"))
