"""conv2d: strides, paddings, dilations, groups, non-square filters."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import conv2d
from references import conv2d_grad as conv2d_grad_reference

import minigraph as mg
from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_im2col_grad as conv_cpu_grad

rng = np.random.default_rng(0)


def conv_reference(x, filter, **attrs):
    """references.conv2d, called as helper_test_op calls a reference."""
    return {"out": conv2d(x, filter, **attrs)}


CASES = [
    ((2, 3, 5, 5), (4, 3, 3, 3), {}),
    ((2, 3, 6, 7), (4, 3, 3, 3), {"strides": 2, "paddings": 1}),
    ((1, 2, 7, 7), (3, 2, 3, 3), {"dilations": 2, "paddings": (2, 1)}),
    ((2, 4, 5, 6), (6, 2, 3, 3), {"groups": 2, "paddings": 1}),
    ((1, 4, 5, 5), (4, 1, 2, 2), {"groups": 4, "strides": (2, 1)}),
    ((2, 2, 5, 7), (3, 2, 2, 3), {"strides": (1, 2), "paddings": (1, 0), "dilations": (2, 1)}),
    # the CPU engine's paths: 1x1 (x itself as columns), strided 1x1, flat columns with
    # padding and dilation on odd sizes, a 3x1 filter (no dropped columns), padding > 1
    ((3, 4, 5, 6), (6, 2, 1, 1), {"groups": 2}),
    ((2, 4, 7, 7), (3, 4, 1, 1), {"strides": 2}),
    ((3, 3, 9, 11), (5, 3, 3, 2), {"paddings": (2, 1), "dilations": (2, 3)}),
    ((2, 3, 6, 5), (4, 3, 3, 1), {"paddings": (1, 0)}),
    ((3, 2, 5, 5), (2, 2, 3, 3), {"paddings": 2, "strides": (2, 3)}),
    # padding beyond the filter's reach along one axis only (dx through col2im)
    ((2, 2, 5, 6), (3, 2, 3, 1), {"paddings": (0, 1)}),
    # taps whose every window reads padding only (their gradient adds nothing to dx)
    ((2, 2, 1, 2), (3, 2, 3, 3), {"paddings": 2, "strides": 3}),
    ((2, 3, 5, 5), (3, 3, 1, 1), {"paddings": 1}),
    # stride 1 with fewer column rows than output channels: strided, not flat, columns
    ((2, 1, 5, 6), (6, 1, 2, 2), {"paddings": 1}),
    ((2, 2, 5, 5), (8, 1, 1, 3), {"groups": 2, "paddings": (0, 1)}),
    # "same" padding (flat columns from the unpadded planes): dilated, 5x5 in groups,
    # a 3x5 filter dilated along one axis
    ((2, 3, 6, 7), (4, 3, 3, 3), {"dilations": 2, "paddings": 2}),
    ((2, 4, 6, 5), (4, 2, 5, 5), {"paddings": 2, "groups": 2}),
    ((2, 3, 5, 9), (4, 3, 3, 5), {"paddings": (1, 4), "dilations": (1, 2)}),
]


def engine_geometry(x_shape, w_shape, attrs):
    """The CPU engine's Geometry of a case."""
    a = {k: (v, v) if isinstance(v, int) and k != "groups" else v for k, v in attrs.items()}
    return conv_cpu.geometry(x_shape, w_shape, a.get("strides", (1, 1)),
                             a.get("paddings", (0, 0)), a.get("dilations", (1, 1)),
                             a.get("groups", 1))


def test_both_column_layouts_are_covered():
    """Stride-1 cases take flat columns when C/G kh kw >= O/G, else strided ones."""
    layouts = set()
    for x_shape, w_shape, attrs in CASES:
        g = engine_geometry(x_shape, w_shape, attrs)
        if g.unit_stride and not g.pointwise:
            layouts.add(g.flat)
            assert g.flat == (w_shape[1] * g.taps >= w_shape[0] // g.groups)
    assert layouts == {True, False}


def test_flat_columns_from_padded_and_unpadded_planes_are_covered():
    """Flat columns come from the unpadded planes exactly when the output is the
    input's size ("same" padding)."""
    kinds = set()
    for x_shape, w_shape, attrs in CASES:
        g = engine_geometry(x_shape, w_shape, attrs)
        if g.flat:
            kinds.add(g.same)
            assert g.same == ((g.ho, g.wo) == x_shape[2:])
    assert kinds == {True, False}


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_forward_and_grads(x_shape, w_shape, attrs):
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference,
                   grad_wrt=("x", "filter"))


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_float32(x_shape, w_shape, attrs, cpu_engine):
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
@pytest.mark.parametrize("wanted", [("dx", "dfilter"), ("dx",), ("dfilter",)])
def test_conv2d_grad_float32(x_shape, w_shape, attrs, wanted, cpu_engine):
    """conv2d_grad on float32 against the float64 reference, both gradients or one:
    the native kernels where they take the conv (depthwise convs on conv_depthwise,
    other grouped convs on conv_cpu), else conv_cpu."""
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    want_out = conv_reference(x, w, **attrs)["out"]
    d = rng.standard_normal(want_out.shape).astype("float32")
    scope = mg.Scope()
    slots = {name: scope.new_var(name) for name in ("x", "filter", "dout", *wanted)}
    for name, value in (("x", x), ("filter", w), ("dout", d)):
        slots[name].set(value)
    mg.Executor(mg.CPUPlace()).run([mg.Operator("conv2d_grad", **slots, **attrs)], scope)
    want = dict(zip(("dx", "dfilter"), conv2d_grad_reference(x, w, d, **attrs)))
    for name in wanted:
        got = slots[name].get()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want[name], rtol=1e-4,
                                   atol=1e-5 * max(1.0, np.abs(want[name]).max()))


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_one_image_per_chunk(x_shape, w_shape, attrs, monkeypatch):
    """The CPU engine works on chunks of images; with one image per chunk every
    chunk boundary is crossed."""
    monkeypatch.setattr(conv_cpu, "CHUNK_BYTES", 1)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference,
                   grad_wrt=("x", "filter"))


def paired(g):
    """True when the engine takes dx and dfilter of `g` from the same columns."""
    gd = conv_cpu_grad._dx_geometry(g)
    return gd is not None and conv_cpu_grad._paired(gd)


def test_both_gradient_pairings_are_covered():
    """Some cases take dx and dfilter from the same columns, others apart."""
    assert {paired(engine_geometry(*case)) for case in CASES} == {True, False}


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_gradients_apart(x_shape, w_shape, attrs, monkeypatch):
    """With the pairing off, dx and dfilter each take their own path (dx's conv,
    dfilter through the columns), as when only one is wanted."""
    monkeypatch.setattr(conv_cpu_grad, "_paired", lambda gd: False)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference,
                   grad_wrt=("x", "filter"))


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_one_gradient_alone(x_shape, w_shape, attrs):
    """dx alone and dfilter alone equal the pair."""
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    g = engine_geometry(x_shape, w_shape, attrs)
    out = conv_cpu.forward(x, w, g)
    d = rng.standard_normal(out.shape)
    dx, dw = conv_cpu_grad.backward(x, w, d, g)
    only_dx, none = conv_cpu_grad.backward(x, w, d, g, need_dw=False)
    none2, only_dw = conv_cpu_grad.backward(x, w, d, g, need_dx=False)
    assert none is None and none2 is None
    np.testing.assert_allclose(only_dx, dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(only_dw, dw, rtol=1e-12, atol=1e-12)


def test_conv2d_work_arrays_full_of_other_values():
    """The column and gradient buffers are made with np.empty, which may hand back
    the blocks earlier calls freed (full of their values): a small conv after a
    large one is still exact."""
    ex = mg.Executor(mg.CPUPlace())
    for x_shape, w_shape, attrs in CASES[:3] + CASES[::-1]:
        scope = mg.Scope()
        xv, wv, out = scope.new_var("x"), scope.new_var("w"), scope.new_var("out")
        x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
        xv.set(x)
        wv.set(w)
        op = mg.Operator("conv2d", x=xv, filter=wv, out=out, **attrs)
        ex.run([op], scope)
        np.testing.assert_allclose(out.get(), conv_reference(x, w, **attrs)["out"],
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_engine_keeps_no_memory_between_calls(x_shape, w_shape, attrs, monkeypatch):
    """The engine's work arrays (columns, padded chunk, products), shared by the
    chunks of one call, are freed when it returns: none outlives the call."""
    import weakref

    made = []
    plain = conv_cpu.Work.array

    def spy(self, name, dtype, shape):
        view = plain(self, name, dtype, shape)
        made.append(weakref.ref(view.base if view.base is not None else view))
        return view

    monkeypatch.setattr(conv_cpu.Work, "array", spy)
    monkeypatch.setattr(conv_cpu, "CHUNK_BYTES", 256)       # several chunks
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    g = engine_geometry(x_shape, w_shape, attrs)
    out = conv_cpu.forward(x, w, g)
    conv_cpu_grad.backward(x, w, out, g)
    if not g.pointwise:
        assert made                                  # the engine used work arrays
    assert all(r() is None for r in made)


@pytest.mark.parametrize("x_shape, w_shape, attrs, chunk_bytes", [
    ((16, 64, 8, 8), (64, 64, 3, 3), {"paddings": 1}, 1 << 21),     # lean: capped by x's size
    ((16, 32, 16, 16), (64, 32, 3, 3), {"paddings": 1, "strides": 2}, 1 << 21),
    ((16, 16, 32, 32), (16, 16, 3, 3), {"paddings": 1}, 1 << 20),    # by CHUNK_BYTES
    ((16, 1, 8, 8), (16, 1, 3, 3), {"paddings": 1}, 1 << 21),        # tiny: LEAN_FLOOR_BYTES
])
def test_conv2d_work_arrays_stay_within_budget(x_shape, w_shape, attrs, chunk_bytes,
                                               monkeypatch):
    """Every call's columns take about CHUNK_BYTES (at most, and more than half unless
    the batch is smaller); a lean call's (conv2d's forward pass and the gradients)
    work arrays together also no more than INPUT_MULTIPLE times x's size or
    LEAN_FLOOR_BYTES (the step's peak memory comes from them)."""
    calls = {}
    plain = conv_cpu.Work.array

    def spy(self, name, dtype, shape):
        view = plain(self, name, dtype, shape)
        calls.setdefault(self, {})[name] = view.base.nbytes     # keeps each Work apart
        return view

    monkeypatch.setattr(conv_cpu.Work, "array", spy)
    monkeypatch.setattr(conv_cpu, "CHUNK_BYTES", chunk_bytes)
    x = rng.standard_normal(x_shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    g = engine_geometry(x_shape, w_shape, attrs)
    out = conv_cpu.forward(x, w, g)
    (forward_work,) = calls.values()
    all_cols = x.itemsize * g.c * g.taps * g.length * g.n
    assert min(all_cols, chunk_bytes) / 2 < forward_work["cols"] <= chunk_bytes
    calls.clear()
    conv_cpu.forward(x, w, g, lean=True)                # conv2d's own forward pass
    conv_cpu_grad.backward(x, w, out, g)
    cap = max(conv_cpu.LEAN_FLOOR_BYTES, conv_cpu.INPUT_MULTIPLE * x.nbytes)
    budget = min(chunk_bytes, cap)
    totals = [sum(c.values()) for c in calls.values()]
    assert totals and max(totals) <= cap
    assert all(c.get("cols", 0) <= chunk_bytes for c in calls.values())
    assert max(totals) > min(budget, all_cols) / 2                  # not needlessly small
    want = conv_reference(x.astype(np.float64), w.astype(np.float64), **attrs)["out"]
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_reserved_bytes_count_against_the_lean_budget():
    """Arrays a call keeps beside its work arrays (the paired gradients' flipped filter
    and dfilter sums) shrink its lean chunks so that all of them fit the budget."""
    g = engine_geometry((32, 64, 8, 8), (64, 64, 3, 3), {"paddings": 1})
    size = 4
    per_image = (g.c * g.taps * g.length + g.c * g.hp * g.wp + g.o * g.length) * size
    cap = max(conv_cpu.LEAN_FLOOR_BYTES, conv_cpu.INPUT_MULTIPLE * g.n * g.c * g.h * g.w * size)
    full = conv_cpu.chunk_size(g, np.float32, lean=True)
    reserved = 300_000
    less = conv_cpu.chunk_size(g, np.float32, lean=True, reserved=reserved)
    assert less < full and full * per_image <= cap
    assert less * per_image + reserved <= cap < (less + 1) * per_image + reserved
    assert conv_cpu.chunk_size(g, np.float32, lean=False, reserved=reserved) >= full


def test_conv2d_attrs_stored_as_pairs():
    scope = mg.Scope()
    x, w = scope.new_var("x"), scope.new_var("w")
    x.declare((-1, 1, 8, 8), "float32")
    w.declare((16, 1, 3, 3), "float32")
    op = mg.Operator("conv2d", x=x, filter=w, out=scope.new_var("out"), strides=1,
                     paddings=[1, 1], dilations=np.int64(1))
    assert (op.attrs["strides"], op.attrs["paddings"], op.attrs["dilations"]) == \
        ((1, 1), (1, 1), (1, 1))
    assert op.outputs["out"].decl_shape == (-1, 16, 8, 8)


def build_conv(x_shape, w_shape, **attrs):
    scope = mg.Scope()
    x, w = scope.new_var("x"), scope.new_var("w")
    x.declare(x_shape, "float32")
    w.declare(w_shape, "float32")
    return mg.Operator("conv2d", x=x, filter=w, out=scope.new_var("out"), **attrs)


@pytest.mark.parametrize("x_shape, w_shape, attrs, match", [
    ((2, 3, 8, 8), (4, 2, 3, 3), {},
     r"conv2d: input 'filter' must have 3 input channels .* with 3 channels and groups=1"),
    ((2, 4, 8, 8), (4, 4, 3, 3), {"groups": 2}, r"input 'filter' must have 2 input channels"),
    ((2, 3, 8, 8), (4, 1, 3, 3), {"groups": 2}, "input 'x' has 3 channels .* groups=2"),
    ((2, 4, 8, 8), (3, 2, 3, 3), {"groups": 2}, "input 'filter' has 3 output channels"),
    ((2, 3, 2, 8), (4, 3, 3, 3), {}, "output height would be 0"),
    ((2, 3, 8, 8), (4, 3, 3, 3), {"dilations": (1, 5)},
     "output width would be -2: .* smaller than the dilated filter 11"),
    ((2, 3, 8), (4, 3, 3, 3), {}, "input 'x' must have rank 4, got rank 3"),
    ((2, 3, 8, 8), (4, 3, 3, 3), {"strides": 0}, "attribute 'strides' must be >= 1"),
    ((2, 3, 8, 8), (4, 3, 3, 3), {"paddings": (1, 1, 1)}, "'paddings' must be an int or a pair"),
    ((2, 3, 8, 8), (4, 3, 3, 3), {"groups": 0}, "attribute 'groups' must be > 0"),
])
def test_conv2d_bad_inputs(x_shape, w_shape, attrs, match):
    with pytest.raises(mg.OpError, match=match):
        build_conv(x_shape, w_shape, **attrs)


# ---- channels last (data_layout="NHWC") --------------------------------------------

def nhwc_case(x_shape, attrs):
    """A case's x shape (N, C, H, W) as NHWC, and its attributes with data_layout."""
    n, c, h, w = x_shape
    return (n, h, w, c), {**attrs, "data_layout": "NHWC"}


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
def test_conv2d_nhwc_forward_and_grads(x_shape, w_shape, attrs):
    """The numpy NHWC engine (float64) against the reference, gradients by finite
    differences: every geometry of the NCHW cases."""
    shape, attrs = nhwc_case(x_shape, attrs)
    x, w = rng.standard_normal(shape), rng.standard_normal(w_shape)
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference,
                   grad_wrt=("x", "filter"))


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES)
@pytest.mark.parametrize("wanted", [("dx", "dfilter"), ("dx",), ("dfilter",)])
def test_conv2d_nhwc_float32_forward_and_grads(x_shape, w_shape, attrs, wanted):
    """float32 NHWC through the op: the native NHWC kernels where they take the conv
    (one group), else the numpy NHWC engine; against the float64 reference."""
    shape, attrs = nhwc_case(x_shape, attrs)
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal(w_shape).astype("float32")
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference, atol=1e-5, rtol=1e-4)
    want_out = conv_reference(x, w, **attrs)["out"]
    d = rng.standard_normal(want_out.shape).astype("float32")
    scope = mg.Scope()
    slots = {name: scope.new_var(name) for name in ("x", "filter", "dout", *wanted)}
    for name, value in (("x", x), ("filter", w), ("dout", d)):
        slots[name].set(value)
    mg.Executor(mg.CPUPlace()).run([mg.Operator("conv2d_grad", **slots, **attrs)], scope)
    want = dict(zip(("dx", "dfilter"), conv2d_grad_reference(x, w, d, **attrs)))
    for name in wanted:
        got = slots[name].get()
        assert got.dtype == np.float32 and got.shape == want[name].shape
        np.testing.assert_allclose(got, want[name], rtol=1e-4,
                                   atol=1e-5 * max(1.0, np.abs(want[name]).max()))


def test_conv2d_nhwc_shapes_and_attributes():
    op = build_conv((-1, 8, 9, 3), (16, 3, 3, 3), paddings=1, strides=(1, 2),
                    data_layout="NHWC")
    assert op.attrs["data_layout"] == "NHWC"
    assert op.outputs["out"].decl_shape == (-1, 8, 5, 16)
    assert build_conv((-1, 3, 8, 9), (16, 3, 3, 3)).attrs["data_layout"] == "NCHW"
    with pytest.raises(mg.OpError, match="attribute 'data_layout' must be one of 'NCHW', "
                                         "'NHWC'"):
        build_conv((2, 3, 8, 8), (4, 3, 3, 3), data_layout="CHWN")
    with pytest.raises(mg.OpError, match="conv2d: input 'filter' must have 8 input channels"):
        build_conv((2, 3, 8, 8), (4, 3, 3, 3), data_layout="NHWC")     # 8 channels last


def test_conv2d_on_zero_channels_is_an_error_at_run_time_too():
    """A channel count unknown when the net is built (-1) is checked on the fed array:
    0 channels was a ZeroDivisionError or an empty product."""
    for layout, declared, fed in (("NCHW", (-1, -1, 5, 5), (2, 0, 5, 5)),
                                  ("NHWC", (-1, 5, 5, -1), (2, 5, 5, 0))):
        scope = mg.Scope()
        x, w, out = scope.new_var("x"), scope.new_var("w"), scope.new_var("out")
        x.declare(declared, "float32")
        w.declare((4, -1, 3, 3), "float32")
        layout_attr = {} if layout == "NCHW" else {"data_layout": layout}
        op = mg.Operator("conv2d", x=x, filter=w, out=out, **layout_attr)
        x.set(np.zeros(fed, np.float32))
        w.set(np.zeros((4, 0, 3, 3), np.float32))
        with pytest.raises(mg.OpError, match=r"conv2d: input 'x' has 0 channels \(shape "
                                             rf"\({fed[0]}, .*\), {layout}\)"):
            mg.Executor(mg.CPUPlace()).run([op], scope)
