"""Winograd's F(4x4, 3x3) in the native CPU conv kernels (kernels/cpu/conv_winograd.h):
which convs take it, and its results against the float64 reference and the direct
kernel - every size of tile edge, padding, channel count, epilogue and thread count,
the input gradient that runs through it, and what it does with NaN and infinities."""
from types import SimpleNamespace

import numpy as np
import pytest
from references import conv2d, conv2d_grad

from minigraph.kernels.cpu import conv2d as conv2d_kernels
from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_native, native

rng = np.random.default_rng(11)
MAX_SCRATCH = conv_native.WINOGRAD_MAX_SCRATCH       # the bounds as shipped (the fixture
MAX_SCRATCH_INFERENCE = conv_native.WINOGRAD_MAX_SCRATCH_INFERENCE   # lifts the first)

pytestmark = pytest.mark.skipif(not conv_native.available(),
                                reason=f"native kernels not built: {native.reason('conv_native')}")

# (x shape, output channels, padding): output sizes of every remainder by the tile
# (4), one output, channel counts below, at and past a vector (8) and the product's
# register block (16), padding 0, 1, 2 and different across and down, fewer images
# than threads, images whose tiles fill several blocks (24 tiles) and small images
# that share one
SHAPES = [
    ((2, 16, 32, 32), 16, (1, 1)),
    ((3, 8, 7, 5), 8, (1, 1)),
    ((1, 9, 6, 9), 5, (0, 2)),
    ((4, 17, 5, 6), 33, (2, 1)),
    ((2, 64, 8, 8), 64, (1, 1)),
    ((1, 8, 1, 1), 3, (1, 1)),
    ((5, 12, 11, 13), 20, (1, 0)),
    ((1, 24, 3, 3), 7, (0, 0)),
    ((2, 8, 20, 3), 1, (1, 1)),
]


@pytest.fixture(autouse=True)
def every_call_threaded(monkeypatch):
    """Small test convs run on as many threads as asked, and through Winograd's kernel
    whatever its scratch memory."""
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1)
    monkeypatch.setattr(conv_native, "WINOGRAD_MAX_SCRATCH", float("inf"))
    monkeypatch.delenv(conv_native.WINOGRAD_ENV, raising=False)


def geometry(x_shape, o, paddings, kernel=3, stride=1, dilation=1):
    return conv_cpu.geometry(x_shape, (o, x_shape[1], kernel, kernel), (stride, stride),
                             paddings, (dilation, dilation), 1)


def data(x_shape, o):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((o, x_shape[1], 3, 3)).astype(np.float32)
    return x, w


def close(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


def test_which_convs_take_it(monkeypatch):
    g = geometry((2, 16, 8, 8), 16, (1, 1))
    assert conv_native.winograd(g)
    assert conv_native.winograd(g, 2, out_shape=(2, 16, 8, 8))
    assert not conv_native.winograd(g, out_shape=(2, 16, 9, 8))         # a larger array
    assert not conv_native.winograd(g, out_shape=(2, 16, 8, 8), at=(1, 0))
    assert not conv_native.winograd(g, out_shape=(2, 16, 8, 8), step=(2, 2))  # a phase of dx
    assert not conv_native.winograd(geometry((2, 16, 8, 8), 16, (1, 1), stride=2))
    assert not conv_native.winograd(geometry((2, 16, 8, 8), 16, (2, 2), dilation=2))
    assert not conv_native.winograd(geometry((2, 16, 8, 8), 16, (2, 2), kernel=5))
    assert not conv_native.winograd(geometry((2, 16, 8, 8), 16, (0, 0), kernel=1))
    assert not conv_native.winograd(geometry((2, 3, 8, 8), 16, (1, 1)))     # RGB stem
    monkeypatch.setenv(conv_native.WINOGRAD_ENV, "0")
    assert not conv_native.winograd(g)


def test_its_scratch_memory_stays_within_its_output(monkeypatch):
    """The filter's transform (36 C O floats) and each thread's buffers, against the
    output's bytes: a ResNet's first two stages take it, its last (64 channels on
    8x8 images, a transform larger than the outputs) stays direct."""
    monkeypatch.setattr(conv_native, "WINOGRAD_MAX_SCRATCH", 1.0)
    lib = conv_native._lib()
    stage = {c: geometry((32, c, 32 // (c // 16), 32 // (c // 16)), c, (1, 1)) for c in (16, 32, 64)}
    for c, g in stage.items():
        scratch = lib.conv2d_winograd_scratch(native.address(conv_native._winograd_dims(g)), 2)
        assert scratch >= 4 * 36 * c * c
        assert conv_native.winograd(g, 2) == (scratch <= 4 * g.n * g.o * g.ho * g.wo)
    assert conv_native.winograd(stage[16], 2) and conv_native.winograd(stage[32], 2)
    assert not conv_native.winograd(stage[64], 2)
    assert not conv_native.winograd(geometry((1, 8, 1, 1), 3, (1, 1)))     # one output


def test_fused_conv2d_takes_it_with_more_scratch(monkeypatch):
    """fused_conv2d (inference nets only) bounds the scratch at MAX_SCRATCH_INFERENCE
    times its output, conv2d at MAX_SCRATCH: the ResNet's last stage takes Winograd
    in the first only, and a few 4x4 images with 256 channels (a filter transform
    they do not pay back) in neither."""
    monkeypatch.setattr(conv_native, "WINOGRAD_MAX_SCRATCH", MAX_SCRATCH)
    last_stage = geometry((32, 64, 8, 8), 64, (1, 1))
    few_small = geometry((8, 256, 4, 4), 256, (1, 1))
    assert not conv_native.winograd(last_stage, 2)
    assert conv_native.winograd(last_stage, 2, max_scratch=MAX_SCRATCH_INFERENCE)
    assert not conv_native.winograd(few_small, 2, max_scratch=MAX_SCRATCH_INFERENCE)
    asked, real = [], conv_native.winograd
    monkeypatch.setattr(conv_native, "winograd", lambda *args: asked.append(args[-1])
                        or real(*args))
    x, w = data((4, 64, 8, 8), 64)
    attrs = {"strides": (1, 1), "paddings": (1, 1), "dilations": (1, 1), "groups": 1,
             "activation": "none", "data_layout": "NCHW"}
    op = SimpleNamespace(type="fused_conv2d", attrs=attrs)
    close(conv2d_kernels.fused_conv2d_cpu(op, {"x": x, "filter": w}, None)["out"],
          conv2d(x, w, paddings=(1, 1)))
    conv2d_kernels.conv2d_cpu(SimpleNamespace(type="conv2d", attrs=attrs),
                              {"x": x, "filter": w}, None)
    assert asked == [MAX_SCRATCH_INFERENCE, None]


@pytest.mark.parametrize("x_shape, o, paddings", SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_forward_against_the_float64_reference(x_shape, o, paddings, threads):
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    assert conv_native.winograd(g)
    close(conv_native.forward(x, w, g, threads), conv2d(x, w, paddings=paddings))


@pytest.mark.parametrize("x_shape, o, paddings", SHAPES)
@pytest.mark.parametrize("bias, residual, relu", [
    (True, False, False), (True, True, True), (False, True, False), (False, False, True)])
def test_the_epilogue(x_shape, o, paddings, bias, residual, relu):
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    b = rng.standard_normal(o).astype(np.float32) if bias else None
    r = rng.standard_normal((g.n, o, g.ho, g.wo)).astype(np.float32) if residual else None
    want = conv2d(x, w, paddings=paddings)
    want = want + (0 if b is None else b.astype(np.float64).reshape(-1, 1, 1))
    want = want + (0 if r is None else r)
    close(conv_native.forward(x, w, g, 2, bias=b, residual=r, relu=relu),
          np.maximum(want, 0) if relu else want)


@pytest.mark.parametrize("x_shape, o, paddings", SHAPES[:5])
def test_it_agrees_with_the_direct_kernel(x_shape, o, paddings, monkeypatch):
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    fast = conv_native.forward(x, w, g, 2, relu=True)
    monkeypatch.setenv(conv_native.WINOGRAD_ENV, "0")
    close(fast, conv_native.forward(x, w, g, 2, relu=True).astype(np.float64))


def test_results_do_not_depend_on_the_threads():
    x, w = data((5, 16, 12, 12), 24)
    g = geometry(x.shape, 24, (1, 1))
    one = conv_native.forward(x, w, g, 1)
    for threads in (2, 3, 7, 64):
        np.testing.assert_array_equal(conv_native.forward(x, w, g, threads), one)


@pytest.mark.parametrize("x_shape, o, paddings", [SHAPES[0], SHAPES[3], SHAPES[6]])
def test_the_input_gradient_of_a_stride_1_conv_runs_through_it(x_shape, o, paddings):
    """dx of a 3x3 conv of stride 1 is a forward pass over dout (O channels in) with
    the flipped filter: Winograd's where O >= 8."""
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    d = rng.standard_normal((g.n, o, g.ho, g.wo)).astype(np.float32)
    dx_ref, _ = conv2d_grad(x, w, d, paddings=paddings)
    close(conv_native.input_grad(w, d, g, 2), dx_ref)


def test_nan_reaches_every_output_it_should_and_infinities_come_out_nan():
    """A NaN in the input makes every output whose window holds it NaN, as the direct
    conv does; it may also reach the other outputs of the 4x4 tiles whose 6x6 input
    windows hold it (the transforms mix a tile's inputs), and an infinity can come
    out NaN there (inf - inf). Outputs of other tiles are what they should be."""
    x = np.ones((1, 8, 10, 10), np.float32)
    w = np.ones((8, 8, 3, 3), np.float32)
    g = geometry(x.shape, 8, (1, 1))
    x[0, 3, 2, 3] = np.nan              # in the windows of tile rows 0, tile columns 0 and 1
    out = conv_native.forward(x, w, g, 1, relu=True)
    want = conv2d(x, w, paddings=(1, 1))
    assert np.isnan(out[np.isnan(want)]).all()
    assert not np.isnan(out[:, :, 4:, :]).any() and not np.isnan(out[:, :, :, 8:]).any()
    close(out[~np.isnan(out)], want[~np.isnan(out)])
    x[0, 3, 2, 3] = np.inf
    out = conv_native.forward(x, w, g, 1)
    assert not np.isfinite(out[np.isinf(conv2d(x, w, paddings=(1, 1)))]).any()
    assert np.isfinite(out[:, :, 4:, :]).all() and np.isfinite(out[:, :, :, 8:]).all()
