"""The native channels-last (NHWC) conv kernels (kernels/cpu/conv_nhwc.h, launched by
conv_native_nhwc.py) against the float64 reference and the numpy NHWC engine: the
forward pass on every geometry conv_native's tests use, the epilogue, the filter and
input gradients (every kind of stride phase, dout read in place), the thread counts,
views and bad shapes."""
import numpy as np
import pytest
from references import conv2d, conv2d_grad
from test_conv_native import GEOMETRIES as NCHW_GEOMETRIES

from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_im2col_nhwc, conv_native, conv_native_nhwc, native

rng = np.random.default_rng(17)

# conv_native's geometries, and few output channels (at most 4: dot products over the
# window's channels) on 8 or more input channels, a multiple of 8 and not, strided,
# dilated, padded, odd pixel counts (the last pixel alone)
GEOMETRIES = NCHW_GEOMETRIES + [
    ((2, 16, 7, 9), (1, 16, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((3, 11, 6, 5), (3, 11, 3, 3), (2, 1), (1, 0), (1, 1)),
    ((1, 24, 9, 9), (4, 24, 3, 2), (1, 2), (2, 1), (2, 1)),
    ((2, 8, 5, 5), (2, 8, 1, 1), (1, 1), (0, 0), (1, 1)),
]

pytestmark = pytest.mark.skipif(not conv_native.available(),
                                reason=f"native kernels not built: {native.reason('conv_native')}")


@pytest.fixture(autouse=True)
def every_call_threaded_and_direct(monkeypatch):
    """Small test convs run on as many threads as asked; the direct kernel (Winograd's
    NHWC path is tested in test_conv_winograd.py)."""
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1)
    monkeypatch.setenv(conv_native.WINOGRAD_ENV, "0")


def nhwc(a):
    return np.ascontiguousarray(np.asarray(a).transpose(0, 2, 3, 1))


def case(x_shape, w_shape, strides, paddings, dilations):
    """(x NHWC float32, filter float32, Geometry) of a GEOMETRIES case."""
    x = nhwc(rng.standard_normal(x_shape)).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = conv_cpu.geometry(x_shape, w_shape, strides, paddings, dilations, 1)
    return x, w, g


def reference(x, w, g, bias=None, residual=None, relu=False):
    out = conv2d(x, w, strides=(g.sh, g.sw), paddings=(g.ph, g.pw), dilations=(g.dh, g.dw),
                 data_layout="NHWC")
    if bias is not None:
        out = out + np.asarray(bias, np.float64)
    if residual is not None:
        out = out + residual
    return np.maximum(out, 0.0) if relu else out


def close(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_forward_against_the_float64_reference(geometry, threads):
    x, w, g = case(*geometry)
    stats = {}
    close(conv_native_nhwc.forward(x, w, g, threads, stats=stats), reference(x, w, g))
    assert stats == {"kernel": "direct"}


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("bias, residual, relu", [
    (True, False, False), (True, True, True), (False, True, False), (False, False, True)])
def test_forward_epilogue(geometry, bias, residual, relu):
    """The bias on the last axis, the residual and relu on each tile in registers (a
    last channel block short of 16 and of 8 included)."""
    x, w, g = case(*geometry)
    b = rng.standard_normal(g.o).astype(np.float32) if bias else None
    r = rng.standard_normal((g.n, g.ho, g.wo, g.o)).astype(np.float32) if residual else None
    got = conv_native_nhwc.forward(x, w, g, 2, bias=b, residual=r, relu=relu)
    close(got, reference(x, w, g, b, r, relu))


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gradients_against_the_float64_reference(geometry, threads):
    x, w, g = case(*geometry)
    d = rng.standard_normal((g.n, g.ho, g.wo, g.o)).astype(np.float32)
    dx_ref, dw_ref = conv2d_grad(x, w, d, strides=(g.sh, g.sw), paddings=(g.ph, g.pw),
                                 dilations=(g.dh, g.dw), data_layout="NHWC")
    close(conv_native_nhwc.filter_grad(x, d, g, threads), dw_ref)
    close(conv_native_nhwc.input_grad(w, d, g, threads), dx_ref)


@pytest.mark.parametrize("geometry", GEOMETRIES[::3])
def test_it_agrees_with_the_numpy_engine_and_the_nchw_kernels(geometry):
    """The same conv three ways: NHWC native, NHWC numpy, NCHW native (transposed)."""
    x, w, g = case(*geometry)
    d = rng.standard_normal((g.n, g.ho, g.wo, g.o)).astype(np.float32)
    out = conv_native_nhwc.forward(x, w, g, 2)
    dx = conv_native_nhwc.input_grad(w, d, g, 2)
    dw = conv_native_nhwc.filter_grad(x, d, g, 2)
    np_dx, np_dw = conv_im2col_nhwc.backward(x, w, d, g)
    close(out, conv_im2col_nhwc.forward(x, w, g).astype(np.float64))
    close(dx, np_dx.astype(np.float64))
    close(dw, np_dw.astype(np.float64))
    xc, dc = np.ascontiguousarray(x.transpose(0, 3, 1, 2)), np.ascontiguousarray(
        d.transpose(0, 3, 1, 2))
    close(out, nhwc(conv_native.forward(xc, w, g, 2)).astype(np.float64))
    close(dw, conv_native.filter_grad(xc, dc, g, 2).astype(np.float64))


def test_input_gradient_reads_dout_in_place(monkeypatch):
    """A strided conv's dx phases read dout from a later row or column as a window of
    the array (its row and image pitches), not a copy of it."""
    x, w, g = case((2, 5, 9, 8), (6, 5, 3, 3), (2, 2), (0, 0), (1, 1))
    d = rng.standard_normal((g.n, g.ho, g.wo, g.o)).astype(np.float32)
    seen = []
    real = conv_native_nhwc._forward_into

    def spy(out, x, x_pitch, *args, **kwargs):
        seen.append((x.base is not None and np.shares_memory(x, d), x_pitch))
        return real(out, x, x_pitch, *args, **kwargs)

    monkeypatch.setattr(conv_native_nhwc, "_forward_into", spy)
    dx = conv_native_nhwc.input_grad(w, d, g, 2)
    close(dx, conv2d_grad(x, w, d, strides=2, data_layout="NHWC")[0])
    assert seen and all(shared and pitch == (g.wo * g.o, g.ho * g.wo * g.o)
                        for shared, pitch in seen)


def test_results_do_not_depend_on_the_threads():
    x, w, g = case((3, 16, 12, 12), (32, 16, 3, 3), (1, 1), (1, 1), (1, 1))
    d = rng.standard_normal((g.n, g.ho, g.wo, g.o)).astype(np.float32)
    one = conv_native_nhwc.forward(x, w, g, 1)
    for threads in (2, 3, 5, 64):
        np.testing.assert_array_equal(conv_native_nhwc.forward(x, w, g, threads), one)
    for threads in (1, 2, 3):
        np.testing.assert_array_equal(conv_native_nhwc.filter_grad(x, d, g, threads),
                                      conv_native_nhwc.filter_grad(x, d, g, threads))


def test_views_and_other_dtypes_are_copied_and_bad_shapes_named():
    x64 = rng.standard_normal((2, 10, 12, 3))
    w = rng.standard_normal((4, 3, 3, 3))
    view = x64[:, ::2, 1:]                                     # float64, not contiguous
    g = conv_cpu.geometry((2, 3, 5, 11), w.shape, (1, 1), (1, 1), (1, 1), 1)
    close(conv_native_nhwc.forward(view, w, g, 2), reference(view, w, g))
    with pytest.raises(ValueError, match=r"conv_native: x has shape \(2, 5, 11, 2\), expected "
                                         r"\(2, 5, 11, 3\)"):
        conv_native_nhwc.forward(view[..., :2], w, g, 1)
    with pytest.raises(ValueError, match="conv_native: residual has shape"):
        conv_native_nhwc.forward(view, w, g, 1, residual=np.zeros((2, 4, 5, 11), np.float32))
    with pytest.raises(ValueError, match=r"conv_native: dout has shape \(2, 4, 5, 11\)"):
        conv_native_nhwc.filter_grad(view, np.zeros((2, 4, 5, 11), np.float32), g, 1)


def test_empty_batch():
    x = np.zeros((0, 8, 8, 3), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    g = conv_cpu.geometry((0, 3, 8, 8), w.shape, (1, 1), (1, 1), (1, 1), 1)
    d = np.zeros((0, 8, 8, 4), np.float32)
    assert conv_native_nhwc.forward(x, w, g, 2).shape == (0, 8, 8, 4)
    np.testing.assert_array_equal(conv_native_nhwc.filter_grad(x, d, g, 2), np.zeros(w.shape))
    assert conv_native_nhwc.input_grad(w, d, g, 2).shape == (0, 8, 8, 3)
