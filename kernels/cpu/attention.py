"""CPU kernels of scaled_dot_product_attention (ops/attention.py).

The native kernel (attention_native.c) runs where it is built: blocks of queries
against blocks of keys with an online softmax, never more than a block of scores.
Here is its reference, a numpy engine with the same contract and memory bound: rows
of queries in blocks of at most BLOCK_SCORES scores (over every head) at a time, in
float64, cast back to the inputs' dtype. Both recompute the probabilities of the
gradient from the saved log-sum-exp and draw the dropout mask again from
(seed, dropout_step).
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cpu import attention_native, prepared
from minigraph.kernels.cpu.dropout import seed_of
from minigraph.kernels.cpu.philox import philox_words, uniforms24

STREAM = 3               # dropout uses 2; fill.cu's initialisers 0 and 1
BLOCK_SCORES = 1 << 18   # scores (all heads together) the numpy engine holds at once
NO_STEP = -1             # dropout_step when no mask was drawn


# ---- the problem, as the kernels see it -------------------------------------------------

def heads_view(a, heads):
    """`a` as (N, H, T, d): itself, or a view of the packed (N, T, H*d) layout."""
    if not heads:
        return a
    n, t, hd = a.shape
    return a.reshape(n, t, heads, hd // heads).transpose(0, 2, 1, 3)


def packed_out(o4, heads):
    """(N, H, T, d) as the op's out layout: itself, or packed (N, T, H*d) (C order)."""
    if not heads:
        return np.ascontiguousarray(o4)
    n, h, t, d = o4.shape
    return np.ascontiguousarray(o4.transpose(0, 2, 1, 3)).reshape(n, t, h * d)


def mask4(mask):
    """The mask with leading axes of 1 up to rank 4 (a view), or None."""
    if mask is None:
        return None
    return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def causal_offset(attrs, tq, tk):
    """None without is_causal, else the offset of the kept pairs j <= i + offset."""
    if not attrs["is_causal"]:
        return None
    return 0 if attrs["causal_variant"] == "upper_left" else tk - tq


def scale_of(attrs, d):
    """The scores' scale: the attribute, or 1 / sqrt(d)."""
    return attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(d)


def dropout_of(op, step):
    """(p, seed64) of the dropout a step with this step counter value draws, or None."""
    a = op.attrs
    if a["is_infer"] or a["dropout_p"] == 0.0:
        return None
    return a["dropout_p"], seed_of(a["seed"], step)


# ---- the numpy engine -------------------------------------------------------------------

def _row_blocks(nh, tq, tk):
    rows = max(1, BLOCK_SCORES // max(1, nh * tk))
    return [(r, min(tq, r + rows)) for r in range(0, tq, rows)]


def _scores(q4, k4, m4, offset, scale, r0, r1):
    """The scores of query rows r0..r1 against every key, float64 (N, H, rows, Tk): scaled,
    the mask added (float) or applied (bool, -inf where False), the causal rule."""
    s = np.matmul(q4[:, :, r0:r1].astype(np.float64), np.swapaxes(k4, -1, -2).astype(np.float64))
    s *= scale
    if m4 is not None:
        blk = m4[:, :, r0:r1] if m4.shape[2] != 1 else m4
        if blk.dtype == np.bool_:
            s = np.where(blk, s, -np.inf)
        else:
            s += blk
    if offset is not None:
        i = np.arange(r0, r1)[:, None]
        j = np.arange(k4.shape[2])[None, :]
        s = np.where(j <= i + offset, s, -np.inf)
    return s


def _keep_factor(shape4, dropout, r0, r1):
    """Z of rows r0..r1 (N, H, rows, Tk): 1 / (1 - p) where kept, 0 where dropped."""
    p, seed64 = dropout
    n, h, tq, tk = shape4
    z = np.empty((n * h, r1 - r0, tk))
    for nh in range(n * h):
        words = philox_words((r1 - r0) * tk, STREAM, seed64, start=(nh * tq + r0) * tk)
        z[nh] = (uniforms24(words) >= p).reshape(r1 - r0, tk)
    return (z * (1.0 / (1.0 - p))).reshape(n, h, r1 - r0, tk)


def forward_numpy(q4, k4, v4, m4, offset, scale, dropout):
    """(out (N, H, Tq, dv), lse (N, H, Tq)) in float64."""
    n, h, tq, _ = q4.shape
    tk = k4.shape[2]
    out = np.zeros((n, h, tq, v4.shape[3]))
    lse = np.empty((n, h, tq))
    v64 = v4.astype(np.float64)
    for r0, r1 in _row_blocks(n * h, tq, tk):
        s = _scores(q4, k4, m4, offset, scale, r0, r1)
        m = s.max(axis=-1, keepdims=True) if tk else np.full(s.shape[:-1] + (1,), -np.inf)
        empty = np.isneginf(m)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - np.where(empty, 0.0, m))
        total = p.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            lse[:, :, r0:r1] = np.where(empty, -np.inf, m + np.log(total))[..., 0]
        p /= np.where(empty, 1.0, total)
        if dropout is not None:
            p *= _keep_factor((n, h, tq, tk), dropout, r0, r1)
        out[:, :, r0:r1] = np.matmul(p, v64)
    return out, lse


def backward_numpy(q4, k4, v4, m4, o4, lse, do4, offset, scale, dropout, wants):
    """{dq, dk, dv, dmask4 (the full-shape gradient of the scores' mask, summed to m4's
    shape)} in float64 for the names in `wants`."""
    n, h, tq, _ = q4.shape
    tk = k4.shape[2]
    k64, v64 = k4.astype(np.float64), v4.astype(np.float64)
    do64 = do4.astype(np.float64)
    big_d = np.einsum("nhtc,nhtc->nht", do64, o4.astype(np.float64))
    dq = np.zeros(q4.shape)
    dk, dv = np.zeros(k4.shape), np.zeros(v4.shape)
    dmask = np.zeros(m4.shape) if "dmask" in wants else None
    for r0, r1 in _row_blocks(n * h, tq, tk):
        s = _scores(q4, k4, m4, offset, scale, r0, r1)
        rows_lse = lse[:, :, r0:r1, None].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.where(np.isneginf(rows_lse), 0.0, np.exp(s - rows_lse))
        p = np.where(np.isneginf(s), 0.0, p)
        z = _keep_factor((n, h, tq, tk), dropout, r0, r1) if dropout is not None else None
        pd = p * z if z is not None else p
        dv += np.matmul(np.swapaxes(pd, -1, -2), do64[:, :, r0:r1])
        dp = np.matmul(do64[:, :, r0:r1], np.swapaxes(v64, -1, -2))
        if z is not None:
            dp *= z
        ds = p * (dp - big_d[:, :, r0:r1, None])
        if dmask is not None:
            g = ds.sum(axis=tuple(a for a in (0, 1, 3) if m4.shape[a] == 1), keepdims=True)
            if m4.shape[2] == 1:
                dmask += g.sum(axis=2, keepdims=True)
            else:
                dmask[:, :, r0:r1] += g
        dq[:, :, r0:r1] = np.matmul(ds, k64) * scale
        dk += np.matmul(np.swapaxes(ds, -1, -2), q4[:, :, r0:r1].astype(np.float64)) * scale
    return {"dq": dq, "dk": dk, "dv": dv, "dmask": dmask}


# ---- the op kernels --------------------------------------------------------------------

def attention_cpu(op, ins, ctx):
    """out and lse of the attention (the native kernel, else the numpy engine); in
    training with dropout, dropout_step = step, then step += 1 in place."""
    a = op.attrs
    heads = a["packed_heads"]
    q, k, v, mask, step = ins["q"], ins["k"], ins["v"], ins["attn_mask"], ins["step"]
    dropout = dropout_of(op, step) if step is not None else None
    if heads and mask is None and dropout is None:      # the packed arrays, as they are
        offset = causal_offset(a, q.shape[1], k.shape[1])
        done = attention_native.forward_packed(q, k, v, heads, offset,
                                               scale_of(a, q.shape[2] // heads),
                                               op.wants("lse"))
    else:
        done = None
    if done is None:
        q4, k4, v4, m4 = heads_view(q, heads), heads_view(k, heads), heads_view(v, heads), \
            mask4(mask)
        offset = causal_offset(a, q4.shape[2], k4.shape[2])
        scale = scale_of(a, q4.shape[3])
        done = attention_native.forward(q4, k4, v4, m4, offset, scale, dropout, heads,
                                        op.wants("lse"))
    if done is None:
        o4, lse = forward_numpy(q4, k4, v4, m4, offset, scale, dropout)
        out, lse = packed_out(o4.astype(q.dtype), heads), lse.astype(q.dtype)
    else:
        out, lse = done
    result = {"out": out}
    if op.wants("lse"):
        result["lse"] = lse
    if op.wants("dropout_step"):
        result["dropout_step"] = np.array(int(step) if dropout is not None else NO_STEP,
                                          np.int64)
    if dropout is not None:
        step[...] = step + 1
    if step is not None:
        result["step_out"] = step
    return result


def bind_attention(op):
    """attention_cpu's bound form (minigraph.bound_run) for a pass without mask or
    dropout on the packed layout (a generated token's, over a KV cache's slabs) into the
    same out and lse arrays every run, its arguments packed again only when q is another
    array or k and v another layout (the step counter passed on untouched, as the
    kernel does without dropout); None where the kernel takes another path."""
    a = op.attrs
    heads = a["packed_heads"]
    if not heads:
        return None
    variant = a["causal_variant"] if a["is_causal"] else None
    kept = {"key": None, "q": None, "call": None, "no_step": np.array(NO_STEP, np.int64)}

    def run(ins):
        q, k, v = ins["q"], ins["k"], ins["v"]
        if ins["attn_mask"] is not None or (ins["step"] is not None
                                            and dropout_of(op, ins["step"]) is not None):
            return None
        done = kept["call"](k, v) if q is kept["q"] and kept["call"] is not None else None
        if done is None:
            if (q.shape, q.dtype) != kept["key"]:
                n, tq, _ = q.shape
                lse = prepared.aligned_empty((n, heads, tq), q.dtype) if op.wants("lse") \
                    else None
                kept.update(key=(q.shape, q.dtype),
                            out=prepared.aligned_empty(q.shape, q.dtype), lse=lse)
            kept["q"], kept["call"] = q, attention_native.prepared_packed(
                q, k, v, heads, variant, scale_of(a, q.shape[2] // heads), kept["out"],
                kept["lse"])
            done = None if kept["call"] is None else kept["call"](k, v)
            if done is None:
                return None
        result = {"out": done[0], "lse": done[1]} if op.wants("lse") else {"out": done[0]}
        if op.wants("dropout_step"):
            result["dropout_step"] = kept["no_step"]
        if ins["step"] is not None:                 # in place, untouched without dropout
            result["step_out"] = ins["step"]
        return result
    return run


def attention_grad_cpu(op, ins, ctx):
    """dq, dk, dv (and a float mask's gradient) from the saved lse, the probabilities
    recomputed block by block; the dropout mask drawn again from dropout_step."""
    a = op.attrs
    heads = a["packed_heads"]
    q, k, v, mask = ins["q"], ins["k"], ins["v"], ins["attn_mask"]
    q4, k4, v4, m4 = heads_view(q, heads), heads_view(k, heads), heads_view(v, heads), \
        mask4(mask)
    o4, do4 = heads_view(ins["out"], heads), heads_view(ins["dout"], heads)
    offset = causal_offset(a, q4.shape[2], k4.shape[2])
    scale = scale_of(a, q4.shape[3])
    step = ins["dropout_step"]
    dropout = dropout_of(op, step) if step is not None else None
    wants = {s for s, slot in (("dq", "dq"), ("dk", "dk"), ("dv", "dv"), ("dmask", "dattn_mask"))
             if op.wants(slot)}
    if not wants:
        return {}
    done = attention_native.backward(q4, k4, v4, m4, o4, ins["lse"], do4, offset, scale,
                                     dropout, heads, wants)
    if done is None:
        done = backward_numpy(q4, k4, v4, m4, o4, ins["lse"], do4, offset, scale, dropout,
                              wants)
        done = {s: packed_out(g.astype(q.dtype), heads) if s != "dmask" else g
                for s, g in done.items() if g is not None}
    result = {s: done[s] for s in ("dq", "dk", "dv") if s in wants}
    if "dmask" in wants:
        result["dattn_mask"] = done["dmask"].reshape(mask.shape).astype(mask.dtype)
    return result
