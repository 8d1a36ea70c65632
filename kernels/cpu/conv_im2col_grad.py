"""The gradients of the im2col conv engine (conv_im2col: its layout, chunks and
work arrays).

dx of a stride-1 conv is the conv of the padded dout with the flipped filter;
when dfilter is wanted too and that conv has flat columns, dfilter comes from
the same columns, one more product per chunk (_dx_and_dw). Other dfilters sum
(cols @ dout^T)^T over the chunks (BLAS runs that orientation faster than
dout @ cols^T: few output channels). dx of other strides is filter^T @ dout
per chunk with each tap's columns added back (col2im) straight onto dx, each
tap only where its windows read x, not padding (no padded gradient and no
cropping copy).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import conv_im2col
from minigraph.kernels.cpu.conv_im2col import Geometry, Work


def backward(x, w, d, g, need_dx=True, need_dw=True, room=None):
    """(dx or None, dfilter or None) of out = conv(x, w) for dout `d`; lean work
    arrays, or up to `room` bytes of them (conv_im2col.chunk_size)."""
    og, rows = g.o // g.groups, w[0].size
    wg = w.reshape(g.groups, og, rows)
    dx = None
    gd = _dx_geometry(g) if need_dx else None
    if gd is not None:
        flipped = _flipped(w, g)
        if need_dw and _paired(gd):
            return _dx_and_dw(x, d, g, gd, flipped, room)
        dx = conv_im2col.forward(np.ascontiguousarray(d), flipped, gd, lean=True, room=room)
        need_dx = False
    dwg = np.zeros((g.groups, og, rows), dtype=x.dtype) if need_dw else None
    dw = None if dwg is None else dwg.reshape(w.shape)      # a view: filled below
    if g.pointwise:
        return _pointwise_backward(x, wg, d, g, dwg, need_dx, room), dw
    if not (need_dw or need_dx):
        return dx, dw
    # flat columns add back onto the padded planes; strided ones straight onto dx
    padded_dx = g.flat and not g.same and (g.ph or g.pw)
    shape = (g.n, g.c, g.hp, g.wp) if padded_dx else x.shape
    dxp = np.zeros(shape, dtype=x.dtype) if need_dx else None
    work = Work()

    def chunk(n0, n1):
        m = n1 - n0
        dcol = _dout_columns(d, n0, n1, g, work)
        if need_dw:
            cols = conv_im2col.fill_cols(x[n0:n1], g, work)
            dwg[...] += np.matmul(cols, dcol.swapaxes(-1, -2)).swapaxes(-1, -2)
        if need_dx:              # the column buffer again: dfilter is done with it
            dcols = work.array("cols", x.dtype, (g.groups, rows, m * g.length))
            np.matmul(wg.swapaxes(-1, -2), dcol, out=dcols)
            _col2im(dcols, dxp, n0, n1, g)

    reserved = dxp.nbytes if padded_dx and need_dx else 0
    conv_im2col.run_chunks(chunk, g, x.dtype, lean=True, reserved=reserved, room=room)
    work.free()                          # the crop below needs no work arrays beside it
    if need_dx:
        dx = dxp if not padded_dx else np.ascontiguousarray(
            dxp[:, :, g.ph:g.ph + g.h, g.pw:g.pw + g.w])
    return dx, dw


def _full_padding(g):
    """The padding of dout that turns dx of a stride-1 conv into a conv of dout."""
    return g.dh * (g.kh - 1) - g.ph, g.dw * (g.kw - 1) - g.pw


def _dx_geometry(g):
    """The Geometry of the conv that gives dx of a stride-1 conv (dout padded by
    _full_padding, filter _flipped), or None where dx is not such a conv: other
    strides, padding beyond the filter's reach, and 1x1 unpadded convs
    (_pointwise_backward)."""
    qh, qw = _full_padding(g)
    if g.pointwise or not g.unit_stride or min(qh, qw) < 0:
        return None
    return Geometry(g.n, g.o, g.ho, g.wo, g.c, g.kh, g.kw, g.groups, 1, 1, qh, qw, g.dh, g.dw,
                    g.h, g.w)


def _paired(gd):
    """True when dfilter comes with dx from the columns of dx's conv `gd`: they are
    flat (with strided columns the product's output is not laid out like x)."""
    return gd.flat


def _flipped(w, g):
    """The filter of dx's conv: flipped in both taps, in/out channels swapped per
    group."""
    og, cg = g.o // g.groups, g.c // g.groups
    flipped = w.reshape(g.groups, og, cg, g.kh, g.kw)[:, :, :, ::-1, ::-1]
    return np.ascontiguousarray(flipped.transpose(0, 2, 1, 3, 4)).reshape(
        g.c, og, g.kh, g.kw)


def _dx_and_dw(x, d, g, gd, flipped, room=None):
    """(dx, dfilter) of a stride-1 conv: dx as the conv gd of dout with the flipped
    filter (flat columns), dfilter from the same columns: column row (o, i, j) at
    output q is padded dout at q shifted by tap (i, j), so x laid out like the
    product's output (zeros in the columns that are not outputs) times the columns
    gives dfilter's taps flipped, (cols (O/G kh kw, m L) @ x^T (m L, C/G))^T per chunk
    (BLAS runs that orientation faster than x @ cols^T).
    x goes into the product's buffer once dx's chunk is out of it, and the flipped
    filter and dfilter's sums count against the chunks' lean budget, so the pair
    takes no more memory than dx alone, and the columns are built once, not for dx
    and again for dfilter."""
    cg, og = g.c // g.groups, g.o // g.groups
    wg = flipped.reshape(g.groups, cg, -1)
    dx = np.empty(x.shape, dtype=x.dtype)
    acc = np.zeros((g.groups, og * g.taps, cg), dtype=x.dtype)
    d = np.ascontiguousarray(d)
    work = Work()

    def chunk(n0, n1):
        m = n1 - n0
        cols = conv_im2col.fill_cols(d[n0:n1], gd, work)
        res = work.array("res", x.dtype, (g.groups, cg, m * gd.length))
        np.matmul(wg, cols, out=res)
        planes = res.reshape(g.c, m, g.h, gd.width)
        np.copyto(dx[n0:n1], planes[..., :g.w].transpose(1, 0, 2, 3))
        planes[..., :g.w] = x[n0:n1].transpose(1, 0, 2, 3)
        planes[..., g.w:] = 0
        acc[...] += np.matmul(cols, res.swapaxes(-1, -2))

    conv_im2col.run_chunks(chunk, gd, x.dtype, lean=True, reserved=wg.nbytes + acc.nbytes,
                        room=room)
    work.free()
    taps = acc.reshape(g.groups, og, g.kh, g.kw, cg)[:, :, ::-1, ::-1]
    return dx, np.ascontiguousarray(taps.transpose(0, 1, 4, 2, 3)).reshape(
        g.o, cg, g.kh, g.kw)


def _pointwise_backward(x, wg, d, g, dwg, need_dx, room=None):
    """dx (or None) of a 1x1 stride-1 unpadded conv, adding dfilter to dwg when
    given: products with x and dout themselves, no columns."""
    hw = g.h * g.w
    a = x.reshape(g.n, g.groups, g.c // g.groups, hw)
    dd = d.reshape(g.n, g.groups, g.o // g.groups, hw)
    if dwg is not None:
        step = conv_im2col.chunk_size(g, x.dtype, lean=True, room=room)
        for n0 in range(0, g.n, step):
            n1 = min(g.n, n0 + step)
            dwg += np.matmul(dd[n0:n1], a[n0:n1].swapaxes(-1, -2)).sum(axis=0)
    if not need_dx:
        return None
    dx = np.empty(x.shape, dtype=x.dtype)
    np.matmul(wg.swapaxes(-1, -2), dd, out=dx.reshape(a.shape))
    return dx


def _dout_columns(d, n0, n1, g, work):
    """dout of images [n0, n1) laid out like the product's columns: (G, O/G, m L),
    a work copy with zeros in the flat columns that are not outputs."""
    m = n1 - n0
    buf = work.array("dout", d.dtype, (g.o, m, g.ho, g.width))
    np.copyto(buf[..., :g.wo], d[n0:n1].transpose(1, 0, 2, 3))
    buf[..., g.wo:] = 0
    return buf.reshape(g.groups, g.o // g.groups, m * g.length)


def _col2im(dcols, dxp, n0, n1, g):
    """Add the column gradients (G, C/G kh kw, m L) of images [n0, n1) back onto the
    input's gradient: dxp is (N, C, Hp, Wp), padded, for flat columns, else dx (N, C,
    H, W) itself, each tap adding only its windows' values that fall inside x."""
    m = n1 - n0
    if g.flat and not g.same:
        taps = dcols.reshape(g.c, g.kh, g.kw, m, g.length)
        flat = dxp.reshape(g.n, g.c, g.hp * g.wp)[n0:n1].transpose(1, 0, 2)
        for i in range(g.kh):
            for j in range(g.kw):
                start = i * g.dh * g.wp + j * g.dw
                stop = min(start + g.length, g.hp * g.wp)
                flat[:, :, start:stop] += taps[:, i, j, :, :stop - start]
        return
    taps = dcols.reshape(g.c, g.kh, g.kw, m, g.ho, g.wo)
    target = dxp[n0:n1].transpose(1, 0, 2, 3)
    for i in range(g.kh):
        rows, dst_rows = _inside(i * g.dh - g.ph, g.sh, g.ho, g.h)
        for j in range(g.kw):
            cols, dst_cols = _inside(j * g.dw - g.pw, g.sw, g.wo, g.w)
            target[:, :, dst_rows, dst_cols] += taps[:, i, j, :, rows, cols]


def _inside(offset, stride, outputs, size):
    """(outputs' slice, x's slice): the outputs o whose tap reads x at offset + o
    stride inside [0, size), and those positions of x."""
    first = max(0, -(offset // stride))
    last = min(outputs - 1, (size - 1 - offset) // stride)
    if last < first:
        return slice(0, 0), slice(0, 0)
    start = offset + first * stride
    return slice(first, last + 1), slice(start, start + (last - first) * stride + 1, stride)
