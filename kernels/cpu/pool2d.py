"""CPU kernels of pool2d (ops/pool2d.py): max and average pooling by window taps over a
padded copy (padding -inf for max, not counted by the average), and their gradients,
in either layout: the spatial axes are (2, 3) in NCHW and (1, 2) in NHWC, and every
function takes the layout from the attributes ("NCHW" when they have none). The
max-pooling gradient, 2x2 tiles' forward, float32 NCHW global average pooling and
float32 NCHW average pooling and its gradient run the native kernels of pool_native
where they apply (the forwards also as a bound
form's prepared calls: bind_pool2d); the numpy functions here are their reference.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import pool_native, prepared
from minigraph.kernels.layout import spatial_axes


def layout_of(attrs):
    return attrs.get("data_layout", "NCHW")


def out_hw(x_shape, attrs):
    """(Ho, Wo) of the windows (attributes resolved and checked by the schema)."""
    spatial = spatial_axes(layout_of(attrs))
    return tuple((x_shape[spatial[a]] + 2 * attrs["paddings"][a] - attrs["ksize"][a])
                 // attrs["strides"][a] + 1 for a in (0, 1))


def pad_hw(x, paddings, value=0.0, layout="NCHW"):
    """x padded by paddings=(ph, pw) on both sides of its spatial axes."""
    ph, pw = paddings
    if ph == 0 and pw == 0:
        return x
    widths = [(0, 0)] * 4
    (ah, aw) = spatial_axes(layout)
    widths[ah], widths[aw] = (ph, ph), (pw, pw)
    return np.pad(x, widths, constant_values=value)


def offset_slices(i, j, out_hw, strides, dilations=(1, 1), layout="NCHW"):
    """Index of the padded array holding tap (i, j) of every window: an (N, C, Ho, Wo)
    (or (N, Ho, Wo, C)) strided view."""
    (ho, wo), (sh, sw), (dh, dw) = out_hw, strides, dilations
    index = [slice(None)] * 4
    (ah, aw) = spatial_axes(layout)
    index[ah] = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
    index[aw] = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
    return tuple(index)


def taps(attrs):
    kh, kw = attrs["ksize"]
    return [(i, j) for i in range(kh) for j in range(kw)]


def tiles(x, attrs, hw):
    """True when the windows tile x exactly: no padding, strides = ksize, and
    Ho kh = H, Wo kw = W."""
    (kh, kw), (ho, wo) = attrs["ksize"], hw
    ah, aw = spatial_axes(layout_of(attrs))
    return (attrs["paddings"] == (0, 0) and attrs["strides"] == (kh, kw)
            and x.shape[ah] == ho * kh and x.shape[aw] == wo * kw)


def tiled_max(x, attrs, hw):
    """window_max where the windows tile x: the max over each window's kh rows
    (contiguous rows of W, or of W C values in NHWC), then over the kw neighbours in
    that row (one long strided run), instead of kh kw views with rows of Wo values
    (numpy's loops pay per row: 49 -> 38 us on (64, 16, 8, 8) with 2x2 windows)."""
    (kh, kw), (ho, wo) = attrs["ksize"], hw
    if layout_of(attrs) == "NHWC":
        n, h, w, c = x.shape
        rows = _max_along(x.reshape(n * ho, kh, w * c))
        return _max_along(rows.reshape(-1, kw, c)).reshape(n, ho, wo, c)
    n, c, h, w = x.shape
    return _max_along(_max_along(x.reshape(n * c * ho, kh, w)).reshape(-1, kw)).reshape(
        n, c, ho, wo)


def _max_along(a):
    """The max over axis 1 of a (rows, k[, inner]), as a new array."""
    if a.shape[1] == 1:
        return a[:, 0].copy()
    best = np.maximum(a[:, 0], a[:, 1])
    for i in range(2, a.shape[1]):
        np.maximum(best, a[:, i], out=best)
    return best


def window_max(x, attrs, hw):
    """The max of every window, padding as -inf."""
    layout = layout_of(attrs)
    if tiles(x, attrs, hw):
        if attrs["ksize"] == (2, 2):
            out = pool_native.max_pool_tiles(x, layout)
            if out is not None:
                return out
        return tiled_max(x, attrs, hw)
    xp = pad_hw(x, attrs["paddings"], -np.inf, layout)
    best = None
    for i, j in taps(attrs):
        v = xp[offset_slices(i, j, hw, attrs["strides"], layout=layout)]
        best = v.copy() if best is None else np.maximum(best, v, out=best)
    return best


_SAME_SIZE_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def window_argmax(x, attrs, hw):
    """The tap index (row-major) of the first max of every window, padding as -inf:
    the first tap, replaced by a later one only where it is strictly greater.
    Updates go through bit masks (np.where and masked copies are many times slower)."""
    layout = layout_of(attrs)
    xp = pad_hw(x, attrs["paddings"], -np.inf, layout)
    ints = _SAME_SIZE_INT[x.dtype.itemsize]
    tap_list = taps(attrs)
    index_type = np.int8 if len(tap_list) <= 127 else np.int32
    best = where = None
    for t, (i, j) in enumerate(tap_list):
        v = xp[offset_slices(i, j, hw, attrs["strides"], layout=layout)]
        if best is None:
            best, where = v.copy(), np.zeros(v.shape, dtype=index_type)
            bits, mask, diff = best.view(ints), np.empty(v.shape, ints), np.empty(v.shape, ints)
            wmask, wdiff = np.empty(v.shape, index_type), np.empty(v.shape, index_type)
            continue
        better = np.greater(v, best).view(np.int8)
        np.negative(better, out=mask, casting="unsafe")          # all ones where better
        np.negative(better, out=wmask, casting="unsafe")
        np.bitwise_xor(bits, v.view(ints), out=diff)              # best = v where better
        np.bitwise_and(diff, mask, out=diff)
        np.bitwise_xor(bits, diff, out=bits)
        np.bitwise_xor(where, t, out=wdiff, casting="unsafe")     # where = t where better
        np.bitwise_and(wdiff, wmask, out=wdiff)
        np.bitwise_xor(where, wdiff, out=where)
    return where


def route(dst, d, hit, ints):
    """dst = d where `hit`, else +0.0 (the bits of d ANDed with a mask)."""
    mask = np.negative(hit.view(np.int8), dtype=ints)
    np.bitwise_and(d.view(ints), mask, out=dst.view(ints))


def window_counts(size, k, s, p, out):
    """How many real (unpadded) elements each of `out` windows covers along one axis."""
    start = np.arange(out) * s
    return np.minimum(start + k, p + size) - np.maximum(start, p)


def avg_divisor(x_shape, attrs, hw, dtype):
    """How many real elements each window holds: (Ho, Wo), or (Ho, Wo, 1) in NHWC (so
    that it broadcasts against the output)."""
    spatial = spatial_axes(layout_of(attrs))
    rows, cols = (window_counts(x_shape[spatial[a]], attrs["ksize"][a], attrs["strides"][a],
                                attrs["paddings"][a], hw[a]) for a in (0, 1))
    counts = np.outer(rows, cols).astype(dtype)
    return counts[..., None] if layout_of(attrs) == "NHWC" else counts


def _out_shape(x_shape, layout, hw):
    if layout == "NHWC":
        return (x_shape[0],) + tuple(hw) + (x_shape[3],)
    return tuple(x_shape[:2]) + tuple(hw)


def pool2d_cpu(op, ins, ctx):
    """Max or average of every window (see the module doc)."""
    x, a = ins["x"], op.attrs
    layout = layout_of(a)
    if a["global_pooling"]:
        axes = spatial_axes(layout)
        if a["pool_type"] == "max":
            return {"out": x.max(axis=axes, keepdims=True)}
        out = pool_native.global_avg(x) if layout == "NCHW" else None
        if out is None:
            out = x.mean(axis=axes, keepdims=True, dtype=np.float64).astype(x.dtype)
        return {"out": out}
    hw = out_hw(x.shape, a)
    if a["pool_type"] == "max":
        return {"out": window_max(x, a, hw)}
    out = pool_native.avg_pool(x, a, hw) if layout == "NCHW" else None
    if out is not None:
        return {"out": out}
    xp = pad_hw(x, a["paddings"], layout=layout)
    total = np.zeros(_out_shape(x.shape, layout, hw), dtype=np.float64)
    for i, j in taps(a):
        total += xp[offset_slices(i, j, hw, a["strides"], layout=layout)]
    return {"out": (total / avg_divisor(x.shape, a, hw, np.float64)).astype(x.dtype)}


def bind_pool2d(op):
    """pool2d_cpu's bound form (minigraph.bound_run) where a native kernel runs the op
    (max over 2x2 windows that tile the plane; float32 NCHW average pooling, global or
    not): into the same array every run, prepared again only for another input array.
    None (the kernel runs) for the other poolings."""
    a = op.attrs
    layout = layout_of(a)
    average = a["pool_type"] == "avg" and not a["global_pooling"] and layout == "NCHW"
    if a["global_pooling"]:
        if a["pool_type"] != "avg" or layout != "NCHW":
            return None
    elif not average and (a["pool_type"] != "max" or a["ksize"] != (2, 2)):
        return None
    kept = {"out": None}

    def prepare(x):
        if a["global_pooling"]:
            if not pool_native.global_avg_takes(x):
                return None
            shape = x.shape[:2] + (1, 1)
        elif average:
            takes = pool_native.avg_pool_takes(x)
            shape = x.shape[:2] + tuple(out_hw(x.shape, a)) if takes else None
        elif x.ndim != 4 or not tiles(x, a, out_hw(x.shape, a)):
            return None
        else:
            shape = pool_native.tiles_shape(x, layout)
        if shape is None or 0 in shape:
            return None
        out = prepared.output(kept, shape, x.dtype)
        if a["global_pooling"]:
            return pool_native.prepared_global_avg(x, out), {"out": out}
        if average:
            return pool_native.prepared_avg_pool(x, out, a, shape[2:]), {"out": out}
        return pool_native.prepared_max_tiles(x, out, layout), {"out": out}
    return prepared.form(("x",), prepare, streamed=("x",))


def _global_max_grad(x, d, layout):
    """dx of global max pooling: dout to each plane's first max."""
    if layout == "NHWC":
        n, h, w, c = x.shape
        flat = x.reshape(n, h * w, c)
        dx = np.zeros_like(flat)
        np.put_along_axis(dx, flat.argmax(axis=1)[:, None], d.reshape(n, 1, c), axis=1)
        return dx.reshape(x.shape)
    n, c, h, w = x.shape
    flat = x.reshape(n, c, h * w)
    dx = np.zeros_like(flat)
    np.put_along_axis(dx, flat.argmax(axis=2)[..., None], d.reshape(n, c, 1), axis=2)
    return dx.reshape(x.shape)


def pool2d_grad_cpu(op, ins, ctx):
    """dx: dout routed to each window's first max, or spread evenly over its real elements."""
    x, d, a = ins["x"], ins["dout"], op.attrs
    layout = layout_of(a)
    (ah, aw) = spatial_axes(layout)
    h, w = x.shape[ah], x.shape[aw]
    if a["global_pooling"]:
        if a["pool_type"] == "avg":
            return {"dx": np.broadcast_to(d / (h * w), x.shape).astype(x.dtype)}
        return {"dx": _global_max_grad(x, d, layout)}
    hw = out_hw(x.shape, a)
    dx = (pool_native.max_pool_grad(x, d, a, hw, layout) if a["pool_type"] == "max" else
          pool_native.avg_pool(x, a, hw, dout=d) if layout == "NCHW" else None)
    if dx is not None:
        return {"dx": dx}
    ph, pw = a["paddings"]
    where = window_argmax(x, a, hw) if a["pool_type"] == "max" else None
    padded = list(x.shape)
    padded[ah], padded[aw] = h + 2 * ph, w + 2 * pw
    dxp = np.zeros(padded, dtype=x.dtype)                          # after argmax's work
    if where is not None:
        ints = _SAME_SIZE_INT[x.dtype.itemsize]
        disjoint = all(s >= k for s, k in zip(a["strides"], a["ksize"]))
        part = None if disjoint else np.empty(d.shape, dtype=x.dtype)
        for t, (i, j) in enumerate(taps(a)):
            dst = dxp[offset_slices(i, j, hw, a["strides"], layout=layout)]
            if disjoint:                         # each element is in at most one window
                route(dst, d, np.equal(where, t), ints)
            else:
                route(part, d, np.equal(where, t), ints)
                dst += part
    else:
        share = d / avg_divisor(x.shape, a, hw, x.dtype)
        for i, j in taps(a):
            dxp[offset_slices(i, j, hw, a["strides"], layout=layout)] += share
    crop = [slice(None)] * 4
    crop[ah], crop[aw] = slice(ph, ph + h), slice(pw, pw + w)
    return {"dx": np.ascontiguousarray(dxp[tuple(crop)])}
