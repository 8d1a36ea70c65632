"""conv_native.c's pointwise kernel (kernels/cpu/conv_pointwise.h): 1x1 convs of stride 1
and no padding, against the float64 reference and against the direct kernel's bits, on
pixel counts with and without a ragged last vector and panel, output channels short of a
tile, few images, every epilogue and thread count."""
import numpy as np
import pytest
from references import conv2d_grad
from test_conv_native import close
from test_conv_native import reference as conv_reference

from minigraph.kernels.cpu import conv_im2col, conv_native, native

rng = np.random.default_rng(11)

pytestmark = pytest.mark.skipif(not conv_native.available(),
                                reason=f"native kernels not built: {native.reason('conv_native')}")

# (x shape, output channels): panels of 48 pixels whole (32x32: 1024 = 21 x 48 + 16) and
# not; pixel counts below one vector (3x3), of one vector and a part (5x4), of whole
# vectors (8x8, 16x16); output channels of a tile of 8 or 4 in part (3, 10, 13); one
# input channel and many (130); one image (its channel blocks split between threads)
SHAPES = [
    ((2, 8, 32, 32), 16),
    ((3, 5, 3, 3), 10),
    ((2, 7, 5, 4), 3),
    ((4, 16, 8, 8), 13),
    ((2, 130, 7, 7), 9),
    ((2, 1, 14, 14), 8),
    ((1, 24, 16, 16), 40),
    ((5, 32, 6, 8), 64),
]


@pytest.fixture(autouse=True)
def every_call_threaded(monkeypatch):
    """Small test convs run on as many threads as asked."""
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1)


def pointwise_case(x_shape, o):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((o, x_shape[1], 1, 1)).astype(np.float32)
    g = conv_im2col.geometry(x_shape, w.shape, (1, 1), (0, 0), (1, 1), 1)
    return x, w, g


def reference(x, w, bias=None, residual=None, relu=False):
    return conv_reference(x, w, (1, 1), (0, 0), (1, 1), bias, residual, relu)


def direct(x, w, g, threads, **epilogue):
    """The direct kernel's outputs for the same conv: written into planes one column
    wider (outputs that do not fill `out`, which the pointwise kernel leaves alone)."""
    wide = np.zeros((g.n, g.o, g.ho, g.wo + 1), np.float32)
    residual = epilogue.pop("residual", None)
    if residual is not None:
        residual = np.pad(residual, ((0, 0), (0, 0), (0, 0), (0, 1)))
    stats = {}
    conv_native._forward_into(wide, x, w, g, threads, residual=residual, stats=stats,
                              **epilogue)
    assert stats["kernel"] == "direct"
    return wide[..., :g.wo]


@pytest.mark.parametrize("x_shape, o", SHAPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias, residual, relu", [
    (False, False, False), (True, False, True), (True, True, True), (False, True, False)])
def test_against_the_reference_and_the_direct_kernels_bits(x_shape, o, threads, bias,
                                                           residual, relu):
    x, w, g = pointwise_case(x_shape, o)
    epilogue = {"relu": relu}
    if bias:
        epilogue["bias"] = rng.standard_normal(o).astype(np.float32)
    if residual:
        epilogue["residual"] = rng.standard_normal((g.n, o, g.ho, g.wo)).astype(np.float32)
    stats = {}
    got = conv_native.forward(x, w, g, threads, stats=stats, **epilogue)
    assert stats["kernel"] == "pointwise"
    close(got, reference(x, w, epilogue.get("bias"), epilogue.get("residual"), relu))
    assert got.tobytes() == direct(x, w, g, threads, **epilogue).tobytes()


def test_results_do_not_depend_on_the_threads():
    x, w, g = pointwise_case((3, 40, 12, 12), 24)
    b = rng.standard_normal(24).astype(np.float32)
    runs = [conv_native.forward(x, w, g, t, bias=b, relu=True).tobytes() for t in (1, 2, 5)]
    assert runs[0] == runs[1] == runs[2]


def test_what_it_takes():
    """Only 1x1 convs of stride 1 and no padding whose outputs fill `out`: a stride,
    padding, a 3x3 filter or pooling run the direct kernel."""
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    for w_shape, stride, pad, pool in [((5, 4, 1, 1), 2, 0, False), ((5, 4, 1, 1), 1, 1, False),
                                       ((5, 4, 3, 3), 1, 1, False), ((5, 4, 1, 1), 1, 0, True)]:
        w = rng.standard_normal(w_shape).astype(np.float32)
        g = conv_im2col.geometry(x.shape, w_shape, (stride,) * 2, (pad,) * 2, (1, 1), 1)
        stats = {}
        conv_native.forward(x, w, g, 2, stats=stats, pool=pool, max_scratch=conv_native.DIRECT)
        assert stats["kernel"] == "direct", (w_shape, stride, pad, pool)


def test_nan_and_infinity_spread_to_their_outputs_only():
    x, w, g = pointwise_case((2, 6, 7, 7), 10)
    x[1, 2, 3, 4] = np.inf
    x[0, 5, 6, 6] = np.nan      # the ragged last vector's last lane
    got = conv_native.forward(x, w, g, 2, relu=True)
    want = reference(x, w, relu=True)
    mask = np.zeros(got.shape, bool)
    mask[1, :, 3, 4] = mask[0, :, 6, 6] = True
    close(np.where(mask, 0, got), np.where(mask, 0, want))
    assert np.isnan(got[0, :, 6, 6]).all()
    assert np.array_equal(np.isnan(got[1, :, 3, 4]), np.isnan(want[1, :, 3, 4]))
    assert np.array_equal(got[1, :, 3, 4], want[1, :, 3, 4].astype(np.float32))


def test_the_input_gradient_of_a_1x1_conv_runs_on_it():
    """dx of a 1x1 conv of stride 1 is the transposed filter's pointwise conv of dout."""
    x, w, g = pointwise_case((3, 12, 9, 11), 20)
    d = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32)
    dx_ref, _ = conv2d_grad(x, w, d, strides=(1, 1), paddings=(0, 0), dilations=(1, 1))
    (_, _, _, _, _, _, gp), = conv_native.dx_phases(g)[0]
    stats = {}
    conv_native._forward_into(np.empty(x.shape, np.float32), d, w.transpose(1, 0, 2, 3), gp,
                              2, stats=stats)
    assert stats["kernel"] == "pointwise"
    close(conv_native.input_grad(w, d, g, 2), dx_ref)
