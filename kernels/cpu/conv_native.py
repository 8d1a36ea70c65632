"""Launchers of the native CPU conv kernels (conv_native.c, built by native.py):
float32 NCHW convolutions of one group, any kernel size, stride, padding and
dilation - the forward pass (with fused_conv2d's epilogue), the filter
gradient, and the input gradient as forward passes over dout. Forward passes
that `winograd` takes run Winograd's F(4x4, 3x3) (conv_winograd.h), 1x1 convs of
stride 1 and no padding a matrix product per image (conv_pointwise.h), the others
the direct kernel; Winograd computes the tiles whose inputs span too wide a range
directly (conv_winograd_range.h: WINOGRAD_RANGE), and a filter holding a NaN or an
infinity runs the direct kernel. The channels-last (NHWC) launchers are in
conv_native_nhwc.py.

`supports(g, dtype)` says whether they take a conv here; the conv ops call
them where they do, else conv_im2col's numpy engine (the reference they are
tested against). Sizes come as minigraph.kernels.cpu.conv_im2col.Geometry (n c h w o kh
kw groups sh sw ph pw dh dw ho wo).
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

from minigraph.kernels.cpu import native, prepared

MAX_PHASES = 64              # conv_native.c's bound on a buffer's column phases
# multiply-adds a thread must have to be worth waking (~25 us to wake the kernels' pool
# worker, ~60 us to start a thread); the demo net's conv (0.6 M) ran 1.3x as long on 2
# threads as on 1 when each call started its threads
MIN_THREAD_WORK = 2_000_000

# a 3x3 conv of stride 1 with fewer input channels (a stem on RGB) stays direct
WINOGRAD_MIN_CHANNELS = 8
WINOGRAD_ENV = "MINIGRAPH_WINOGRAD"
WINOGRAD_MAX_SCRATCH = 1.0      # its scratch memory at most this times its output's
WINOGRAD_MAX_SCRATCH_INFERENCE = 16.0   # the same for fused_conv2d (see winograd())
DIRECT = 0.0                    # a max_scratch no Winograd conv fits: the direct kernel
# a Winograd tile whose largest input magnitude (the root of the sum over channels of
# x^2 at one position) is more than this times the largest one of an output's own 3x3
# window is computed directly (conv_winograd_range.h says why: the error analysis)
WINOGRAD_RANGE = 16

_P, _L = ctypes.c_void_p, ctypes.c_int64
_transforms = {}    # id(filter) -> (weakref to it, (build key, its shape), transform or None)


def _lib():
    lib = native.library("conv_native")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.conv2d_forward_f32.argtypes = [_P, _P, _P, _P, _P, _P, _L]
        lib.conv2d_forward_pointwise.argtypes = [_P]
        lib.conv2d_filter_grad_f32.argtypes = [_P, _P, _P, _P, _L]
        lib.conv2d_winograd_f32.argtypes = [_P, _P, _P, _P, _P, _P, _L, _P, _P]
        lib.conv2d_winograd_filter_floats.argtypes = [_P]
        lib.conv2d_winograd_filter_floats.restype = _L
        lib.conv2d_winograd_filter.argtypes = [_P, _P, _P]
        lib.conv2d_winograd_scratch.argtypes = [_P, _L]
        lib.conv2d_winograd_scratch.restype = _L
        lib.conv2d_nhwc_forward_f32.argtypes = [_P, _P, _P, _P, _P, _P, _L]
        lib.conv2d_nhwc_filter_grad_f32.argtypes = [_P, _P, _P, _P, _L]
        lib.conv_separable_forward.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L]
        lib._typed = True
    return lib


def available():
    """True when the native kernels are built and loaded (native.reason says why not)."""
    return _lib() is not None


def supports(g, dtype):
    """True when the kernels take this conv: float32, one group, at most MAX_PHASES
    column phases (min(stride across, reach across + 1))."""
    return (g.groups == 1 and np.dtype(dtype) == np.float32
            and min(g.sw, (g.kw - 1) * g.dw + 1) <= MAX_PHASES and available())


def _threads(g, threads):
    """At most `threads`, at least 1, and no more than the conv's work is worth."""
    work = g.n * g.o * g.c * g.kh * g.kw * g.ho * g.wo
    return max(1, min(int(threads), work // MIN_THREAD_WORK))


def _dims(g, relu=False, out_shape=None, at=(0, 0), step=(1, 1), pool=False):
    """The C kernels' sizes: g, then the output array's planes (out_shape's last two,
    default g.ho, g.wo) and where output (y, x) goes in them: (at + step * (y, x)), then
    whether the outputs are max-pooled (pooled_shape)."""
    out_h, out_w = (g.ho, g.wo) if out_shape is None or pool else out_shape[2:]
    return np.array([g.n, g.c, g.h, g.w, g.o, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw,
                     g.ho, g.wo, int(bool(relu)), out_h, out_w, *at, *step, int(bool(pool))],
                    dtype=np.int64)


def pooled_shape(g):
    """The output shape of a forward pass with `pool`: (N, O, Ho // 2, Wo // 2), the max
    of each 2x2 window at stride 2 of the conv's outputs (an odd last row or column
    left out, as pool2d's)."""
    return (g.n, g.o, g.ho // 2, g.wo // 2)


_ptr = native.address


def _float32(array, shape, name):
    """`array` as a C-contiguous float32 array of `shape` (a copy only where needed)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.shape != tuple(shape):
        raise ValueError(f"conv_native: {name} has shape {array.shape}, expected {tuple(shape)}")
    return array


def forward(x, w, g, threads, bias=None, residual=None, relu=False, max_scratch=None,
            stats=None, fixed=False, pool=False):
    """out (N, O, Ho, Wo) float32 = conv(x, w) (+ bias[o]) (+ residual) (then max(., 0)),
    on `threads` threads; the epilogue runs on each tile of outputs in registers.
    max_scratch: winograd()'s bound on the scratch memory (None: WINOGRAD_MAX_SCRATCH).
    The padding g.ph, g.pw goes before x's first row and column; rows and columns
    past x's end that the windows read are zeros (asymmetric padding: g.ho and
    g.wo need not be x's output size for symmetric padding). stats: a dict, given
    "kernel" ("winograd", "direct" or "pointwise": conv_pointwise.h's kernel, which
    takes 1x1 convs of stride 1 and no padding) and, for Winograd, "direct_tiles" (how many
    tiles it computed directly) and "tiles". fixed: `w` is a filter no op writes (an
    inference net's): Winograd's transform of it is kept (fixed_transform), and `w`
    made read-only. pool: out is pooled_shape(g), the max of each 2x2 window of the
    outputs (after the epilogue) at stride 2, the full outputs never in memory."""
    full = (g.n, g.o, g.ho, g.wo)
    out = np.empty(pooled_shape(g) if pool else full, dtype=np.float32)
    residual = None if residual is None else _float32(residual, full, "residual")
    _forward_into(out, x, w, g, threads, bias=bias, residual=residual, relu=relu,
                  max_scratch=max_scratch, stats=stats, fixed=fixed, pool=pool)
    return out


def _forward_into(out, x, w, g, threads, bias=None, residual=None, relu=False, at=(0, 0),
                  step=(1, 1), max_scratch=None, stats=None, fixed=False, pool=False):
    """forward's outputs into out (C-contiguous float32, (N, O, rows, cols)): output
    (y, x) at out[..., at[0] + step[0] y, at[1] + step[1] x], the caller having
    checked that these fit; residual (out's shape) read at the same places. pool (at
    and step the defaults): out is pooled_shape(g), the residual the conv's shape."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    w = _float32(w, (g.o, g.c, g.kh, g.kw), "filter")
    bias = None if bias is None else _float32(bias, (g.o,), "bias")
    if not (g.n and g.o and g.ho and g.wo):
        return
    threads = _threads(g, threads)
    args = (_ptr(x), _ptr(w), _ptr(bias), _ptr(residual), _ptr(out))
    if winograd(g, threads, None if pool else out.shape, at, step, max_scratch) and \
            run_winograd(args, _winograd_dims(g, relu, pool=pool), threads, g, stats,
                         w if fixed else None):
        return
    dims = _dims(g, relu, out.shape, at, step, pool)
    if stats is not None:
        stats["kernel"] = "pointwise" if _lib().conv2d_forward_pointwise(_ptr(dims)) else "direct"
    if _lib().conv2d_forward_f32(*args, _ptr(dims), threads):
        raise MemoryError("conv_native.forward: the kernel's buffers could not be allocated")


def prepared_forward(w, g, threads, bias, relu, out, use_winograd, pool=False):
    """forward's outputs into `out` ((N, O, Ho, Wo) float32, C-contiguous; with pool,
    pooled_shape(g) and forward's pooled outputs) prepared once:
    a function call(x, residual) that runs the kernel on x and the residual (None where
    `residual` is; else C-contiguous float32 of g's shapes, as `residual`) and what the
    other arrays hold then (minigraph.bound_run), with forward's bits:
    Winograd's on the transform of `w` (kept, `w` made read-only, as forward's
    `fixed`) where `use_winograd` and `w` is finite, else the direct kernel. w and bias
    C-contiguous float32 of g's shapes. call.transform: the transform it reads, or
    None (the direct kernel)."""
    lib, threads = _lib(), _threads(g, threads)
    filter_bias, to = (_ptr(w), _ptr(bias)), _ptr(out)
    if use_winograd:
        dims = _winograd_dims(g, relu, pool=pool)
        transform = fixed_transform(w, dims)
        if transform is not None:
            direct = ctypes.c_int64(0)
            rest = (to, _ptr(dims), threads, ctypes.byref(direct), _ptr(transform))

            def call(x, residual):
                if lib.conv2d_winograd_f32(_ptr(x), *filter_bias, _ptr(residual), *rest):
                    raise MemoryError("conv_native.forward: the kernel's buffers could not "
                                      "be allocated")
            call.keep, call.transform = (dims, direct), transform   # what rest points into
            return call
    dims = _dims(g, relu, out.shape, pool=pool)
    rest = (to, _ptr(dims), threads)

    def call(x, residual):
        if lib.conv2d_forward_f32(_ptr(x), *filter_bias, _ptr(residual), *rest):
            raise MemoryError("conv_native.forward: the kernel's buffers could not be "
                              "allocated")
    call.keep, call.transform = dims, None
    return call


def run_winograd(args, dims, threads, g, stats=None, fixed=None):
    """conv2d_winograd_f32 on args (x, filter, bias, residual, out pointers): True when
    it ran, False (nothing written) when the filter holds a NaN or an infinity (the
    caller then runs the direct kernel, which spreads them as it should). stats: see
    forward. fixed: the filter array where no op writes it (its transform is kept)."""
    transform = None
    if fixed is not None:
        transform = fixed_transform(fixed, dims)
        if transform is None:
            return False
    direct = ctypes.c_int64(0)
    failed = _lib().conv2d_winograd_f32(*args, _ptr(dims), threads, ctypes.byref(direct),
                                        _ptr(transform))
    if failed == 2:
        return False
    if failed:
        raise MemoryError("conv_native.forward: the kernel's buffers could not be allocated")
    if stats is not None:
        stats.update(kernel="winograd", direct_tiles=direct.value,
                     tiles=g.n * ((g.ho + 3) // 4) * ((g.wo + 3) // 4))
    return True


def fixed_transform(w, dims):
    """Winograd's transform of filter `w` (O, C, 3, 3) float32 for the conv of `dims`
    (_winograd_dims: only C and O matter), made at its first use and kept while `w`
    lives (and made again for another build or shape), or None where `w` holds a NaN or
    an infinity. `w` is made read-only (prepared.kept)."""
    def transform():
        lib = _lib()
        u = np.zeros(lib.conv2d_winograd_filter_floats(_ptr(dims)), dtype=np.float32)
        return None if lib.conv2d_winograd_filter(_ptr(w), _ptr(dims), _ptr(u)) else u
    return prepared.kept(_transforms, w, (native.build_key("conv_native"), w.shape),
                         transform)


def winograd(g, threads=1, out_shape=None, at=(0, 0), step=(1, 1), max_scratch=None):
    """True when a forward pass on `threads` threads takes Winograd's F(4x4, 3x3)
    (conv_winograd.h): a 3x3 filter of stride 1 and dilation 1 with at least
    WINOGRAD_MIN_CHANNELS input channels, its outputs filling out_shape (N, O, ho,
    wo), scratch memory (the filter's transform and each thread's buffers) at most
    max_scratch (default WINOGRAD_MAX_SCRATCH) times its output's, and not turned
    off (MINIGRAPH_WINOGRAD=0). The default bound keeps a training step's peak
    memory that of the direct kernel: a conv of many channels on small images (a
    ResNet's last stage) needs a transform of the filter larger than its outputs,
    and stays direct unless the step leaves it room (kernels/cpu/conv2d.py's
    winograd_bound). fused_conv2d, which no training step runs, passes
    WINOGRAD_MAX_SCRATCH_INFERENCE: up to there Winograd was the faster (the
    filter's transform, made at each call, is paid back by the images that use it;
    past it, on few small images, the direct kernel can be several times faster)."""
    return ((g.kh, g.kw, g.sh, g.sw, g.dh, g.dw) == (3, 3, 1, 1, 1, 1)
            and g.c >= WINOGRAD_MIN_CHANNELS and tuple(at) == (0, 0) and tuple(step) == (1, 1)
            and (out_shape is None or tuple(out_shape[2:]) == (g.ho, g.wo))
            and os.environ.get(WINOGRAD_ENV, "1") != "0" and available()
            and _winograd_scratch(g, max(1, threads))
            <= (WINOGRAD_MAX_SCRATCH if max_scratch is None else max_scratch)
            * 4 * g.n * g.o * g.ho * g.wo)


def forward_winograd(g, threads, max_scratch=None):
    """True when forward(x, w, g, threads, max_scratch=max_scratch) runs Winograd's
    kernel (winograd() on the threads the conv gets)."""
    return winograd(g, _threads(g, threads), max_scratch=max_scratch)


@functools.lru_cache(maxsize=1024)
def _winograd_scratch(g, threads):
    """Bytes of scratch conv2d_winograd_f32 allocates for `g` on `threads` threads."""
    return _lib().conv2d_winograd_scratch(_ptr(_winograd_dims(g)), threads)


def _winograd_dims(g, relu=False, nhwc=False, x_row=0, x_image=0, pool=False):
    """conv2d_winograd_f32's sizes (x_row, x_image: channels-last x's row and image
    pitches in floats; pool: NCHW outputs max-pooled, as forward's)."""
    return np.array([g.n, g.c, g.h, g.w, g.o, g.ph, g.pw, g.ho, g.wo, int(bool(relu)),
                     int(bool(nhwc)), x_row, x_image, WINOGRAD_RANGE, int(bool(pool))],
                    dtype=np.int64)


def filter_grad(x, d, g, threads):
    """dfilter (O, C, kh, kw) float32 of out = conv(x, w) for dout `d` (N, O, Ho, Wo),
    on `threads` threads (each sums a fixed range of images; the sums are added in
    thread order)."""
    x = _float32(x, (g.n, g.c, g.h, g.w), "x")
    d = _float32(d, (g.n, g.o, g.ho, g.wo), "dout")
    dw = np.zeros((g.o, g.c, g.kh, g.kw), dtype=np.float32)
    if g.n and g.o and g.ho and g.wo:
        failed = _lib().conv2d_filter_grad_f32(_ptr(x), _ptr(d), _ptr(dw), _ptr(_dims(g)),
                                               _threads(g, threads))
        if failed:
            raise MemoryError("conv_native.filter_grad: the kernel's buffers could not be "
                              "allocated")
    return dw


@functools.lru_cache(maxsize=1024)
def _phases(size, k, stride, pad, dil, out_size):
    """Along one axis, per phase a (the outputs a, a + stride, ... of dx, `size` of
    them in all): (a, taps, first, step, count) - the filter taps that reach those
    outputs as a slice of the filter's axis, ordered by the dout offset they read
    (first, first + step, ...), and how many outputs the phase has; phases no tap
    reaches are left out."""
    phases = []
    for a in range(min(stride, size)):
        taps = sorted((i for i in range(k) if (a + pad - i * dil) % stride == 0),
                      key=lambda i: -i)                 # ascending dout offsets
        offsets = [(a + pad - i * dil) // stride for i in taps]
        if taps and offsets[0] < out_size:
            step = offsets[1] - offsets[0] if len(taps) > 1 else 1
            gap = taps[0] - taps[1] if len(taps) > 1 else 1      # a slice, not a fancy index
            stop = taps[-1] - gap
            taps = slice(taps[0], stop if stop >= 0 else None, -gap)
            phases.append((a, taps, offsets[0], step, len(range(a, size, stride))))
    return tuple(phases)


def dx_phases(g):
    """What input_grad runs per phase (a, b) of the stride: (a, b, r0, c0, row_taps,
    col_taps, gp) - dout read from row r0 and column c0 on, the filter's taps
    w[:, :, row_taps, col_taps] (flipped, channels swapped) and the stride-1
    Geometry gp of that forward pass; and whether the phases cover every output
    (else dx starts as zeros)."""
    rows = _phases(g.h, g.kh, g.sh, g.ph, g.dh, g.ho)
    cols = _phases(g.w, g.kw, g.sw, g.pw, g.dw, g.wo)
    whole = len(rows) == g.sh and len(cols) == g.sw
    passes = []
    for a, row_taps, row_first, row_step, n_rows in rows:
        for b, col_taps, col_first, col_step, n_cols in cols:
            r0, c0 = max(0, row_first), max(0, col_first)
            gp = g._replace(c=g.o, h=g.ho - r0, w=g.wo - c0, o=g.c,
                            kh=len(range(g.kh)[row_taps]), kw=len(range(g.kw)[col_taps]),
                            sh=1, sw=1, ph=max(0, -row_first), pw=max(0, -col_first),
                            dh=row_step, dw=col_step, ho=n_rows, wo=n_cols)
            passes.append((a, b, r0, c0, row_taps, col_taps, gp))
    return passes, whole


def input_grad_winograd(g, threads, max_scratch=None):
    """True when input_grad(..., max_scratch) runs a pass on Winograd's kernel (a 3x3
    conv of stride 1 whose output channels are enough: winograd())."""
    passes, _ = dx_phases(g)
    return any(winograd(gp, _threads(gp, threads), (g.n, g.c, g.h, g.w), (a, b),
                        (g.sh, g.sw), max_scratch)
               for a, b, *_, gp in passes)


def input_grad(w, d, g, threads, max_scratch=None):
    """dx (N, C, H, W) float32 of out = conv(x, w) for dout `d`: per phase (a, b) of
    the stride, the outputs dx[..., a::sh, b::sw] are a stride-1 forward pass over
    dout with the filter taps that reach them (flipped, channels swapped), written
    in place: no multiply-add by a zero (1, 2, 2 and 4 of a 3x3 filter's 9 taps on
    the four phases of stride 2; one phase, the whole flipped filter, at stride 1).
    max_scratch: as forward's (DIRECT: the direct kernel)."""
    w = _float32(w, (g.o, g.c, g.kh, g.kw), "filter")
    d = _float32(d, (g.n, g.o, g.ho, g.wo), "dout")
    passes, whole = dx_phases(g)
    dx = (np.empty if whole else np.zeros)((g.n, g.c, g.h, g.w), dtype=np.float32)
    for a, b, r0, c0, row_taps, col_taps, gp in passes:
        part = d[:, :, r0:, c0:]
        sub = w[:, :, row_taps, col_taps].transpose(1, 0, 2, 3)
        _forward_into(dx, part, sub, gp, threads, at=(a, b), step=(g.sh, g.sw),
                      max_scratch=max_scratch)
    return dx
