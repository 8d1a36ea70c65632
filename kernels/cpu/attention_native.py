"""Launcher of the native CPU attention (attention_native.c, built by native.py): the
forward with its online softmax and the FlashAttention-2 backward, float32 and
float64, on (N, H, T, d) views of any strides whose last axis is contiguous (the op's
packed layout is such a view), the mask broadcast by strides of 0.

`forward` and `backward` return None where the native kernel does not apply: it is
off or not built (native.reason says why), the dtype is not float32/float64, or a
size is 0. The caller then runs kernels/cpu/attention.py's numpy engine, the
reference these are tested against. `forward_packed` is forward for the packed layout
without a mask or dropout, from the (N, T, H*d) arrays themselves (a generated
token's pass, where building the views cost more than the kernel); None where it
does not apply, and the caller runs forward. Threads: `blocks.get_num_threads()`,
fewer when there are fewer units of work (a head and a block of rows or keys).
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from minigraph.kernels.cpu import blocks, native

STREAM = 3                  # kernels/cpu/attention.py's
# scores a thread must have to be worth waking: the pool's workers watch for work between
# a pass's ops, and a generated token's row over a KV cache reads the cache's rows from
# memory, which two cores do faster (the GPT's cached token, 2^8 against 2^14: 0.94-0.97x
# at 16-260 cached positions, alternating in one process)
MIN_THREAD_SCORES = 1 << 8

_TYPES = (np.dtype(np.float32), np.dtype(np.float64))
_F64 = _TYPES[1]
_NO_GRAD_STRIDES = (0,) * 12  # dout, dq, dk, dv: the forward has none
_P = ctypes.c_void_p
_kernels = {}


def _load(symbol):
    """The typed C function `symbol` (attention_forward_packed or _backward_packed: their
    arguments in an int64 and a float64 array), or None where it cannot be built."""
    if symbol not in _kernels:
        _kernels[symbol] = native.typed_function("attention_native", symbol, [_P, _P])
    return _kernels[symbol]


def _ptr(a):
    """The address of `a`'s first value (0 for None)."""
    if a is None:
        return 0
    if a.flags.c_contiguous and a.size:
        try:
            return _address(_char(a))
        except TypeError:                   # read-only
            pass
    return a.ctypes.data


_char, _address = ctypes.c_char.from_buffer, ctypes.addressof


def _seed_arg(seed64):
    """A 64-bit seed as the int64 the kernel reads (past 2**63 it wraps)."""
    seed = int(seed64) & 0xFFFFFFFFFFFFFFFF
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _call(symbol, ints, reals):
    """Call `symbol` with its packed arguments (ints: each within int64; the kernel
    reads them where the bytes lie)."""
    return _load(symbol)(struct.pack(f"{len(ints)}q", *ints),
                         struct.pack(f"{len(reals)}d", *reals))


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return native.enabled() and _load("attention_forward_packed") is not None


def _rows(a):
    """`a` (4-D) with a contiguous last axis and strides in whole items (a copy if not)."""
    item = a.dtype.itemsize
    s0, s1, s2, s3 = a.strides
    if a.shape[3] > 1 and s3 != item or s0 % item or s1 % item or s2 % item or s3 % item:
        a = np.ascontiguousarray(a)
    return a


def _strides(a):
    item = a.dtype.itemsize
    s0, s1, s2 = a.strides[:3]
    return [s0 // item, s1 // item, s2 // item]


def _mask_args(m4, shape4, dtype):
    """(array, kind, strides) of the mask for the kernel (kind 0: none, 1: bool, 2: float)."""
    if m4 is None:
        return None, 0, [0, 0, 0, 0]
    kind = 1 if m4.dtype == np.bool_ else 2
    if kind == 2 and m4.dtype != dtype:
        return None, -1, None
    full = np.broadcast_to(m4, shape4)
    item = full.dtype.itemsize
    if any(s % item for s in full.strides):
        full = np.broadcast_to(np.ascontiguousarray(m4), shape4)
    return full, kind, [s // item for s in full.strides]


def _threads(units, scores):
    return max(1, min(blocks.get_num_threads(), units, scores // MIN_THREAD_SCORES or 1))


def _empty_like_layout(shape4, dtype, heads):
    """A new array in the op's layout for logical (N, H, T, d), and its (N, H, T, d) view."""
    n, h, t, d = shape4
    if heads:
        a = np.empty((n, t, h * d), dtype)
        return a, a.reshape(n, t, h, d).transpose(0, 2, 1, 3)
    a = np.empty(shape4, dtype)
    return a, a


def _applies(q4, k4, v4):
    return (native.enabled() and q4.dtype in _TYPES and k4.dtype == q4.dtype
            and v4.dtype == q4.dtype and min(q4.shape) > 0 and k4.shape[2] > 0
            and v4.shape[3] > 0)


def forward(q4, k4, v4, m4, offset, scale, dropout, heads, want_lse=True):
    """(out in the op's layout, lse (N, H, Tq) or None) of the attention of the (N, H, T, d)
    views q4, k4, v4 with mask m4 (rank 4, broadcastable, or None), causal `offset`
    (None: not causal), `scale` and `dropout` ((p, seed64) or None); `heads` the op's
    packed_heads. None where the native kernel does not apply."""
    if not _applies(q4, k4, v4) or _load("attention_forward_packed") is None:
        return None
    n, h, tq, d = q4.shape
    tk, dv = k4.shape[2], v4.shape[3]
    dtype = q4.dtype
    mask, kind, mstrides = _mask_args(m4, (n, h, tq, tk), dtype)
    if kind < 0:
        return None
    q4, k4, v4 = _rows(q4), _rows(k4), _rows(v4)
    if heads:                                   # out (N, Tq, H*dv): its view's strides
        out = np.empty((n, tq, h * dv), dtype)
        o_strides = [tq * h * dv, dv, h * dv]
    else:
        out = np.empty((n, h, tq, dv), dtype)
        o_strides = [h * tq * dv, tq * dv, dv]
    lse = np.empty((n, h, tq), dtype) if want_lse else None
    _run_forward(dtype, (_ptr(q4), _ptr(k4), _ptr(v4), _ptr(mask)), kind, (n, h, tq, tk, d, dv),
                 [*_strides(q4), *_strides(k4), *_strides(v4), *o_strides], mstrides, offset,
                 scale, dropout, out, lse)
    return out, lse


def _forward_ints(dtype, pointers, kind, dims, strides, mstrides, offset, seed64, out, lse,
                  threads):
    """attention_forward_packed's int64 arguments (their positions: _AT_*)."""
    return [int(dtype == _F64), *pointers, kind, _ptr(out), _ptr(lse), int(offset is not None),
            int(offset or 0), _seed_arg(seed64), STREAM, threads, *dims, *strides,
            *_NO_GRAD_STRIDES, *mstrides]


_AT_K, _AT_V, _AT_OFFSET, _AT_THREADS, _AT_TK = 2, 3, 9, 12, 16


def _run_forward(dtype, pointers, kind, dims, strides, mstrides, offset, scale, dropout,
                 out, lse):
    """attention_forward_packed on the addresses `pointers` (q, k, v, the mask or 0) with
    the mask's `kind`, dims (n, h, tq, tk, d, dv), the batch, head and row strides (in
    items) of q, k, v and out, the mask's four, into `out` and `lse` (or None)."""
    n, h, tq, tk = dims[:4]
    p, seed64 = dropout if dropout is not None else (0.0, 0)
    threads = _threads(n * h * -(-tq // 64), n * h * tq * tk)
    if _call("attention_forward_packed", _forward_ints(dtype, pointers, kind, dims, strides,
                                                       mstrides, offset, seed64, out, lse,
                                                       threads), [scale, p]):
        raise MemoryError("scaled_dot_product_attention: the native kernel's scratch memory "
                          "could not be allocated")


def _packed_layout(q, k, v, heads):
    """(dims, strides) of forward_packed's arrays, or None where it does not apply."""
    n, tq, width = q.shape
    tk = k.shape[1]
    dtype = q.dtype
    item = dtype.itemsize
    if not (native.enabled() and dtype in _TYPES and k.dtype == dtype and v.dtype == dtype
            and n and tq and tk and width and k.shape[2] == width and v.shape[2] == width
            and width % heads == 0 and q.strides[2] == k.strides[2] == v.strides[2] == item):
        return None
    strides = []
    for a in (q, k, v):
        s0, s1 = a.strides[0], a.strides[1]
        if s0 % item or s1 % item:
            return None
        strides += [s0 // item, width // heads, s1 // item]
    if _load("attention_forward_packed") is None:
        return None
    d = width // heads
    return (n, heads, tq, tk, d, d), [*strides, tq * width, d, width]


def forward_packed(q, k, v, heads, offset, scale, want_lse=True):
    """forward's (out, lse or None) for the op's packed layout (N, T, heads * d), no mask
    and no dropout (an inference pass: a generated token's), reading q, k and v where
    they are (a KV cache's slabs): the pointers and strides come from the packed arrays,
    without forward's 4-D views, a fifth of its cost on a token. None where it does not
    apply (then forward)."""
    layout = _packed_layout(q, k, v, heads)
    if layout is None:
        return None
    dims, strides = layout
    n, h, tq = dims[:3]
    out = np.empty(q.shape, q.dtype)
    lse = np.empty((n, h, tq), q.dtype) if want_lse else None
    _run_forward(q.dtype, (_ptr(q), _ptr(k), _ptr(v), 0), 0, dims, strides, (0, 0, 0, 0),
                 offset, scale, None, out, lse)
    return out, lse


def prepared_packed(q, k, v, heads, variant, scale, out, lse):
    """forward_packed's call into `out` and `lse` (None: not wanted), its arguments packed
    once: a function call(k, v) that runs it on q and on k and v of these ones' layout
    (a KV cache's filled rows: the slabs' start, more rows each token) with the causal
    offset of `variant` for their rows (None: not causal; "upper_left", "lower_right":
    attention.causal_offset's); None where forward_packed does not apply, and call(k, v)
    returns None for arrays of another layout. (A bound form's: minigraph.bound_run.)"""
    layout = _packed_layout(q, k, v, heads)
    if layout is None:
        return None
    dims, strides = layout
    n, h, tq = dims[:3]
    values = _forward_ints(q.dtype, (_ptr(q), 0, 0, 0), 0, dims, strides, (0, 0, 0, 0),
                           None if variant is None else 0, 0, out, lse, 1)
    ints = (ctypes.c_int64 * len(values))(*values)
    reals = (ctypes.c_double * 2)(scale, 0.0)
    fn, rows = _load("attention_forward_packed"), (k.strides, v.strides, k.shape[2], v.shape[2])

    def call(k, v):
        if (k.strides, v.strides, k.shape[2], v.shape[2]) != rows or not (
                k.shape[0] == v.shape[0] == n and k.shape[1] and k.shape[1] == v.shape[1]
                and k.dtype == v.dtype == q.dtype):
            return None
        tk = k.shape[1]
        ints[_AT_K], ints[_AT_V], ints[_AT_TK] = _ptr(k), _ptr(v), tk
        ints[_AT_OFFSET] = tk - tq if variant == "lower_right" else 0
        ints[_AT_THREADS] = _threads(n * h * -(-tq // 64), n * h * tq * tk)
        if fn(ints, reals):
            raise MemoryError("scaled_dot_product_attention: the native kernel's scratch "
                              "memory could not be allocated")
        return out, lse
    return call


def backward(q4, k4, v4, m4, o4, lse, do4, offset, scale, dropout, heads, wants):
    """{dq, dk, dv (in the op's layout), dmask (summed to m4's shape)} for the names in
    `wants`, from the forward's o4 and lse and the gradient do4 (views as forward's).
    None where the native kernel does not apply."""
    if not _applies(q4, k4, v4) or _load("attention_backward_packed") is None:
        return None
    if o4.dtype != q4.dtype or do4.dtype != q4.dtype or lse.dtype != q4.dtype:
        return None
    n, h, tq, d = q4.shape
    tk, dv = k4.shape[2], v4.shape[3]
    mask, kind, mstrides = _mask_args(m4, (n, h, tq, tk), q4.dtype)
    if kind < 0:
        return None
    q4, k4, v4, o4, do4 = (_rows(a) for a in (q4, k4, v4, o4, do4))
    lse = np.ascontiguousarray(lse)
    made = {}
    views = {}
    for name, shape in (("dq", (n, h, tq, d)), ("dk", (n, h, tk, d)), ("dv", (n, h, tk, dv))):
        if name in wants:
            made[name], views[name] = _empty_like_layout(shape, q4.dtype, heads)
    ds = np.zeros((n, h, tq, tk), q4.dtype) if "dmask" in wants else None
    zeros = [0, 0, 0]
    grads = [s for name in ("dq", "dk", "dv")
             for s in (_strides(views[name]) if name in views else zeros)]
    p, seed64 = dropout if dropout is not None else (0.0, 0)
    failed = _call("attention_backward_packed", [
        int(q4.dtype == np.float64), _ptr(q4), _ptr(k4), _ptr(v4), _ptr(mask), kind, _ptr(o4),
        _ptr(lse), _ptr(do4), *(_ptr(made[name]) if name in made else 0
                                for name in ("dq", "dk", "dv")),
        _ptr(ds), int(offset is not None), int(offset or 0), _seed_arg(seed64),
        STREAM, _threads(n * h * -(-tk // 64), n * h * tq * tk), n, h, tq, tk, d, dv,
        *_strides(q4), *_strides(k4), *_strides(v4), *_strides(o4), *_strides(do4), *grads,
        *mstrides], [float(scale), float(p)])
    if failed:
        raise MemoryError("scaled_dot_product_attention_grad: the native kernel's scratch "
                          "memory could not be allocated")
    if ds is not None:
        axes = tuple(a for a in range(4) if m4.shape[a] == 1)
        made["dmask"] = ds.sum(axis=axes, keepdims=True, dtype=np.float64)
    return made
