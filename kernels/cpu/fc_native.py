"""Launcher of the native fused_fc kernel (fc_native.c, built by native.py):
float32 out = act(x @ w + bias) for x (M, K) and w (K, N), act = relu or the
identity, the bias and relu added to each tile of outputs as it is written.

The kernel reads the weight packed into panels of columns (fc_native.c). A weight
is packed once and the packed copy kept while the weight array lives: fused_fc is
an inference op (its weight is a parameter of an inference net, which no op
writes), so `forward` marks the array it packed read-only, and a write into it is
an error instead of a stale result. A new value (Variable.set, a load) is a new
array and is packed again at its first use. Each packed copy takes the weight's
memory again (rounded up to whole panels).

A weight of at most COLS_MAX columns (a classifier's last product) is packed
transposed instead, for fc_cols.h's kernel: a panel would be mostly zeros. Each
output is still summed by one thread in one order.

Where every value of the weight is finite (checked once, as it is packed), the product
runs fc_sparse.h's entry, which skips x's zeros where rows sampled from x are mostly
zeros (a relu's output) and is the dense kernel otherwise: the same bits either way.
The training products (train_product) skip A's zeros the same way, on each block of the
weight whose values are all finite (checked as it is packed), with fc_train_f32's bits.

`supports(x, w)` says whether the kernel takes a product: float32, built (native.
reason says why not) and at least MIN_WORK multiply-adds (the size from which
OpenBLAS would run it on threads), or at most COLS_MAX columns at any size. Where
it does, the op runs whichever of this kernel and BLAS's product was the faster for
the shape on this machine (kernels/cpu/choices.py); numpy's product otherwise,
which is the reference this is tested against.

`rows_forward` (fc_rows_f32) takes products of at most ROWS_MAX rows on a weight as it
lies, unpacked (a generated token's, on weights an optimizer changes): the weight's
rows in two fixed blocks, one a thread, so each core reads the same half of every
weight token after token (fc_rows.h says why). mul and fused_fc use it for every
float32 product it takes, so that a fused op keeps the unfused ops' bits;
`prepared_rows_group` (fc_rows_group_f32) runs several products of one x in one call
(fused_fc_group's: a layer's q, k and v).
"""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph.kernels.cpu import blocks, native, prepared

MIN_WORK = 1 << 18          # multiply-adds from which OpenBLAS wakes its threads
MIN_THREAD_WORK = 1 << 20   # multiply-adds a thread must have to be worth waking
ROWS_MAX = 4                # rows of x up to which a product on an unpacked weight is
                            # fc_rows_f32's (a generated token's: a row a sequence)
GROUP_MAX = 8               # products of one x fc_rows_group_f32 takes in one call
                            # (fc_rows.h's FC_ROWS_GROUP)
MIN_ROWS_SPLIT = 1 << 13    # multiply-adds from which fc_rows_f32 splits the columns
COLS_MAX = 16               # columns up to which forward runs fc_cols_f32 (fc_cols.h's
                            # FC_COLS_MAX)

_P, _L = ctypes.c_void_p, ctypes.c_int64
_ROWS_THREADS, _GROUP_THREADS = 9, 10   # the threads' places in the *_packed ints
_F32 = np.dtype(np.float32)
_ptr = native.address
_packed = {}                # id(weight array) -> (weakref to it, None, packed copy)
_packed_cols = {}           # the same for fc_cols_f32's transposed copies
_finite = {}                # the same for whether each value of the weight is finite


def _lib():
    lib = native.library("fc_native")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.fc_packed_size.argtypes, lib.fc_packed_size.restype = [_L, _L], _L
        lib.fc_pack_weight_f32.argtypes, lib.fc_pack_weight_f32.restype = [_P, _L, _L, _P], None
        for product in (lib.fc_forward_f32, lib.fc_sparse_f32):
            product.argtypes, product.restype = [_P] * 4 + [_L] * 5, ctypes.c_int
        lib.fc_cols_packed_size.argtypes, lib.fc_cols_packed_size.restype = [_L, _L], _L
        lib.fc_cols_pack_f32.argtypes, lib.fc_cols_pack_f32.restype = [_P, _L, _L, _P], None
        lib.fc_cols_f32.argtypes, lib.fc_cols_f32.restype = [_P] * 4 + [_L] * 5, ctypes.c_int
        for product in (lib.fc_train_f32, lib.fc_train_sparse_f32):
            product.argtypes, product.restype = [_P, _L, _P, _L, _P] + [_L] * 4, ctypes.c_int
        lib.fc_rows_f32.argtypes, lib.fc_rows_f32.restype = [_P] * 5 + [_L] * 5, ctypes.c_int
        lib.fc_rows_group_f32.argtypes = [_P] * 6 + [_L] * 5
        lib.fc_rows_group_f32.restype = ctypes.c_int
        for packed in (lib.fc_rows_f32_packed, lib.fc_rows_group_f32_packed):
            packed.argtypes, packed.restype = [ctypes.POINTER(_L)], ctypes.c_int
        lib._typed = True
    return lib


def supports(x, w):
    """True when forward takes x (M, K) @ w (K, N): both float32, K >= 1, at least
    MIN_WORK multiply-adds or 1 <= N <= COLS_MAX, and the native kernels built."""
    (m, k), n = x.shape, w.shape[1]
    return (x.dtype == _F32 and w.dtype == _F32 and k >= 1
            and (m * k * n >= MIN_WORK or 1 <= n <= COLS_MAX) and _lib() is not None)


def forward(x, w, bias=None, relu=False):
    """out (M, N) float32 = act(x @ w + bias), act = max(., 0) (NaN stays NaN) where
    relu, else the identity; x (M, K) and w (K, N) float32, bias (N,) or None, as
    supports() takes them. Every output is summed by one thread in one order (the
    same result on any number of threads). Marks `w` read-only (see the module doc)."""
    x = np.ascontiguousarray(x)
    m, n = x.shape[0], w.shape[1]
    bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    out = np.empty((m, n), dtype=np.float32)
    if m and n:
        prepared_forward(x, w, bias, relu, out)()
    return out


def prepared_forward(x, w, bias, relu, out):
    """forward's product into `out` ((M, N) float32, C-contiguous) prepared once: a
    function of no arguments that runs it on what x and bias hold then (minigraph.
    bound_run), on the weight packed once (packed_weight: `w` made read-only); x and
    bias C-contiguous float32, as supports() takes them (with at most COLS_MAX columns:
    fc_cols_f32 on the weight packed transposed, packed_columns; else fc_sparse_f32
    where every value of w is finite, finite_weight, fc_forward_f32 where not).
    forward's bits."""
    m, k = x.shape
    n, work = w.shape[1], m * k * w.shape[1]
    if n <= COLS_MAX:
        fn, packed = _lib().fc_cols_f32, packed_columns(w)
    else:
        packed = packed_weight(w)
        fn = _lib().fc_sparse_f32 if finite_weight(w) else _lib().fc_forward_f32
    args = (_ptr(x), _ptr(packed), _ptr(bias), _ptr(out), m, k, n, int(bool(relu)))

    def call():
        if fn(*args, max(1, min(blocks.get_num_threads(), work // MIN_THREAD_WORK))):
            raise MemoryError("fc_native.forward: the packed copy of x could not be "
                              "allocated")
    call.keep = packed
    return call


def rows_supports(x, w, bias=None):
    """True when rows_forward takes x (M, K) @ w (K, N) (+ bias): float32 and
    C-contiguous, 1 <= M <= ROWS_MAX, K and N >= 1, bias None or N values, and the
    native kernels built."""
    return (x.ndim == 2 and w.ndim == 2 and 1 <= x.shape[0] <= ROWS_MAX
            and x.shape[1] == w.shape[0] >= 1 and w.shape[1] >= 1
            and x.dtype == _F32 and w.dtype == _F32
            and x.flags.c_contiguous and w.flags.c_contiguous
            and (bias is None or (bias.dtype == _F32 and bias.shape == (w.shape[1],)
                                  and bias.flags.c_contiguous))
            and native.enabled() and _lib() is not None)


def residual_fits(residual):
    """True when prepared_rows takes `residual` (the product's size, however shaped):
    None, or a C-contiguous float32 array."""
    return residual is None or (residual.dtype == _F32 and residual.flags.c_contiguous)


def prepared_rows(x, w, bias, relu, out, residual=None):
    """The product act(x @ w + bias + residual) of rows_supports' arrays into `out` (M,
    N float32, C-contiguous) by fc_rows_f32, prepared once: a function of no arguments
    that runs it on what the arrays hold then (minigraph.bound_run). residual: None, or
    M * N values as residual_fits takes them (not overlapping out). Each output is the sum
    over K in order, then the bias, then the residual, then relu: the bits of the
    product alone (rows_forward) followed by the bias add and the residual add, on any
    number of threads."""
    m, k = x.shape
    n = w.shape[1]
    fn, split = _lib().fc_rows_f32_packed, m * k * n >= MIN_ROWS_SPLIT
    ints = native.packed_ints((_ptr(x), _ptr(w), _ptr(bias), _ptr(residual), _ptr(out), m,
                               k, n, int(bool(relu)), 1))

    def call():
        ints[_ROWS_THREADS] = blocks.get_num_threads() if split else 1
        if fn(ints):
            raise MemoryError("fc_native: the few-rows product's sums could not be allocated")
    return call


def prepared_rows_group(x, ws, biases, outs):
    """The products x @ ws[g] + biases[g] (a bias None or (N_g,)) into outs[g] (M, N_g
    float32, C-contiguous) for g < GROUP_MAX, x and each (weight, bias) as
    rows_supports takes them, by fc_rows_group_f32 in one hand-out to the threads (a
    layer's q, k and v products), prepared once as prepared_rows is: each output has
    the bits of prepared_rows' product with its bias."""
    m, k = x.shape
    ns = [w.shape[1] for w in ws]
    count = len(ws)
    if not 1 <= count <= GROUP_MAX:
        raise ValueError(f"fc_native.prepared_rows_group: 1 to {GROUP_MAX} products, got "
                         f"{count}")
    arrays = [native.packed_ints([_ptr(a) for a in group]) for group in (ws, biases, outs)]
    arrays.append(native.packed_ints(ns))
    fn, split = _lib().fc_rows_group_f32_packed, m * k * sum(ns) >= MIN_ROWS_SPLIT
    ws_at, biases_at, outs_at, ns_at = map(ctypes.addressof, arrays)
    ints = native.packed_ints((_ptr(x), ws_at, biases_at, None, outs_at, ns_at, count, m, k,
                               0, 1))

    def call():
        ints[_GROUP_THREADS] = blocks.get_num_threads() if split else 1
        if fn(ints):
            raise MemoryError("fc_native: the few-rows products' sums could not be allocated")
    call.arrays = arrays                # the arrays ints points into live as long as call
    return call


def rows_forward(x, w, bias=None, relu=False, residual=None):
    """act(x @ w + bias + residual) as a new (M, N) float32 array, for x, w and bias as
    rows_supports takes them and residual as residual_fits does (prepared_rows'
    product, run once)."""
    out = np.empty((x.shape[0], w.shape[1]), np.float32)
    prepared_rows(x, w, bias, relu, out, residual)()
    return out


def packed_weight(w):
    """w (K, N) float32 in fc_native.c's panels: packed on first use and kept until `w`
    is freed; `w` is made read-only, so what was packed stays what it holds
    (prepared.kept)."""
    return _kept_copy(_packed, w, _lib().fc_packed_size, _lib().fc_pack_weight_f32)


def finite_weight(w):
    """True when every value of w is finite (no inf or NaN), so that the sums may skip
    x's zeros (fc_sparse.h): found at w's first use and kept as packed_weight keeps its
    panels."""
    return prepared.kept(_finite, w, None, lambda: bool(np.isfinite(w).all()))


def packed_columns(w):
    """w (K, N <= COLS_MAX) float32 transposed for fc_cols.h (each column's values side
    by side), kept as packed_weight keeps its panels."""
    return _kept_copy(_packed_cols, w, _lib().fc_cols_packed_size, _lib().fc_cols_pack_f32)


def train_supports(x, w, x_transposed=False, w_transposed=False):
    """True when train_product takes x and w so transposed: float32 2-D C-contiguous
    arrays whose product chains and has at least MIN_WORK multiply-adds, and the
    native kernels built."""
    if not (x.ndim == 2 and w.ndim == 2 and x.dtype == _F32 and w.dtype == _F32
            and x.flags.c_contiguous and w.flags.c_contiguous):
        return False
    m, k = x.shape[::-1] if x_transposed else x.shape
    k2, n = w.shape[::-1] if w_transposed else w.shape
    return k == k2 and min(m, k, n) >= 1 and m * k * n >= MIN_WORK and _lib() is not None


def train_product(x, w, x_transposed=False, w_transposed=False):
    """A @ B as a new (M, N) float32 array by fc_train_f32 (fc_train.h), with A = x (M,
    K) or x.T for x (K, M) where x_transposed, and B = w (K, N) or w.T for w (N, K)
    where w_transposed (a layer's forward, input-gradient and weight-gradient
    products on a weight that changes every step: packed block by block as it is
    used, never whole); x and w as train_supports takes them. Where rows sampled from
    A are mostly zeros (a relu's output), fc_train_sparse_f32 (fc_sparse.h) skips A's
    zeros, with fc_train_f32's bits. Each output is summed by one thread in one order:
    the same bits on any number of threads."""
    m, k = x.shape[::-1] if x_transposed else x.shape
    n = w.shape[0] if w_transposed else w.shape[1]
    out = np.empty((m, n), np.float32)
    threads = max(1, min(blocks.get_num_threads(), m * k * n // MIN_THREAD_WORK))
    if _lib().fc_train_sparse_f32(_ptr(x), int(x_transposed), _ptr(w), int(w_transposed),
                                  _ptr(out), m, k, n, threads) == 1:
        raise MemoryError("fc_native.train_product: the packed copies could not be "
                          "allocated")
    return out


def _kept_copy(table, w, size, pack_into):
    """pack_into(w, K, N, copy)'s copy of size(K, N) floats, made at w's first use and
    kept in `table` (prepared.kept)."""
    def pack():
        k, n = w.shape
        packed = prepared.aligned_empty(size(k, n), np.float32)
        pack_into(_ptr(np.ascontiguousarray(w)), k, n, _ptr(packed))
        return packed
    return prepared.kept(table, w, None, pack)

