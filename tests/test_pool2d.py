"""pool2d: max and avg, padding, strides != ksize, non-square windows, global pooling."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import pool2d

import minigraph as mg
from minigraph.kernels.cpu import pool2d as pool_kernels
from minigraph.ops import pool2d as pool_schema

rng = np.random.default_rng(0)


def pool_reference(x, **attrs):
    """references.pool2d, called as helper_test_op calls a reference."""
    return {"out": pool2d(x, **attrs)}


CASES = [
    {},                                                              # 2x2, strides = ksize
    {"pool_type": "avg"},
    {"ksize": 3, "strides": 1},
    {"pool_type": "avg", "ksize": 3, "strides": 2, "paddings": 1},
    {"pool_type": "max", "ksize": 3, "strides": 2, "paddings": 1},
    {"pool_type": "max", "ksize": (2, 3), "strides": (1, 2), "paddings": (1, 0)},
    {"pool_type": "avg", "ksize": (3, 2), "strides": (2, 1), "paddings": (1, 1)},
    {"global_pooling": True},
    {"global_pooling": True, "pool_type": "avg"},
]


@pytest.mark.parametrize("attrs", CASES)
def test_pool2d_forward_and_grad(attrs):
    x = rng.permutation(2 * 3 * 5 * 6).reshape(2, 3, 5, 6) / 10.0    # distinct: no max ties
    helper_test_op("pool2d", {"x": x}, attrs, pool_reference, grad_wrt=("x",))


@pytest.mark.parametrize("attrs", CASES)
def test_pool2d_float32(attrs):
    x = rng.standard_normal((2, 3, 7, 8)).astype("float32")
    helper_test_op("pool2d", {"x": x}, attrs, pool_reference)


@pytest.mark.parametrize("attrs, dtype", [
    ({}, "float32"), ({}, "float64"), ({"data_layout": "NHWC"}, "float32"),
    ({"global_pooling": True, "pool_type": "avg"}, "float32"),
    ({"pool_type": "avg"}, "float32"),
    ({"pool_type": "avg", "ksize": 3, "strides": 2, "paddings": 1}, "float32")])
def test_native_poolings_run_bound(attrs, dtype):
    """2x2 max windows that tile the plane and float32 NCHW average pooling (global or
    not) have a bound form (minigraph.bound_run): the kernel's bits into the same array
    every run, new values in the same input array read anew; other poolings have none."""
    from minigraph.kernels.cpu import pool_native

    if not pool_native.available():
        pytest.skip("native kernels not built here")
    r = np.random.default_rng(1)
    shape = (2, 8, 10, 3) if attrs.get("data_layout") == "NHWC" else (2, 3, 8, 10)
    x = r.standard_normal(shape).astype(dtype)
    helper_test_op("pool2d", {"x": x}, attrs, pool_reference)
    scope = mg.Scope()
    op = mg.Operator("pool2d", x=scope.new_var("x"), out=scope.new_var("out"), **attrs)
    run = pool_kernels.bind_pool2d(op)
    first = run({"x": x})["out"]
    for values in (x, x * 0.5 + 0.25, r.standard_normal(shape).astype(dtype)):
        if values is not x:
            x[...] = values                              # the same array, new values
        got = run({"x": x})["out"]
        assert got is first and got.tobytes() == pool_kernels.pool2d_cpu(
            op, {"x": x}, None)["out"].tobytes()
    for i, other in enumerate(({"pool_type": "avg", "data_layout": "NHWC"},
                               {"ksize": 3, "strides": 1}, {"global_pooling": True})):
        op = mg.Operator("pool2d", x=scope.new_var(f"x{i}"), out=scope.new_var(f"o{i}"),
                         **other)
        assert pool_kernels.bind_pool2d(op) is None


@pytest.mark.parametrize("attrs", [a for a in CASES if a.get("pool_type") == "avg"]
                         + [{"pool_type": "avg", "data_layout": "NHWC"}])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_average_gradient_reads_only_the_shape_of_x(attrs, dtype):
    """pool2d_grad declares x shape-only for average pooling (a training step then gives
    it the executor's zero-stride stand-in): the gradient from a stand-in has the bits
    of the gradient from x's values, on the native kernel and numpy's; max pooling
    reads the values."""
    scope = mg.Scope()
    op = mg.Operator("pool2d_grad", x=scope.new_var("x"), dout=scope.new_var("d"),
                     dx=scope.new_var("dx"), **attrs)
    assert not op.schema.inputs[0].reads_values(op.attrs)
    r = np.random.default_rng(4)
    shape = (2, 7, 8, 3) if attrs.get("data_layout") == "NHWC" else (2, 3, 7, 8)
    x = r.standard_normal(shape).astype(dtype)
    out = pool_kernels.pool2d_cpu(mg.Operator("pool2d", x=scope.new_var("x2"),
                                              out=scope.new_var("o2"), **attrs),
                                  {"x": x}, None)["out"]
    d = r.standard_normal(out.shape).astype(dtype)
    stand_in = np.broadcast_to(np.zeros((), dtype), shape)
    want = pool_kernels.pool2d_grad_cpu(op, {"x": x, "dout": d}, None)["dx"]
    got = pool_kernels.pool2d_grad_cpu(op, {"x": stand_in, "dout": d}, None)["dx"]
    assert got.flags.c_contiguous and got.tobytes() == want.tobytes()
    op_max = mg.Operator("pool2d_grad", x=scope.new_var("x3"), dout=scope.new_var("d3"),
                         dx=scope.new_var("dx3"), pool_type="max")
    assert op_max.schema.inputs[0].reads_values(op_max.attrs)


def test_max_grad_goes_to_first_max_of_each_window():
    x = np.ones((1, 1, 2, 4))
    x[0, 0, 1, 3] = 0.0
    scope = mg.Scope()
    xv, out, dout = scope.new_var("x"), scope.new_var("out"), scope.new_var("dout")
    xv.set(x)
    op = mg.Operator("pool2d", x=xv, out=out)
    dx = scope.new_var("dx")
    (desc,) = op.schema.grad(op, {"out": dout}, lambda v: dx if v is xv else None)
    dout.set(np.array([[[[1.0, 2.0]]]]))
    mg.Executor().run([op, mg.Operator(desc.type, **desc.kwargs)], scope)
    np.testing.assert_array_equal(dx.get(), [[[[1, 0, 2, 0], [0, 0, 0, 0]]]])


def max_grad_loops(x, d, ksize, strides, paddings):
    """dx of max pooling by loops: each window's dout goes to its first tap, replaced by
    a later tap only where strictly greater (padding is -inf), summed over windows."""
    (kh, kw), (sh, sw), (ph, pw) = ksize, strides, paddings
    n, c, h, w = x.shape
    ho, wo = d.shape[2:]
    dx = np.zeros(x.shape)
    for b in range(n):
        for ch in range(c):
            for i in range(ho):
                for j in range(wo):
                    best, at = None, None
                    for a in range(kh):
                        for e in range(kw):
                            r, q = i * sh + a - ph, j * sw + e - pw
                            v = x[b, ch, r, q] if 0 <= r < h and 0 <= q < w else -np.inf
                            if best is None or v > best:
                                best, at = v, (r, q)
                    if 0 <= at[0] < h and 0 <= at[1] < w:
                        dx[b, ch, at[0], at[1]] += d[b, ch, i, j]
    return dx


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("attrs", [
    {"ksize": (2, 2), "strides": (2, 2), "paddings": (0, 0)},       # windows apart
    {"ksize": (3, 3), "strides": (1, 1), "paddings": (0, 0)},       # overlapping
    {"ksize": (3, 2), "strides": (2, 1), "paddings": (1, 1)},       # overlapping, padded
])
def test_max_grad_ties_nans_and_infinite_douts(dtype, attrs):
    """Ties go to the first tap, a NaN never displaces an earlier value (nor is
    displaced when first), and a window's dout reaches only its chosen element: an
    infinite dout leaves every other element exactly +0.0."""
    x = rng.integers(0, 3, (2, 2, 5, 6)).astype(dtype)    # many ties
    x[0, 0, 1, 1] = x[1, 1, 0, 0] = np.nan
    scope = mg.Scope()
    xv, out, dout, dx = (scope.new_var(n) for n in ("x", "out", "dout", "dx"))
    xv.set(x)
    op = mg.Operator("pool2d", x=xv, out=out, **attrs)
    (desc,) = op.schema.grad(op, {"out": dout}, lambda v: dx if v is xv else None)
    mg.Executor().run([op], scope)
    d = rng.standard_normal(out.get().shape).astype(dtype)
    d[0, 1, 0, 0] = np.inf
    dout.set(d)
    mg.Executor().run([mg.Operator(desc.type, **desc.kwargs)], scope)
    want = max_grad_loops(x.astype(np.float64), d.astype(np.float64), **attrs)
    got = dx.get()
    assert got.dtype == np.dtype(dtype)
    rtol = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}[dtype]   # overlaps add up
    # a sum of up to 9 douts (3x3 windows at stride 1) may cancel: its rounding is
    # relative to the terms, not to the sum
    atol = rtol * 9 * np.abs(d[np.isfinite(d)]).astype(np.float64).max()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
    assert not np.signbit(got[want == 0]).any()              # +0.0 where nothing goes


def test_strides_default_to_ksize_and_are_stored():
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare((-1, 4, 9, 9), "float32")
    op = mg.Operator("pool2d", x=x, out=scope.new_var("out"), ksize=3)
    assert op.attrs["ksize"] == (3, 3) and op.attrs["strides"] == (3, 3)
    assert op.outputs["out"].decl_shape == (-1, 4, 3, 3)
    op = mg.Operator("pool2d", x=x, out=scope.new_var("out2"), ksize=3, strides=[2, 1])
    assert op.attrs["strides"] == (2, 1)


def build_pool(x_shape, **attrs):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare(x_shape, "float32")
    return mg.Operator("pool2d", x=x, out=scope.new_var("out"), **attrs)


@pytest.mark.parametrize("x_shape, attrs, match", [
    ((2, 3, 8, 8), {"ksize": 2, "paddings": 2},
     r"pool2d: attribute 'paddings' \(2, 2\) must be smaller than 'ksize' \(2, 2\)"),
    ((2, 3, 2, 8), {"ksize": 3}, "output height would be 0: input 'x' height 2"),
    ((2, 3, 8), {}, "input 'x' must have rank 4, got rank 3"),
    ((2, 3, 8, 8), {"pool_type": "min"}, "attribute 'pool_type' must be one of 'max', 'avg'"),
    ((2, 3, 8, 8), {"ksize": 0}, "attribute 'ksize' must be >= 1"),
    ((2, 3, 8, 8), {"strides": "2"}, "attribute 'strides' must be .*got str '2'"),
])
def test_pool2d_bad_inputs(x_shape, attrs, match):
    with pytest.raises(mg.OpError, match=match):
        build_pool(x_shape, **attrs)


@pytest.mark.parametrize("ksize", [2, (3, 2), (1, 4), (2, 1)])
def test_max_of_windows_that_tile_x(ksize):
    """Windows that tile x (strides = ksize, no padding) take the rows-then-columns
    path: the float64 reference's values, and NaN wherever a window holds one."""
    x = rng.standard_normal((2, 3, 6, 8))
    helper_test_op("pool2d", {"x": x}, {"ksize": ksize}, pool_reference, grad_wrt=("x",))
    x[0, 1, 2, 3] = x[1, 2, 5, 0] = np.nan
    attrs = pool_schema.resolve({"pool_type": "max", "ksize": ksize, "strides": None,
                                "paddings": 0, "global_pooling": False})
    hw = pool_kernels.out_hw(x.shape, attrs)
    assert pool_kernels.tiles(x, attrs, hw)
    out = pool_kernels.window_max(x, attrs, hw)
    kh, kw = attrs["ksize"]
    expected = x.reshape(2, 3, 6 // kh, kh, 8 // kw, kw).max(axis=(3, 5))   # NaN propagates
    np.testing.assert_array_equal(out, expected)
    assert np.isnan(out).sum() == 2


# ---- channels last (data_layout="NHWC") --------------------------------------------

@pytest.mark.parametrize("attrs", CASES)
def test_pool2d_nhwc_forward_and_grad(attrs):
    """Every case channels last: the float64 reference, the gradient by finite
    differences (the native NHWC max gradient and the numpy kernels)."""
    x = rng.permutation(2 * 5 * 6 * 3).reshape(2, 5, 6, 3) / 10.0    # distinct: no max ties
    helper_test_op("pool2d", {"x": x}, {**attrs, "data_layout": "NHWC"}, pool_reference,
                   grad_wrt=("x",))


@pytest.mark.parametrize("attrs", CASES)
@pytest.mark.parametrize("native", ["1", "0"])
def test_pool2d_nhwc_float32_equals_nchw(attrs, native, monkeypatch):
    """NHWC gives NCHW's values and gradients, transposed, with the native kernels and
    without."""
    monkeypatch.setenv("MINIGRAPH_NATIVE", native)
    x = rng.standard_normal((2, 3, 8, 8)).astype("float32")
    out = {}
    for layout in ("NCHW", "NHWC"):
        xin = x if layout == "NCHW" else x.transpose(0, 2, 3, 1).copy()
        scope = mg.Scope()
        xv, o, d, dx = (scope.new_var(n) for n in ("x", "out", "dout", "dx"))
        xv.set(xin)
        op = mg.Operator("pool2d", x=xv, out=o, data_layout=layout, **attrs)
        (desc,) = op.schema.grad(op, {"out": d}, lambda v, dx=dx, xv=xv: dx if v is xv else None)
        mg.Executor().run([op], scope)
        dout = np.arange(o.get().size, dtype=np.float32).reshape(o.get().shape)
        if layout == "NHWC":
            dout = out["NCHW"][2].transpose(0, 2, 3, 1).copy()
        d.set(dout)
        mg.Executor().run([mg.Operator(desc.type, **desc.kwargs)], scope)
        out[layout] = (o.get(), dx.get(), dout)
    np.testing.assert_array_equal(out["NHWC"][0], out["NCHW"][0].transpose(0, 2, 3, 1))
    np.testing.assert_allclose(out["NHWC"][1], out["NCHW"][1].transpose(0, 2, 3, 1),
                               rtol=1e-6)


def test_pool2d_nhwc_shapes():
    op = build_pool((-1, 9, 7, 4), ksize=3, strides=2, paddings=1, data_layout="NHWC")
    assert op.outputs["out"].decl_shape == (-1, 5, 4, 4)
    op = build_pool((-1, 9, 7, 4), global_pooling=True, data_layout="NHWC")
    assert op.outputs["out"].decl_shape == (-1, 1, 1, 4)
    with pytest.raises(mg.OpError, match="output width would be 0: input 'x' width 2"):
        build_pool((2, 8, 2, 8), ksize=3, data_layout="NHWC")
    with pytest.raises(mg.OpError, match="attribute 'data_layout' must be one of"):
        build_pool((2, 8, 8, 3), data_layout="nhwc")


@pytest.mark.parametrize("ksize", [2, (3, 2), (1, 4)])
def test_nhwc_max_of_windows_that_tile_x(ksize):
    """NHWC windows that tile x take the rows-then-columns path (native for 2x2):
    NaN wherever a window holds one."""
    x = rng.standard_normal((2, 6, 8, 3))
    x[0, 2, 3, 1] = x[1, 5, 0, 2] = np.nan
    attrs = pool_schema.resolve({"pool_type": "max", "ksize": ksize, "strides": None,
                                "paddings": 0, "global_pooling": False, "data_layout": "NHWC"})
    hw = pool_kernels.out_hw(x.shape, attrs)
    assert pool_kernels.tiles(x, attrs, hw)
    kh, kw = attrs["ksize"]
    expected = x.reshape(2, 6 // kh, kh, 8 // kw, kw, 3).max(axis=(2, 4))
    np.testing.assert_array_equal(pool_kernels.window_max(x, attrs, hw), expected)
    np.testing.assert_array_equal(pool_kernels.tiled_max(x, attrs, hw), expected)
