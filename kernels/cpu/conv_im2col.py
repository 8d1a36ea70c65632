"""The numpy engine of the 2-D convolutions (conv2d, fused_conv2d): im2col in
chunks of images and one BLAS matrix product per chunk; its gradients are in
conv_im2col_grad. The ops run float32 convs of one group on the native kernels
(conv_native) where those are built; this engine runs the rest (float64,
groups), everything where no C compiler is at hand, and is the reference the
native kernels are tested against.

Layout: x (N, C, H, W), filter (O, C/G, kh, kw), out (N, O, Ho, Wo), all NCHW.
A chunk of m images is one product per group: filter[g] (O/G, C/G kh kw) @
cols[g] (C/G kh kw, m L), the columns of the chunk's images side by side, so
BLAS sees one wide matrix rather than m narrow ones; the result (O, m, L)
goes to the NCHW output by one transposing copy, while the chunk is in cache:
fused_conv2d's bias (and relu, without a residual) on the result's long rows
before the copy, its residual (then relu) on the output after it.

Stride 1 (any padding or dilation) with at least as many column rows
(C/G kh kw) as output channels per group uses "flat" columns: each padded input
plane is one row of Hp Wp values and tap (i, j) of every window is the same
row shifted by i dh Wp + j dw, so a column row is one contiguous run of
L = Ho Wp values; the products then also cover Wp - Wo columns per output row
that are not outputs (dropped, and zero in the gradient). Other convs copy
a (C, kh, kw, m, Ho, Wo) strided view: for a first layer on 1-3 channels
cropping the flat product's rows costs more than the strided copy. A 1x1
stride-1 unpadded conv multiplies x itself, image by image, straight into the
output.

Flat convs with "same" padding (Ho = H, Wo = W: 3x3 with padding 1) take their
flat columns from the unpadded planes instead: a column row is a run of H W
values shifted by oi W + oj (oi = i dh - ph, oj = j dw - pw), the windows'
values that fall in the padding are set to zero after the copy (a few rows and
columns of each tap), and the product has exactly the outputs, no columns to
drop. The chunk's planes are copied one after the other with a gap of `margin`
values after each: the runs read across planes only where they are then set
to zero, and planes of a power-of-two size placed back to back make the column
copy several times slower (cache-set conflicts).

Chunks of images keep the columns (about CHUNK_BYTES, LEAN_CHUNK_BYTES for
lean calls) in cache between the copy and the product, and each chunk is
padded on its own (a chunk-sized padded copy, not the batch's). The column,
padding and product (or dout) buffers are work arrays of one call (`Work`),
made for its first chunk and reused by the others, and freed when the call
returns: nothing is kept between calls, so a training step's peak memory
holds only the running conv's buffers (with minigraph.host_memory's settings
the allocator hands the same blocks back, without page faults). The chunk
sizes are the fastest of those the benchmarks tried (docs/performance.md). The
gradients' chunks, and those of conv2d's forward pass (the op a training
step runs; fused_conv2d, for inference, takes full chunks), are also "lean":
all their work arrays together take no more than INPUT_MULTIPLE times x's
size (or LEAN_FLOOR_BYTES, for tiny inputs), since a training step's peak
comes late in the forward pass and as the backward pass starts, in the last
layers, while every saved activation is alive, and there the planes are
small. Away from the peak a training step gives conv2d and its gradient more
(KernelContext.room, minigraph.work_room): their work arrays then take up to
that many bytes, in full chunks.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from minigraph.kernels.cpu import blocks

CHUNK_BYTES, LEAN_CHUNK_BYTES = 1 << 22, 1 << 21
INPUT_MULTIPLE, LEAN_FLOOR_BYTES = 1.5, 1 << 19


class Geometry(NamedTuple):
    """Sizes of one convolution (see the module doc for the names)."""

    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    groups: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    ho: int
    wo: int

    @property
    def hp(self):
        return self.h + 2 * self.ph

    @property
    def wp(self):
        return self.w + 2 * self.pw

    @property
    def unit_stride(self):
        return self.sh == 1 and self.sw == 1

    @property
    def flat(self):
        """True when the columns are shifted runs of the padded planes: stride 1 and
        at least as many column rows (C/G kh kw) as output channels per group. The
        flat product's output rows must be cropped (Wp to Wo) on the way out; with
        fewer column rows than outputs (a first layer on 1-3 channels) that crop
        costs more than the strided copy of the columns."""
        return self.unit_stride and (self.c * self.taps >= self.o)

    @property
    def same(self):
        """True for flat columns taken from the unpadded planes: flat, and the output
        as large as the input ("same" padding)."""
        return self.flat and self.ho == self.h and self.wo == self.w

    @property
    def width(self):
        """Columns per output row: Wp for padded flat columns (whole padded rows), else Wo."""
        return self.wp if self.flat and not self.same else self.wo

    @property
    def length(self):
        """Columns per image: Ho times `width`."""
        return self.ho * self.width

    @property
    def margin(self):
        """Same-padded columns: the farthest a tap's run reaches outside its plane."""
        return self.ph * self.w + self.pw if self.same else 0

    @property
    def slack(self):
        """Zeros after the last padded plane, so the last image's flat columns of the
        last taps stay inside the buffer."""
        return (self.kw - 1) * self.dw if self.flat and not self.same else 0

    @property
    def taps(self):
        return self.kh * self.kw

    @property
    def pointwise(self):
        """A 1x1 stride-1 conv without padding: the columns are x itself."""
        return self.taps == 1 and self.unit_stride and self.ph == 0 and self.pw == 0


def geometry(x_shape, w_shape, strides, paddings, dilations, groups):
    """The Geometry of x (N, C, H, W) and filter (O, C/G, kh, kw); the caller has
    checked the shapes (conv2d's schema)."""
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    (sh, sw), (ph, pw), (dh, dw) = strides, paddings, dilations
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return Geometry(n, c, h, w, o, kh, kw, groups, sh, sw, ph, pw, dh, dw, ho, wo)


def forward(x, w, g, bias=None, residual=None, relu=False, lean=False, room=None):
    """out (N, O, Ho, Wo) = conv(x, w) (+ bias[o]) (+ residual, of out's shape) (then
    max(., 0)), in x's dtype; the additions and the max run on each chunk of images
    while it is in cache. lean: work arrays capped as the backward pass's are, or
    by `room` bytes where that is more (chunk_size)."""
    out = np.empty((g.n, g.o, g.ho, g.wo), dtype=x.dtype)
    wg = w.reshape(g.groups, g.o // g.groups, -1)
    if g.pointwise:
        a = x.reshape(g.n, g.groups, g.c // g.groups, g.h * g.w)
        np.matmul(wg, a, out=out.reshape(g.n, g.groups, g.o // g.groups, g.h * g.w))
        _epilogue(out, bias, residual, relu)
        return out
    width = g.width
    work = Work()

    def chunk(n0, n1):
        m = n1 - n0
        cols = fill_cols(x[n0:n1], g, work)
        res = work.array("res", x.dtype, (g.groups, g.o // g.groups, m * g.length))
        np.matmul(wg, cols, out=res)
        rows = res.reshape(g.o, m * g.length)
        if bias is not None:            # on the product's long rows, before the transpose
            rows += bias.reshape(-1, 1)
        if relu and residual is None:
            blocks.relu(rows, out=rows)
        dst = out[n0:n1]
        np.copyto(dst, res.reshape(g.o, m, g.ho, width)[..., :g.wo].transpose(1, 0, 2, 3))
        if residual is not None:
            _epilogue(dst, None, residual[n0:n1], relu)

    run_chunks(chunk, g, x.dtype, lean, room=room)
    return out


def zero_border(xp, ph, pw, h, w):
    """Zero the padding of planes xp (..., ph + h + ph, pw + w + pw)."""
    xp[..., :ph, :] = 0
    xp[..., ph + h:, :] = 0
    xp[..., ph:ph + h, :pw] = 0
    xp[..., ph:ph + h, pw + w:] = 0


def run_chunks(body, g, dtype, lean, reserved=0, room=None):
    """body(n0, n1) for every chunk of images, in order (chunk_size). (Chunks shared
    by the engine's threads, BLAS on one thread each, measured a third slower than
    one thread calling BLAS on its own threads.)"""
    step = chunk_size(g, dtype, lean, reserved, room)
    for n0 in range(0, g.n, step):
        body(n0, min(g.n, n0 + step))


def _epilogue(dst, bias, residual, relu):
    if bias is not None:
        dst += bias.reshape(-1, 1, 1)
    if residual is not None:
        dst += residual
    if relu:
        blocks.relu(dst, out=dst)


def chunk_size(g, dtype, lean, reserved=0, room=None):
    """Images per chunk: columns of about CHUNK_BYTES and, when `lean`, of about
    LEAN_CHUNK_BYTES (if less) with all the work arrays (the columns, the padded
    planes, the product or dout in the columns' layout, and `reserved` bytes of the
    call's other arrays) in no more than INPUT_MULTIPLE times x's size or
    LEAN_FLOOR_BYTES, whichever is more. `room` (bytes, minigraph.work_room): where
    it is more than that cap, a lean call's work takes up to `room`, in columns of
    about CHUNK_BYTES."""
    size = np.dtype(dtype).itemsize
    cols = g.c * g.taps * g.length * size
    target = CHUNK_BYTES
    if lean:
        if g.same:
            padded = g.c * (g.h * g.w + g.margin) + g.margin
        else:
            padded = g.c * g.hp * g.wp if (g.ph or g.pw or g.slack) else 0
        work = cols + (padded + g.o * g.length) * size
        cap = max(LEAN_FLOOR_BYTES, INPUT_MULTIPLE * g.n * g.c * g.h * g.w * size)
        if room is None or room <= cap:
            target = min(CHUNK_BYTES, LEAN_CHUNK_BYTES)
        else:
            cap = room
    step = target // max(1, cols)
    if lean:
        step = min(step, int(cap - reserved) // work)
    return max(1, min(g.n, step))


class Work:
    """The work arrays of one engine call, by name: `array` makes one for the first
    chunk and hands the same memory (as a view of the asked shape) to later, no
    larger chunks. Freed with the object, at the end of the call."""

    def __init__(self):
        self._arrays = {}

    def array(self, name, dtype, shape):
        size = math.prod(shape)
        buf = self._arrays.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._arrays[name] = np.empty(size, dtype)
        return buf[:size].reshape(shape)

    def free(self):
        """Drop every work array now (views handed out keep theirs alive)."""
        self._arrays.clear()


def padded(x, g, work):
    """x (a chunk of images) with its padding as (m, C, Hp Wp) planes, C-contiguous,
    followed by g.slack zeros: x itself when neither is needed, else a work array."""
    m = x.shape[0]
    if g.ph == 0 and g.pw == 0 and g.slack == 0:
        return x.reshape(m, g.c, g.h * g.w)
    planes = m * g.c * g.hp * g.wp
    buf = work.array("xpad", x.dtype, (planes + g.slack,))
    buf[planes:] = 0
    xp = buf[:planes].reshape(m, g.c, g.hp, g.wp)
    zero_border(xp, g.ph, g.pw, g.h, g.w)
    xp[:, :, g.ph:g.ph + g.h, g.pw:g.pw + g.w] = x
    return buf[:planes].reshape(m, g.c, g.hp * g.wp)


def columns_view(xp, g):
    """The strided view (only ever read) of the padded planes `xp` (m, C, Hp Wp) whose
    copy is the columns, with the image axis fourth: (C, kh, kw, m, L) for flat
    columns (reading up to g.slack values past the last plane), else
    (C, kh, kw, m, Ho, Wo)."""
    s_n, s_c, s_1 = xp.strides
    row = s_1 * g.wp
    if g.flat:
        shape = (g.c, g.kh, g.kw, xp.shape[0], g.length)
        strides = (s_c, row * g.dh, s_1 * g.dw, s_n, s_1)
    else:
        shape = (g.c, g.kh, g.kw, xp.shape[0], g.ho, g.wo)
        strides = (s_c, row * g.dh, s_1 * g.dw, s_n, row * g.sh, s_1 * g.sw)
    return np.lib.stride_tricks.as_strided(xp, shape=shape, strides=strides)


def fill_cols(x, g, work):
    """The columns of the images x (m, C, H, W), a chunk of the batch, as
    (G, C/G kh kw, m L), in a work array (padding only this chunk: the padded copy
    is a chunk's size, not the batch's)."""
    m = x.shape[0]
    cols = work.array("cols", x.dtype, (g.c * g.taps, m * g.length))
    if g.same:
        _fill_same(x, g, work, cols)
    else:
        view = columns_view(padded(x, g, work), g)
        np.copyto(cols.reshape(view.shape), view)
    return cols.reshape(g.groups, -1, m * g.length)


def _fill_same(x, g, work, cols):
    """Same-padded flat columns of x (m, C, H, W) into cols (C kh kw, m H W): each
    tap's runs of the planes (kept `margin` values apart in a work array, after
    `margin` more), then zeros where a window reads padding, which is also where
    a run reads outside its plane (module doc)."""
    m, hw, margin = x.shape[0], g.h * g.w, g.margin
    plane = hw + margin
    buf = work.array("xpad", x.dtype, (margin + m * g.c * plane,))
    np.copyto(buf[margin:].reshape(m * g.c, plane)[:, :hw], x.reshape(m * g.c, hw))
    s = buf.itemsize
    view = np.lib.stride_tricks.as_strided(
        buf, shape=(g.c, g.kh, g.kw, m, hw),
        strides=(plane * s, g.dh * g.w * s, g.dw * s, g.c * plane * s, s), writeable=False)
    np.copyto(cols.reshape(view.shape), view)
    taps = cols.reshape(g.c, g.kh, g.kw, m, g.h, g.w)
    for i in range(g.kh):
        oi = i * g.dh - g.ph          # the input row of output row 0, tap row i
        taps[:, i, :, :, :max(0, -oi)] = 0
        taps[:, i, :, :, g.h - max(0, oi):] = 0
    for j in range(g.kw):
        oj = j * g.dw - g.pw
        taps[:, :, j, :, :, :max(0, -oj)] = 0
        taps[:, :, j, :, :, g.w - max(0, oj):] = 0
