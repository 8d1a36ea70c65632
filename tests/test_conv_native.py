"""The native CPU conv kernels (kernels/cpu/conv_native.c) against the float64 reference:
the forward pass, the filter gradient and the input gradient on every geometry
the launchers take, the epilogue, the thread counts, bad inputs."""
import gc
import weakref

import numpy as np
import pytest
from references import conv2d, conv2d_grad
from thread_helpers import all_right_from_threads, run_in_forked_child

from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_native, conv_native_nhwc, native

rng = np.random.default_rng(7)

pytestmark = pytest.mark.skipif(not conv_native.available(),
                                reason=f"native kernels not built: {native.reason('conv_native')}")

# (x shape, filter shape, strides, paddings, dilations): stride 1 (one padded copy)
# and strided across (one copy per tap column), widths that are not multiples of 8,
# output channels that are not multiples of the tile's MR, padding past the filter's
# reach, one image (the output channels split between threads)
GEOMETRIES = [
    ((2, 3, 7, 9), (5, 3, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((4, 16, 32, 32), (16, 16, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((3, 4, 8, 8), (16, 4, 3, 3), (2, 2), (1, 1), (1, 1)),
    ((1, 2, 11, 13), (3, 2, 5, 5), (2, 2), (2, 2), (2, 2)),
    ((2, 8, 9, 17), (7, 8, 1, 1), (2, 2), (0, 0), (1, 1)),
    ((5, 1, 8, 8), (16, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 3, 6, 21), (9, 3, 2, 2), (3, 3), (0, 0), (1, 1)),
    ((1, 5, 10, 10), (6, 5, 3, 3), (1, 1), (0, 0), (2, 2)),
    ((2, 4, 5, 5), (4, 4, 3, 3), (1, 1), (3, 3), (1, 1)),
    ((3, 6, 12, 12), (10, 6, 3, 3), (2, 1), (1, 0), (1, 1)),
    ((2, 6, 12, 12), (4, 6, 3, 3), (1, 2), (0, 1), (1, 1)),
    ((1, 8, 4, 4), (9, 8, 1, 1), (1, 1), (0, 0), (1, 1)),
    ((2, 3, 3, 40), (2, 3, 3, 5), (1, 1), (1, 2), (1, 1)),
    # the recipe's convs (conv32 on 28x28, conv64 on 14x14) and output channels that
    # fill the filter gradient's tiles of one and two vectors (8 or 16 channels each)
    # in part: 17, 40
    ((3, 1, 28, 28), (32, 1, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 32, 14, 14), (64, 32, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 5, 7, 9), (40, 5, 3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 12, 9, 9), (17, 12, 3, 3), (2, 2), (1, 1), (1, 1)),
    # rows of at most 8 outputs, two to a vector with AVX-512: an odd number of them
    ((2, 5, 7, 7), (6, 5, 3, 3), (1, 1), (1, 1), (1, 1)),
    # stride 2 across: the input gradient's phases write every other value of rows of
    # 8 (16 wide) and of 19 and 18 (37 wide: a whole vector and a part)
    ((2, 5, 16, 16), (6, 5, 3, 3), (2, 2), (1, 1), (1, 1)),
    ((2, 3, 6, 37), (4, 3, 3, 3), (2, 2), (1, 1), (1, 1)),
    # 1x1 at stride 2 (the rows between never copied): rows of 16, 17 and 35 every
    # other value, one whole vector of 16 and none, one and two with a part after
    ((2, 3, 5, 32), (4, 3, 1, 1), (2, 2), (0, 0), (1, 1)),
    ((2, 2, 5, 34), (3, 2, 1, 1), (2, 2), (0, 0), (1, 1)),
    ((1, 2, 4, 70), (3, 2, 1, 1), (2, 2), (0, 0), (1, 1)),
]


@pytest.fixture(autouse=True)
def every_call_threaded(monkeypatch):
    """Small test convs run on as many threads as asked (MIN_THREAD_WORK would keep
    them on one)."""
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1)


def geometry(x_shape, w_shape, strides, paddings, dilations):
    return conv_cpu.geometry(x_shape, w_shape, strides, paddings, dilations, 1)


def reference(x, w, strides, paddings, dilations, bias=None, residual=None, relu=False):
    out = conv2d(x, w, strides=strides, paddings=paddings, dilations=dilations)
    if bias is not None:
        out = out + np.asarray(bias, np.float64).reshape(-1, 1, 1)
    if residual is not None:
        out = out + residual
    return np.maximum(out, 0.0) if relu else out


def close(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("x_shape, w_shape, strides, paddings, dilations", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_forward_against_the_float64_reference(x_shape, w_shape, strides, paddings, dilations,
                                               threads):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = geometry(x_shape, w_shape, strides, paddings, dilations)
    close(conv_native.forward(x, w, g, threads), reference(x, w, strides, paddings, dilations))


@pytest.mark.parametrize("x_shape, w_shape, strides, paddings, dilations", GEOMETRIES)
@pytest.mark.parametrize("bias, residual, relu", [
    (True, False, False), (True, True, True), (False, True, False), (False, False, True)])
def test_forward_epilogue(x_shape, w_shape, strides, paddings, dilations, bias, residual, relu):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = geometry(x_shape, w_shape, strides, paddings, dilations)
    b = rng.standard_normal(g.o).astype(np.float32) if bias else None
    r = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32) if residual else None
    got = conv_native.forward(x, w, g, 2, bias=b, residual=r, relu=relu)
    close(got, reference(x, w, strides, paddings, dilations, b, r, relu))


@pytest.mark.parametrize("x_shape, w_shape, strides, paddings, dilations", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gradients_against_the_float64_reference(x_shape, w_shape, strides, paddings,
                                                 dilations, threads):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = geometry(x_shape, w_shape, strides, paddings, dilations)
    d = rng.standard_normal((g.n, g.o, g.ho, g.wo)).astype(np.float32)
    dx_ref, dw_ref = conv2d_grad(x, w, d, strides=strides, paddings=paddings,
                                 dilations=dilations)
    close(conv_native.filter_grad(x, d, g, threads), dw_ref)
    close(conv_native.input_grad(w, d, g, threads), dx_ref)


def test_the_gradients_cover_every_kind_of_phase():
    """dx's phases among the geometries: stride 1 (one phase), every phase reached,
    phases no tap reaches (zeros), dout read from a later row or column (padding
    past the filter's reach) and with zeros before it, dilated sub-filters."""
    kinds = set()
    for x_shape, w_shape, strides, paddings, dilations in GEOMETRIES:
        g = geometry(x_shape, w_shape, strides, paddings, dilations)
        axes = ((g.h, g.kh, g.sh, g.ph, g.dh, g.ho), (g.w, g.kw, g.sw, g.pw, g.dw, g.wo))
        for size, k, stride, pad, dil, out in axes:
            phases = conv_native._phases(size, k, stride, pad, dil, out)
            kinds.add("stride 1" if stride == 1 else
                      "all phases" if len(phases) == min(stride, size) else "zero phases")
            kinds.update("sliced" if first > 0 else "padded" for _, _, first, _, _ in phases
                         if first)
            kinds.update("dilated" for _, _, _, step, _ in phases if step > 1)
    assert kinds == {"stride 1", "all phases", "zero phases", "sliced", "padded", "dilated"}


def test_results_do_not_depend_on_the_threads():
    """Each output is summed by one thread, in one order; each thread's filter
    gradient over a fixed range of images, added in thread order (so one thread
    count gives one result)."""
    x = rng.standard_normal((3, 16, 16, 16)).astype(np.float32)
    w = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
    g = geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    d = rng.standard_normal((3, 32, 16, 16)).astype(np.float32)
    one = conv_native.forward(x, w, g, 1)
    for threads in (2, 3, 5, 64, 1000):
        np.testing.assert_array_equal(conv_native.forward(x, w, g, threads), one)
    for threads in (1, 2, 3):
        np.testing.assert_array_equal(conv_native.filter_grad(x, d, g, threads),
                                      conv_native.filter_grad(x, d, g, threads))


def test_small_convs_stay_on_one_thread(monkeypatch):
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1000)
    g = geometry((2, 4, 5, 5), (4, 4, 3, 3), (1, 1), (1, 1), (1, 1))   # 7200 multiply-adds
    assert conv_native._threads(g, 16) == 7
    assert conv_native._threads(g, 2) == 2
    assert conv_native._threads(g._replace(n=0), 2) == 1


def test_relu_keeps_nan_and_zeroes_negatives():
    """relu as np.maximum(., 0): NaN stays NaN (in full vectors and in a row's tail)."""
    x = np.zeros((1, 1, 2, 11), np.float32)
    x[0, 0, 0, 3] = x[0, 0, 1, 9] = np.nan
    x[0, 0, 0, 5] = x[0, 0, 1, 10] = -2.0
    w = np.ones((1, 1, 1, 1), np.float32)
    g = geometry(x.shape, w.shape, (1, 1), (0, 0), (1, 1))
    out = conv_native.forward(x, w, g, 2, relu=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(x))
    assert out[0, 0, 0, 5] == 0.0 and out[0, 0, 1, 10] == 0.0


def test_inputs_that_are_views_or_other_dtypes_are_copied_not_misread():
    x = rng.standard_normal((2, 3, 10, 12))
    w = rng.standard_normal((4, 3, 3, 3))
    view = x.astype(np.float32)[:, :, ::2, 1:]          # not C-contiguous
    g = geometry(view.shape, w.shape, (1, 1), (1, 1), (1, 1))
    close(conv_native.forward(view, w, g, 2), reference(view, w, (1, 1), (1, 1), (1, 1)))


def test_wrong_shapes_are_an_error_naming_the_argument():
    x = np.zeros((2, 3, 8, 8), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    g = geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match=r"conv_native: x has shape \(2, 3, 8, 7\), expected"):
        conv_native.forward(x[..., :7], w, g, 1)
    with pytest.raises(ValueError, match=r"conv_native: bias has shape \(3,\), expected \(4,\)"):
        conv_native.forward(x, w, g, 1, bias=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="conv_native: residual has shape"):
        conv_native.forward(x, w, g, 1, residual=np.zeros((2, 4, 8, 7), np.float32))
    with pytest.raises(ValueError, match=r"conv_native: dout has shape \(2, 4, 8, 7\)"):
        conv_native.filter_grad(x, np.zeros((2, 4, 8, 7), np.float32), g, 1)


def test_empty_batch():
    x = np.zeros((0, 3, 8, 8), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    g = geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    d = np.zeros((0, 4, 8, 8), np.float32)
    assert conv_native.forward(x, w, g, 2).shape == (0, 4, 8, 8)
    np.testing.assert_array_equal(conv_native.filter_grad(x, d, g, 2), np.zeros(w.shape))
    assert conv_native.input_grad(w, d, g, 2).shape == (0, 3, 8, 8)


def test_supports_float32_convs_of_one_group():
    g = geometry((1, 4, 4, 4), (4, 4, 3, 3), (1, 1), (1, 1), (1, 1))
    assert conv_native.supports(g, np.float32)
    assert not conv_native.supports(g, np.float64)
    assert not conv_native.supports(g._replace(groups=2), np.float32)
    wide = geometry((1, 1, 4, 200), (1, 1, 1, 70), (1, 65), (0, 0), (1, 1))
    assert conv_native.supports(wide._replace(kw=64), np.float32)        # 64 phases
    assert not conv_native.supports(wide, np.float32)                    # 65


def test_calls_from_several_threads_at_once():
    """One call at a time uses the kernels' worker pool; the others start threads of
    their own: every result is right."""
    x = rng.standard_normal((4, 8, 12, 12)).astype(np.float32)
    w = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    g = geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1))
    want = conv_native.forward(x, w, g, 1)
    assert all_right_from_threads(lambda: np.array_equal(conv_native.forward(x, w, g, 2), want))


def _forked_conv(queue):
    x = np.ones((4, 2, 6, 6), np.float32)
    w = np.ones((3, 2, 3, 3), np.float32)
    g = geometry(x.shape, w.shape, (1, 1), (0, 0), (1, 1))
    queue.put(float(conv_native.forward(x, w, g, 3).sum()))


def test_a_forked_child_runs_threaded_convs():
    """The worker pool's threads are not in a forked child: it starts its own
    (the test fails by its timeout if the child waits on the parent's)."""
    x = rng.standard_normal((4, 2, 6, 6)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    conv_native.forward(x, w, geometry(x.shape, w.shape, (1, 1), (0, 0), (1, 1)), 3)
    code, got = run_in_forked_child(_forked_conv)
    assert code == 0
    assert got == 4 * 3 * 4 * 4 * 18.0


def winograd_run(x, w, g, layout, **kwargs):
    """Winograd's forward pass (whatever its scratch) in `layout`, NCHW in and out."""
    if layout == "NHWC":
        out = conv_native_nhwc.forward(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), w, g, 2,
                                       max_scratch=float("inf"), **kwargs)
        return out.transpose(0, 3, 1, 2)
    return conv_native.forward(x, w, g, 2, max_scratch=float("inf"), **kwargs)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("c, o", [(8, 5), (16, 16), (17, 33), (64, 64)])
def test_a_fixed_filter_is_transformed_once_with_the_same_bits(layout, c, o):
    """fused_conv2d's filters (fixed=True): Winograd's transform of the filter is made at
    the first call and kept; the outputs are those of a transform made per call."""
    x = rng.standard_normal((3, c, 10, 9)).astype(np.float32)
    w = rng.standard_normal((o, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    g = conv_cpu.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1)
    stats = {}
    made = winograd_run(x, w, g, layout, bias=b, relu=True, stats=stats)
    assert stats["kernel"] == "winograd"
    kept = winograd_run(x, w, g, layout, bias=b, relu=True, fixed=True)
    np.testing.assert_array_equal(kept, made)
    ref, made_for, transform = conv_native._transforms[id(w)]
    assert ref() is w and made_for == (native.build_key("conv_native"), w.shape)
    assert not w.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        w[0, 0, 0, 0] = 1.0
    again = winograd_run(x, w, g, layout, bias=b, relu=True, fixed=True)
    np.testing.assert_array_equal(again, made)
    assert conv_native._transforms[id(w)][2] is transform        # not made again


def test_a_fixed_filter_made_writeable_again_is_transformed_again():
    x = rng.standard_normal((2, 8, 8, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    g = conv_cpu.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1)
    winograd_run(x, w, g, "NCHW", fixed=True)
    w.flags.writeable = True
    w *= -3.0
    got = winograd_run(x, w, g, "NCHW", fixed=True)
    np.testing.assert_array_equal(got, winograd_run(x, w.copy(), g, "NCHW"))
    assert not w.flags.writeable


def test_a_fixed_filter_with_nan_runs_the_direct_kernel():
    """A filter holding a NaN or an infinity is kept as such (no transform): each call
    then runs the direct kernel, as an unkept one does."""
    x = rng.standard_normal((2, 8, 9, 9)).astype(np.float32)
    w = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    w[3, 2, 1, 0] = np.nan
    g = conv_cpu.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1)
    for _ in range(2):
        stats = {}
        got = winograd_run(x, w, g, "NCHW", fixed=True, stats=stats)
        assert stats == {"kernel": "direct"}
    assert conv_native._transforms[id(w)][2] is None
    np.testing.assert_array_equal(got, conv_native.forward(x, w, g, 2, max_scratch=0.0))


def test_a_freed_filter_lets_go_of_its_transform():
    x = np.ones((1, 8, 6, 6), np.float32)
    w = np.ones((8, 8, 3, 3), np.float32)
    g = conv_cpu.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1)
    winograd_run(x, w, g, "NCHW", fixed=True)
    transform = weakref.ref(conv_native._transforms[id(w)][2])
    del w
    gc.collect()
    assert transform() is None      # weak references: another array may take w's id
    assert all(entry[0]() is not None for entry in conv_native._transforms.values())


def test_a_fixed_filter_reshaped_in_place_is_transformed_again():
    x = rng.standard_normal((2, 16, 8, 8)).astype(np.float32)
    w = rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    g = conv_cpu.geometry(x.shape, w.shape, (1, 1), (1, 1), (1, 1), 1)
    winograd_run(x, w, g, "NCHW", fixed=True)
    w.shape = (16, 8, 3, 3)                  # the same values, other channel counts
    x8 = np.ascontiguousarray(x[:, :8])
    g8 = conv_cpu.geometry(x8.shape, w.shape, (1, 1), (1, 1), (1, 1), 1)
    got = winograd_run(x8, w, g8, "NCHW", fixed=True)
    np.testing.assert_array_equal(got, winograd_run(x8, w.copy(), g8, "NCHW"))
