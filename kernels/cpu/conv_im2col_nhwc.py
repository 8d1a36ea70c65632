"""The numpy engine of the channels-last (NHWC) 2-D convolutions: im2col in chunks of
images and one BLAS product per chunk and group, and the gradients. The ops run
float32 convs of one group on the native kernels (conv_native_nhwc) where those are
built; this engine runs the rest (float64, groups), everything where no C compiler
is at hand, and is the reference the native kernels are tested against.

Layout: x (N, H, W, C), filter (O, C/G, kh, kw) (the NCHW filter), out (N, Ho, Wo, O).
The columns of a chunk of m images are one row per output pixel: (G, m Ho Wo, kh kw
C/G), each row the pixel's window with the channels innermost (a strided view of the
padded chunk, copied once). Times the filter as (G, kh kw C/G, O/G) they give each
pixel's output channels side by side: for one group the product is written straight
into the NHWC output, no transposing copy. A 1x1 stride-1 unpadded conv of one group
multiplies x itself. fused_conv2d's bias, residual and relu are applied to each
chunk's output while it is in cache.

Gradients: dfilter = cols^T @ dout per group, summed over the chunks; dx = dout @
filter^T per chunk, whose columns are added back tap by tap onto a padded copy of
the chunk's dx (col2im), then cropped. Chunks and work arrays follow conv_im2col's
budget (conv_im2col.run_chunks, Work: nothing kept between calls).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import conv_im2col
from minigraph.kernels.cpu.conv_im2col import Work, _epilogue


def filter_matrix(w, g):
    """The filter (O, C/G, kh, kw) as (G, kh kw C/G, O/G): the columns' order, C-contiguous."""
    og, cg = g.o // g.groups, g.c // g.groups
    m = w.reshape(g.groups, og, cg, g.kh, g.kw).transpose(0, 3, 4, 2, 1)
    return np.ascontiguousarray(m).reshape(g.groups, g.kh * g.kw * cg, og)


def filter_from_matrix(m, g):
    """filter_matrix's inverse: (G, kh kw C/G, O/G) -> (O, C/G, kh, kw), C-contiguous."""
    og, cg = g.o // g.groups, g.c // g.groups
    f = m.reshape(g.groups, g.kh, g.kw, cg, og).transpose(0, 4, 3, 1, 2)
    return np.ascontiguousarray(f).reshape(g.o, cg, g.kh, g.kw)


def _pixels(g):
    return g.ho * g.wo


def _padded(x, g, work):
    """x (a chunk of images, (m, H, W, C)) with its padding: x itself when there is none,
    else a work array (m, Hp, Wp, C)."""
    if g.ph == 0 and g.pw == 0:
        return x
    m = x.shape[0]
    xp = work.array("xpad", x.dtype, (m, g.hp, g.wp, g.c))
    xp[:, :g.ph] = 0
    xp[:, g.ph + g.h:] = 0
    xp[:, g.ph:g.ph + g.h, :g.pw] = 0
    xp[:, g.ph:g.ph + g.h, g.pw + g.w:] = 0
    xp[:, g.ph:g.ph + g.h, g.pw:g.pw + g.w] = x
    return xp


def _windows(xp, g, writeable=False):
    """The windows of the padded chunk xp (m, Hp, Wp, C) as a strided view (G, m, Ho, Wo,
    kh, kw, C/G): what the columns hold, or where they are added back."""
    s_n, s_h, s_w, s_c = xp.strides
    cg = g.c // g.groups
    return np.lib.stride_tricks.as_strided(
        xp, shape=(g.groups, xp.shape[0], g.ho, g.wo, g.kh, g.kw, cg),
        strides=(cg * s_c, s_n, s_h * g.sh, s_w * g.sw, s_h * g.dh, s_w * g.dw, s_c),
        writeable=writeable)


def fill_cols(x, g, work):
    """The columns of the images x (m, H, W, C), a chunk of the batch, as (G, m Ho Wo,
    kh kw C/G) in a work array."""
    m = x.shape[0]
    cols = work.array("cols", x.dtype, (g.groups, m * _pixels(g), g.kh * g.kw * (g.c // g.groups)))
    view = _windows(_padded(x, g, work), g)
    np.copyto(cols.reshape(view.shape), view)
    return cols


def _pointwise(g):
    return g.pointwise and g.groups == 1


def forward(x, w, g, bias=None, residual=None, relu=False, lean=False, room=None):
    """out (N, Ho, Wo, O) = conv(x, w) (+ bias[o]) (+ residual, of out's shape) (then
    max(., 0)) for x (N, H, W, C), in x's dtype; the additions and the max run on each
    chunk of images while it is in cache. lean, room: conv_im2col.forward's."""
    out = np.empty((g.n, g.ho, g.wo, g.o), dtype=x.dtype)
    wm = filter_matrix(w, g)
    if _pointwise(g):
        np.matmul(x.reshape(-1, g.c), wm[0], out=out.reshape(-1, g.o))
        _epilogue_nhwc(out, bias, residual, relu)
        return out
    og = g.o // g.groups
    work = Work()

    def chunk(n0, n1):
        m = n1 - n0
        cols = fill_cols(x[n0:n1], g, work)
        dst = out[n0:n1]
        if g.groups == 1:
            np.matmul(cols[0], wm[0], out=dst.reshape(m * _pixels(g), g.o))
        else:
            res = work.array("res", x.dtype, (g.groups, m * _pixels(g), og))
            np.matmul(cols, wm, out=res)
            np.copyto(dst.reshape(m * _pixels(g), g.groups, og), res.transpose(1, 0, 2))
        _epilogue_nhwc(dst, bias, None if residual is None else residual[n0:n1], relu)

    conv_im2col.run_chunks(chunk, g, x.dtype, lean, room=room)
    return out


def _epilogue_nhwc(dst, bias, residual, relu):
    """(+ bias along the last axis) (+ residual) (then max(., 0)) in place on dst."""
    if bias is not None:
        dst += bias
    _epilogue(dst, None, residual, relu)


def backward(x, w, d, g, need_dx=True, need_dw=True, room=None):
    """(dx or None, dfilter or None) of out = conv(x, w) for x (N, H, W, C) and dout `d`
    (N, Ho, Wo, O); lean work arrays, or up to `room` bytes of them."""
    wm = filter_matrix(w, g)
    og, cg = g.o // g.groups, g.c // g.groups
    dwm = np.zeros(wm.shape, dtype=x.dtype) if need_dw else None
    dx = np.empty(x.shape, dtype=x.dtype) if need_dx else None
    if _pointwise(g):
        d2, x2 = d.reshape(-1, g.o), x.reshape(-1, g.c)
        if need_dw:
            np.matmul(x2.T, d2, out=dwm[0])
        if need_dx:
            np.matmul(d2, wm[0].T, out=dx.reshape(-1, g.c))
        return dx, None if dwm is None else filter_from_matrix(dwm, g)
    if not (need_dx or need_dw):
        return None, None
    work = Work()

    def chunk(n0, n1):
        m = n1 - n0
        dg = d[n0:n1].reshape(m * _pixels(g), g.groups, og).transpose(1, 0, 2)
        if need_dw:
            cols = fill_cols(x[n0:n1], g, work)
            dwm[...] += np.matmul(cols.transpose(0, 2, 1), dg)
        if need_dx:              # the column buffer again: dfilter is done with it
            dcols = work.array("cols", x.dtype, (g.groups, m * _pixels(g), g.kh * g.kw * cg))
            np.matmul(dg, wm.transpose(0, 2, 1), out=dcols)
            _col2im(dcols, dx[n0:n1], g, work)

    reserved = wm.nbytes + (dwm.nbytes if need_dw else 0)
    conv_im2col.run_chunks(chunk, g, x.dtype, lean=True, reserved=reserved, room=room)
    return dx, None if dwm is None else filter_from_matrix(dwm, g)


def _col2im(dcols, dx, g, work):
    """dx (m, H, W, C) of a chunk = its column gradients dcols (G, m Ho Wo, kh kw C/G)
    added back tap by tap onto a zeroed padded copy, cropped."""
    m = dx.shape[0]
    if g.ph or g.pw:
        dxp = work.array("dxpad", dx.dtype, (m, g.hp, g.wp, g.c))
    else:
        dxp = dx
    dxp[...] = 0
    target = _windows(dxp, g, writeable=True)          # (G, m, Ho, Wo, kh, kw, C/G)
    taps = dcols.reshape(g.groups, m, g.ho, g.wo, g.kh, g.kw, -1)
    for i in range(g.kh):
        for j in range(g.kw):
            target[:, :, :, :, i, j] += taps[:, :, :, :, i, j]
    if dxp is not dx:
        np.copyto(dx, dxp[:, g.ph:g.ph + g.h, g.pw:g.pw + g.w])
