"""Winograd's F(4x4, 3x3) in the native CPU conv kernels (kernels/cpu/conv_winograd.h):
which convs take it, and its results against the float64 reference and the direct
kernel - every size of tile edge, padding, channel count, epilogue and thread count,
the input gradient that runs through it, channels last (NHWC), and the tiles it
computes directly: those whose inputs span a wide range, NaN and infinities (outputs
outside a value's window stay as they were; non-finite values spread as the direct
conv spreads them)."""
from types import SimpleNamespace

import numpy as np
import pytest
from references import conv2d, conv2d_grad

from minigraph.kernels.cpu import conv2d as conv2d_kernels
from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_native, conv_native_nhwc, native

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
    ((2, 32, 14, 14), 64, (1, 1)),      # the recipe's second conv: rows of 8 + 6 columns
    ((1, 16, 28, 28), 32, (1, 1)),
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
    monkeypatch.setenv("MINIGRAPH_TUNE", "0")          # each op's default kernel, untimed
    asked, real = [], conv_native.winograd

    def spy(*args, **kwargs):
        asked.append(kwargs["max_scratch"] if "max_scratch" in kwargs else args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(conv_native, "winograd", spy)
    x, w = data((4, 64, 8, 8), 64)
    attrs = {"strides": (1, 1), "paddings": (1, 1), "dilations": (1, 1), "groups": 1,
             "activation": "none", "data_layout": "NCHW"}
    op = SimpleNamespace(type="fused_conv2d", attrs=attrs)
    close(conv2d_kernels.fused_conv2d_cpu(op, {"x": x, "filter": w}, None)["out"],
          conv2d(x, w, paddings=(1, 1)))
    conv2d_kernels.conv2d_cpu(SimpleNamespace(type="conv2d", attrs=attrs),
                              {"x": x, "filter": w}, None)
    # each op asks whether Winograd may run with its own bound, then runs Winograd with
    # that bound or the direct kernel (conv_native.DIRECT)
    assert asked[0] == MAX_SCRATCH_INFERENCE and asked[1] in (MAX_SCRATCH_INFERENCE,
                                                             conv_native.DIRECT)
    assert asked[2] is None and asked[3] in (None, conv_native.DIRECT) and len(asked) == 4


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


def nhwc(a):
    return np.ascontiguousarray(np.asarray(a).transpose(0, 2, 3, 1))


def nchw(a):
    return np.ascontiguousarray(np.asarray(a).transpose(0, 3, 1, 2))


def run(x, w, g, layout, threads=2, **kwargs):
    """The native forward pass in `layout` (x given and the result returned NCHW)."""
    if layout == "NHWC":
        return nchw(conv_native_nhwc.forward(nhwc(x), w, g, threads, **kwargs))
    return conv_native.forward(x, w, g, threads, **kwargs)


@pytest.mark.parametrize("x_shape, o, paddings", SHAPES)
@pytest.mark.parametrize("threads", [1, 3])
def test_channels_last_gives_the_same_bits(x_shape, o, paddings, threads):
    """NHWC runs the same transforms on the same buffer: the same bits as NCHW, with
    the epilogue (bias on the last axis, residual, relu)."""
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    b = rng.standard_normal(o).astype(np.float32)
    r = rng.standard_normal((g.n, o, g.ho, g.wo)).astype(np.float32)
    stats = {}
    want = run(x, w, g, "NCHW", threads, bias=b, residual=r, relu=True)
    got = conv_native_nhwc.forward(nhwc(x), w, g, threads, bias=b, residual=nhwc(r), relu=True,
                                   stats=stats)
    assert stats["kernel"] == "winograd"
    np.testing.assert_array_equal(nchw(got), want)


@pytest.mark.parametrize("x_shape, o, paddings", [SHAPES[0], SHAPES[3]])
def test_channels_last_input_gradient_runs_through_it(x_shape, o, paddings):
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    d = rng.standard_normal((g.n, o, g.ho, g.wo)).astype(np.float32)
    dx_ref, _ = conv2d_grad(x, w, d, paddings=paddings)
    close(nchw(conv_native_nhwc.input_grad(w, nhwc(d), g, 2)), dx_ref)


# ---- wide ranges, NaN and infinities: tiles computed directly (conv_winograd_range.h) --

LAYOUTS = ["NCHW", "NHWC"]


def field_mask(shape, at, paddings):
    """True for the outputs (N, O, Ho, Wo) of a stride-1 3x3 conv whose window holds
    input pixel `at` (image, row, column)."""
    n, o, ho, wo = shape
    inside = np.zeros(shape, bool)
    img, row, col = at
    (ph, pw) = paddings
    inside[img, :, max(0, row + ph - 2):row + ph + 1, max(0, col + pw - 2):col + pw + 1] = True
    return inside


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value", [1e3, 1e6, 3e37, -3e37])
def test_a_large_value_leaves_the_outputs_outside_its_window_alone(layout, value):
    """One input of 1e6 among values near 1 gave 17% error on outputs outside its
    receptive field (the transforms mix a tile's whole 6x6 window), 3e37 garbage
    (overflow: inf - inf). Those outputs now equal the conv of the data without it,
    to float32 rounding; the outputs that read it equal the direct kernel's."""
    x, w = data((2, 16, 12, 12), 24)
    w /= np.sqrt(9 * 16)
    g = geometry(x.shape, 24, (1, 1))
    at = (1, 5, 6)
    clean = conv2d(x, w, paddings=(1, 1))
    x[at[0], 3, at[1], at[2]] = value
    got = run(x, w, g, layout)
    outside = ~field_mask(got.shape, at, (1, 1))
    close(got[outside], clean[outside])
    want = conv2d(x.astype(np.float64), w, paddings=(1, 1))
    inside = ~outside
    np.testing.assert_allclose(got[inside], want[inside], rtol=1e-4,
                               atol=1e-5 * np.abs(want[inside]).max())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("values", [[np.nan], [np.inf], [-np.inf], [np.inf, -np.inf],
                                    [np.nan, 1e6]])
def test_nan_and_infinities_spread_exactly_as_the_direct_conv(layout, values, monkeypatch):
    """A NaN or an infinity reached 112-224 outputs beyond its window (every output of
    the tiles whose windows held it, an infinity as NaN). Now the outputs that are NaN,
    +inf and -inf are exactly the direct kernel's, and the others agree with it."""
    x, w = data((2, 16, 13, 13), 24)
    w[3, 2, 1, 1] = 0.0                                # inf * 0: NaN, as direct
    g = geometry(x.shape, 24, (1, 1))
    for k, v in enumerate(values):
        x[k % 2, 2 + k, 4 + 3 * k, 5 + k] = v
    got = run(x, w, g, layout)
    monkeypatch.setenv(conv_native.WINOGRAD_ENV, "0")
    direct = run(x, w, g, layout)
    for same in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(same(got), same(direct))
    spread = 9 * 24 * sum(not np.isfinite(v) for v in values)       # each one's window
    assert (~np.isfinite(direct)).sum() == spread
    finite = np.isfinite(direct)
    close(got[finite], direct[finite].astype(np.float64))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_filter_with_nan_or_inf_runs_the_direct_kernel(layout, monkeypatch):
    x, w = data((2, 8, 9, 9), 8)
    w[2, 1, 0, 2], w[5, 0, 1, 1] = np.nan, np.inf
    g = geometry(x.shape, 8, (1, 1))
    stats = {}
    got = run(x, w, g, layout, stats=stats)
    assert stats == {"kernel": "direct"}
    monkeypatch.setenv(conv_native.WINOGRAD_ENV, "0")
    np.testing.assert_array_equal(got, run(x, w, g, layout))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("x_shape, o, paddings", SHAPES)
def test_every_tile_direct_is_still_the_convolution(layout, x_shape, o, paddings, monkeypatch):
    """WINOGRAD_RANGE 0 sends every tile with a non-zero input to the direct path:
    partial tiles at every edge, the epilogue, both layouts."""
    monkeypatch.setattr(conv_native, "WINOGRAD_RANGE", 0)
    x, w = data(x_shape, o)
    g = geometry(x_shape, o, paddings)
    b = rng.standard_normal(o).astype(np.float32)
    stats = {}
    got = run(x, w, g, layout, bias=b, relu=True, stats=stats)
    assert stats["direct_tiles"] == stats["tiles"]
    want = conv2d(x, w, paddings=paddings) + b.astype(np.float64).reshape(-1, 1, 1)
    close(got, np.maximum(want, 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_of_one_scale_computes_no_tile_directly(layout):
    """Realistic data - normal, post-ReLU (half zeros), a net's scale from 1e-3 to
    1e3 - takes no direct tile and stays within its float32 error (1e-3 of the largest
    output and better: the issue's bound)."""
    for scale in (1e-3, 1.0, 1e3):
        for relu in (False, True):
            x, w = data((4, 32, 16, 16), 32)
            x = (np.maximum(x, 0) if relu else x) * np.float32(scale)
            g = geometry(x.shape, 32, (1, 1))
            stats = {}
            got = run(x, w, g, layout, stats=stats)
            assert stats["direct_tiles"] == 0, (scale, relu)
            want = conv2d(x, w, paddings=(1, 1))
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_tiles_whose_window_holds_the_value_go_direct(layout):
    """One value 1e6, in one image: the tiles whose 6x6 windows hold it (the windows of
    neighbouring tiles overlap by 2: 1, 2 or 4 of them), no other; data without it:
    none."""
    x, w = data((2, 16, 12, 12), 24)
    g = geometry(x.shape, 24, (1, 1))
    for at, tiles in (((1, 3, 4), 4), ((0, 0, 0), 1), ((0, 3, 0), 2), ((1, 5, 6), 1)):
        y = x.copy()
        y[at[0], 3, at[1], at[2]] = 1e6
        stats = {}
        run(y, w, g, layout, stats=stats)
        assert stats == {"kernel": "winograd", "direct_tiles": tiles, "tiles": 18}, at
    stats = {}
    run(x, w, g, layout, stats=stats)
    assert stats["direct_tiles"] == 0


def test_the_training_and_fused_ops_keep_outputs_outside_a_large_value_alone():
    """conv2d (the training op) and fused_conv2d (the inference op, more scratch) both
    run Winograd with the guard: the 1e6 case through the op kernels."""
    x, w = data((4, 16, 8, 8), 16)
    w /= np.sqrt(9 * 16)
    clean = conv2d(x, w, paddings=(1, 1))
    x[0, 4, 3, 3] = 1e6
    outside = ~field_mask(clean.shape, (0, 3, 3), (1, 1))
    for layout in LAYOUTS:
        attrs = {"strides": (1, 1), "paddings": (1, 1), "dilations": (1, 1), "groups": 1,
                 "activation": "none", "data_layout": layout}
        xin = nhwc(x) if layout == "NHWC" else x
        for kernel in (conv2d_kernels.conv2d_cpu, conv2d_kernels.fused_conv2d_cpu):
            out = kernel(SimpleNamespace(attrs=attrs), {"x": xin, "filter": w}, None)["out"]
            out = nchw(out) if layout == "NHWC" else out
            close(out[outside], clean[outside])
