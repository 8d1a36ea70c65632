"""fused_conv2d (conv2d + bias + residual + relu, inference-only) and the inference
passes that build it: fuse_conv2d and optimize_for_inference."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import conv2d

import minigraph as mg
from minigraph import layers as L
from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.kernels.cpu import conv_native

rng = np.random.default_rng(0)

GEOMETRIES = [
    ((2, 3, 5, 5), (4, 3, 3, 3), {"paddings": 1}),
    ((2, 3, 6, 7), (4, 3, 3, 3), {"strides": 2, "paddings": 1}),
    ((1, 2, 7, 7), (3, 2, 3, 3), {"dilations": 2, "paddings": (2, 1)}),
    ((2, 4, 5, 6), (6, 2, 3, 3), {"groups": 2, "paddings": 1}),
    ((3, 4, 5, 6), (6, 4, 1, 1), {}),
    ((2, 4, 7, 7), (3, 4, 1, 1), {"strides": 2}),
]


def fused_reference(x, filter, bias=None, residual=None, activation="none", **conv):
    out = conv2d(x, filter, **conv)
    if bias is not None:
        out = out + (bias if conv.get("data_layout") == "NHWC" else bias.reshape(-1, 1, 1))
    if residual is not None:
        out = out + residual
    return {"out": np.maximum(out, 0.0) if activation == "relu" else out}


def inputs_for(x_shape, w_shape, attrs, bias, residual, dtype):
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    ins = {"x": x, "filter": w}
    if bias:
        ins["bias"] = rng.standard_normal(w_shape[0]).astype(dtype)
    if residual:
        shape = fused_reference(x.astype(np.float64), w.astype(np.float64), **attrs)["out"].shape
        ins["residual"] = rng.standard_normal(shape).astype(dtype)
    return ins


@pytest.mark.parametrize("x_shape, w_shape, attrs", GEOMETRIES)
@pytest.mark.parametrize("bias, residual, activation", [
    (True, False, "relu"), (True, True, "relu"), (False, True, "none"), (False, False, "relu")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_conv2d_against_the_float64_reference(x_shape, w_shape, attrs, bias, residual,
                                                    activation, dtype, cpu_engine):
    ins = inputs_for(x_shape, w_shape, attrs, bias, residual, dtype)
    tol = {} if dtype == "float64" else {"atol": 1e-5, "rtol": 1e-4}
    helper_test_op("fused_conv2d", ins, {**attrs, "activation": activation}, fused_reference,
                   **tol)


@pytest.mark.parametrize("bias, residual, activation", [(True, True, "relu"),
                                                     (False, False, "none")])
def test_fused_conv2d_on_winograds_kernel(bias, residual, activation, monkeypatch):
    """A 3x3 conv of 8 channels: Winograd's kernel on the filter's kept transform, and
    its bound form (prepared on Winograd's kernel) with the same bits (helper_test_op),
    within Winograd's rounding of outputs near 10 (some 1e-6 relative to them)."""
    if not conv_native.available():
        pytest.skip("native kernels not built here")
    prepared = []

    def spy(*args, **kwargs):
        prepared.append(args[-1])
        return prepare(*args, **kwargs)
    prepare = conv_native.prepared_forward
    monkeypatch.setattr(conv_native, "prepared_forward", spy)
    attrs = {"paddings": 1}
    ins = inputs_for((2, 8, 12, 12), (8, 8, 3, 3), attrs, bias, residual, "float32")
    helper_test_op("fused_conv2d", ins, {**attrs, "activation": activation}, fused_reference,
                   atol=2e-4, rtol=1e-4)
    assert prepared and all(prepared)            # use_winograd


def test_fused_conv2d_one_image_per_chunk(monkeypatch):
    monkeypatch.setattr(conv_cpu, "CHUNK_BYTES", 1)
    for x_shape, w_shape, attrs in GEOMETRIES:
        ins = inputs_for(x_shape, w_shape, attrs, True, True, "float64")
        helper_test_op("fused_conv2d", ins, {**attrs, "activation": "relu"}, fused_reference)


def build(x_shape, w_shape, bias_shape=None, residual_shape=None, **attrs):
    scope = mg.Scope()
    slots = {}
    for name, shape in (("x", x_shape), ("filter", w_shape), ("bias", bias_shape),
                        ("residual", residual_shape)):
        if shape is not None:
            slots[name] = scope.new_var(name)
            slots[name].declare(shape, "float32")
    return mg.Operator("fused_conv2d", out=scope.new_var("out"), **slots, **attrs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias_shape=(5,)), r"fused_conv2d: input 'bias' must have shape \(4,\) \(one value"),
    (dict(residual_shape=(2, 4, 6, 6)), r"fused_conv2d: input 'residual' must have shape "
                                        r"\(2, 4, 8, 8\)"),
    (dict(activation="gelu"), r"fused_conv2d: attribute 'activation' must be one of"),
    (dict(groups=2), r"fused_conv2d: input 'x' has 3 channels"),
    (dict(pool="avg2x2"), r"fused_conv2d: attribute 'pool' must be one of"),
])
def test_fused_conv2d_bad_inputs_name_the_op_and_slot(kwargs, match):
    with pytest.raises(mg.OpError, match=match):
        build((2, 3, 8, 8), (4, 3, 3, 3), paddings=1, **kwargs)


def test_a_pool_needs_outputs_of_at_least_2x2():
    with pytest.raises(mg.OpError, match=r"fused_conv2d: attribute 'pool' 'max2x2' needs the "
                                         r"convolution's output to be at least 2x2, got "
                                         r"shape \(2, 4, 1, 8\)"):
        build((2, 3, 3, 8), (4, 3, 3, 3), paddings=(0, 1), pool="max2x2")
    op = build((-1, 3, 9, 8), (4, 3, 3, 3), paddings=1, pool="max2x2")
    assert op.outputs["out"].shape == (-1, 4, 4, 4)


def test_fused_conv2d_has_no_gradient():
    op = build((2, 3, 8, 8), (4, 3, 3, 3), bias_shape=(4,), paddings=1)
    with pytest.raises(mg.OpError, match="fused_conv2d: an inference-only op, it has no "
                                         "gradient"):
        op.schema.grad(op, {"out": op.outputs["out"]}, lambda v: v)


def image(x, layout):
    """An NCHW batch in `layout`."""
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if layout == "NHWC" else x


def resnet_like(seed=0, layout="NCHW"):
    """stem conv-BN-ReLU, one residual block with a 1x1 projection, global pool, fc; in
    `layout` (convs, batch norms and pools alike)."""
    net = mg.Net(seed=seed)
    img = L.data(net, "image", shape=(-1, 3, 8, 8) if layout == "NCHW" else (-1, 8, 8, 3))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")

    def conv_bn(x, filters, size, stride, relu, name):
        h = L.conv2d(net, x, filters, size, stride=stride, padding=size // 2, bias=False,
                     name=name, data_layout=layout)
        h = L.batch_norm(net, h, name=name + "_bn", data_layout=layout)
        return L.relu(net, h) if relu else h

    h = conv_bn(img, 4, 3, 1, True, "stem")
    out = conv_bn(conv_bn(h, 6, 3, 2, True, "a"), 6, 3, 1, False, "b")
    h = L.relu(net, L.add(net, out, conv_bn(h, 6, 1, 2, False, "proj")))
    h = L.pool2d(net, h, global_pooling=True, pool_type="avg", data_layout=layout)
    logits = L.fc(net, L.flatten(net, h), 5, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    r = np.random.default_rng(seed)
    for _ in range(3):
        net.train(feed={"image": image(r.standard_normal((8, 3, 8, 8)).astype(np.float32),
                                       layout), "label": r.integers(0, 5, 8)})
    return net, logits


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_optimize_for_inference_equals_net_infer(layout):
    net, logits = resnet_like(layout=layout)
    x = image(np.random.default_rng(1).standard_normal((5, 3, 8, 8)).astype(np.float32), layout)
    (want,) = net.infer(feed={"image": x}, fetch=[logits])
    fast = mg.passes.optimize_for_inference(net)
    (got,) = fast.infer(feed={"image": x}, fetch=[logits.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    types = [op.type for op in fast.section("trunk")]
    assert types.count("fused_conv2d") == 4 and "batch_norm" not in types
    assert "relu" not in types and "add" not in types         # all inside the fused ops
    assert "conv2d + add + relu" in [" + ".join(n.ops[:1] + n.ops[-2:]) for n in
                                     fast.reports["fuse_conv2d"]]       # the block's second conv
    assert fast.applied == ("fold_batch_norm", "remove_dropout", "fuse_conv2d", "fuse_fc",
                            "fuse_separable_conv2d")
    assert [str(n) for n in fast.reports["fuse_fc"]] == [
        "mul + elementwise_add -> fused_fc computing 'head.out'"]
    assert "fused_conv2d" not in [op.type for op in net.ops("infer")]   # source untouched
    assert {op.attrs["data_layout"] for op in fast.section("trunk")
            if op.type in ("fused_conv2d", "pool2d")} == {layout}


def test_a_channels_last_resnet_is_the_nchw_one_transposed():
    """The same initial parameters, the same data transposed: after three training
    steps the same parameters (to float32 rounding) and logits, and the folded and
    fused net agrees - no transpose anywhere, neither in the train and infer branches
    nor in the optimized net."""
    a, logits_a = resnet_like(seed=3)
    b, logits_b = resnet_like(seed=3, layout="NHWC")
    for v in a.persistables():
        np.testing.assert_allclose(b.var(v.name).get(), v.get(), rtol=1e-4, atol=1e-5)
    x = np.random.default_rng(2).standard_normal((4, 3, 8, 8)).astype(np.float32)
    (pa,) = a.infer(feed={"image": x}, fetch=[logits_a])
    (pb,) = b.infer(feed={"image": image(x, "NHWC")}, fetch=[logits_b])
    np.testing.assert_allclose(pb, pa, rtol=1e-4, atol=1e-5)
    fast = mg.passes.optimize_for_inference(b)
    (pf,) = fast.infer(feed={"image": image(x, "NHWC")}, fetch=[logits_b.name])
    np.testing.assert_allclose(pf, pb, rtol=1e-5, atol=1e-5)
    for ops in (b.ops("train"), b.ops("infer"), fast.ops("infer")):
        assert not [op.type for op in ops if op.type == "transpose"]


@pytest.mark.parametrize("x_shape, w_shape, attrs", GEOMETRIES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_conv2d_nhwc_against_the_float64_reference(x_shape, w_shape, attrs, dtype):
    """The bias along the last axis, the residual and relu, channels last: the native
    NHWC kernel's epilogue (float32, one group) and the NHWC engine's."""
    n, c, h, w = x_shape
    attrs = {**attrs, "data_layout": "NHWC"}
    ins = inputs_for((n, h, w, c), w_shape, attrs, True, True, dtype)
    tol = {} if dtype == "float64" else {"atol": 1e-5, "rtol": 1e-4}
    helper_test_op("fused_conv2d", ins, {**attrs, "activation": "relu"}, fused_reference, **tol)


def test_a_value_read_twice_or_fetched_by_default_ends_the_chain():
    net = mg.Net(seed=0)
    img = L.data(net, "image", shape=(-1, 2, 5, 5))
    h = L.conv2d(net, img, 3, 3, padding=1, name="c")      # c.out: read by relu and add
    s = L.add(net, L.relu(net, h), h)
    g = L.relu(net, L.conv2d(net, s, 3, 3, padding=1, name="d"))
    net.default_fetches = (s, net.var("d.out"), g)         # d.out: fetched
    fast = mg.passes.fold_batch_norm(net)
    mg.passes.fuse_conv2d(fast)
    assert [op.type for op in fast.section("trunk")] == \
        ["fused_conv2d", "relu", "add", "fused_conv2d", "relu"]
    assert [str(n) for n in fast.reports["fuse_conv2d"]] == [
        "conv2d + elementwise_add -> fused_conv2d computing 'c.out'",
        "conv2d + elementwise_add -> fused_conv2d computing 'd.out'"]
    x = np.random.default_rng(2).standard_normal((2, 2, 5, 5)).astype(np.float32)
    for got, want in zip(fast.infer(feed={"image": x}), net.infer(feed={"image": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)   # native: other order


def test_fuse_conv2d_refuses_a_training_net_and_runs_once():
    net, _ = resnet_like()
    with pytest.raises(ValueError, match="fuse_conv2d: needs an infer-only net"):
        mg.passes.fuse_conv2d(net)
    fast = mg.passes.optimize_for_inference(net)
    with pytest.raises(ValueError, match="fuse_conv2d: already applied"):
        mg.passes.fuse_conv2d(fast)


def test_conv2d_works_lean_fused_conv2d_in_full_chunks(monkeypatch):
    """conv2d (the op training steps run) caps its work arrays at INPUT_MULTIPLE
    times x's size (or LEAN_FLOOR_BYTES); fused_conv2d (inference only) takes full
    CHUNK_BYTES chunks of columns (on conv_cpu's engine, not the native kernel)."""
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    made = {}
    plain = conv_cpu.Work.array

    def record(self, name, dtype, shape):
        view = plain(self, name, dtype, shape)
        made[name] = view.base.nbytes
        return view

    monkeypatch.setattr(conv_cpu.Work, "array", record)
    x = rng.standard_normal((32, 64, 8, 8)).astype("float32")
    w = rng.standard_normal((64, 64, 3, 3)).astype("float32")
    cap = max(conv_cpu.LEAN_FLOOR_BYTES, conv_cpu.INPUT_MULTIPLE * x.nbytes)
    ex, work = mg.Executor(mg.CPUPlace()), {}
    for op_type in ("conv2d", "fused_conv2d"):
        scope = mg.Scope()
        xv, wv, out = scope.new_var("x"), scope.new_var("w"), scope.new_var("out")
        xv.set(x)
        wv.set(w)
        made.clear()
        ex.run([mg.Operator(op_type, x=xv, filter=wv, out=out, paddings=1)], scope)
        work[op_type] = made["cols"], sum(made.values())
    assert work["conv2d"][1] <= cap < work["fused_conv2d"][1]
    assert conv_cpu.CHUNK_BYTES / 2 < work["fused_conv2d"][0] <= conv_cpu.CHUNK_BYTES


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_new_value_of_a_filter_is_transformed_anew(layout, monkeypatch):
    """On Winograd's kernel fused_conv2d keeps each filter's transform and makes the filter
    read-only; Variable.set gives the parameter a new array, which the next run (through
    the bound form in NCHW) transforms (not the kept transform of the old one), or runs
    on the direct kernel where it holds a NaN (a value written past Variable.set's
    check), which spreads as the direct conv spreads it."""
    from minigraph.kernels.cpu import choices, conv_native

    if not conv_native.available():
        pytest.skip("native kernels not built")
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1)
    monkeypatch.setattr(conv_native, "WINOGRAD_MAX_SCRATCH_INFERENCE", float("inf"))
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 8, 9, 9) if layout == "NCHW" else (-1, 9, 9, 8))
    y = L.relu(net, L.conv2d(net, x, 12, 3, padding=1, data_layout=layout, name="c"))
    fast = mg.passes.optimize_for_inference(net)
    assert [op.type for op in fast.section("trunk")] == ["fused_conv2d"]
    v = rng.standard_normal((2, 8, 9, 9) if layout == "NCHW" else (2, 9, 9, 8)).astype(np.float32)
    w, b = fast.var("c.w"), fast.var("c.b")

    def want():
        nchw = v if layout == "NCHW" else v.transpose(0, 3, 1, 2)
        out = np.maximum(conv2d(nchw.astype(np.float64), w.get().astype(np.float64),
                                paddings=(1, 1)) + b.get().reshape(-1, 1, 1), 0)
        return out if layout == "NCHW" else out.transpose(0, 2, 3, 1)

    with choices.forcing({"fused_conv2d": "winograd"}):
        (first,) = fast.infer(feed={"x": v}, fetch=[y.name])
        np.testing.assert_allclose(first, want(), rtol=1e-4, atol=1e-5)
        assert not w.value.flags.writeable          # the array the op reads
        w.set(-2.0 * w.get())
        (second,) = fast.infer(feed={"x": v}, fetch=[y.name])
    np.testing.assert_allclose(second, want(), rtol=1e-4, atol=1e-5)
    assert not np.allclose(first, second)
    bad = w.get()
    bad[0, 0, 0, 0] = np.nan          # no transform: the direct kernel (set refuses NaN)
    w.value = bad
    (third,) = fast.infer(feed={"x": v}, fetch=[y.name])
    channel = third[:, 0] if layout == "NCHW" else third[..., 0]
    assert np.isnan(channel).all() and not np.isnan(np.delete(third, 0, axis=(
        1 if layout == "NCHW" else 3))).any()
    np.testing.assert_allclose(third, want(), rtol=1e-4, atol=1e-5)
