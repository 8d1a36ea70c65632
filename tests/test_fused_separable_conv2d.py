"""fused_separable_conv2d (a depthwise conv + bias + relu, then a 1x1 conv + bias +
residual + relu; inference-only), its CPU kernel (conv_separable) and the pass that
builds it: fuse_separable_conv2d, the last of optimize_for_inference."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import conv2d, pair

import minigraph as mg
from minigraph import layers as L
from minigraph.kernels.cpu import choices, conv_depthwise, conv_im2col, conv_native
from minigraph.kernels.cpu import conv_separable as separable

rng = np.random.default_rng(0)

# (x shape, channel multiplier, 1x1 filters, depthwise attrs)
GEOMETRIES = [
    ((2, 4, 9, 8), 1, 6, {"paddings": 1}),
    ((3, 3, 10, 9), 2, 5, {"strides": 2, "paddings": 1}),
    ((2, 3, 9, 9), 1, 4, {"paddings": 2, "dilations": 2}),
    ((4, 16, 8, 8), 1, 20, {"paddings": 1}),
    ((2, 5, 7, 11), 1, 3, {"strides": (1, 2), "paddings": (0, 1)}),
    # channels past a whole vector (8 or 16), rows of 8 + 4 + 2 + 1 pixels, stride 2
    # on an odd plane, and a row of input past the last one read
    ((3, 20, 15, 15), 1, 7, {"paddings": 1}),
    ((2, 40, 13, 12), 1, 9, {"strides": 2, "paddings": 1}),
    ((2, 17, 10, 30), 1, 4, {"strides": (2, 1), "paddings": (0, 2)}),
]


def separable_reference(x, dw_filter, filter, dw_bias=None, bias=None, residual=None,
                        dw_activation="none", activation="none", data_layout="NCHW", **conv):
    """The two convs of float64 conv2d, each with its bias and relu."""
    axis = (1, 1) if data_layout == "NCHW" else ()
    mid = conv2d(x, dw_filter, data_layout=data_layout, **conv)
    if dw_bias is not None:
        mid = mid + dw_bias.reshape(-1, *axis)
    if dw_activation == "relu":
        mid = np.maximum(mid, 0.0)
    out = conv2d(mid, filter, data_layout=data_layout)
    if bias is not None:
        out = out + bias.reshape(-1, *axis)
    if residual is not None:
        out = out + residual
    return {"out": np.maximum(out, 0.0) if activation == "relu" else out}


def inputs_for(x_shape, m, o, attrs, dw_bias=True, bias=True, residual=False,
               dtype="float32", layout="NCHW"):
    c = x_shape[1]
    x = rng.standard_normal(x_shape)
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    ins = {"x": x, "dw_filter": rng.standard_normal((c * m, 1, 3, 3)),
           "filter": rng.standard_normal((o, c * m, 1, 1)) / np.sqrt(c * m)}
    if dw_bias:
        ins["dw_bias"] = rng.standard_normal(c * m)
    if bias:
        ins["bias"] = rng.standard_normal(o)
    if residual:
        shape = separable_reference(**ins, data_layout=layout, **attrs)["out"].shape
        ins["residual"] = rng.standard_normal(shape)
    return {k: v.astype(dtype) for k, v in ins.items()}


@pytest.mark.parametrize("x_shape, m, o, attrs", GEOMETRIES)
@pytest.mark.parametrize("dw_bias, bias, residual, dw_act, act", [
    (True, True, False, "relu", "relu"), (False, False, True, "none", "relu"),
    (True, False, True, "relu", "none")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_against_the_float64_reference(x_shape, m, o, attrs, dw_bias, bias, residual,
                                       dw_act, act, dtype, cpu_engine):
    """Every geometry and epilogue, on the separable kernel (float32, native) and on
    fused_conv2d's kernels one conv after the other (float64, or numpy); the bound form
    gives the kernel's bits (helper_test_op)."""
    ins = inputs_for(x_shape, m, o, attrs, dw_bias, bias, residual, dtype)
    tol = {} if dtype == "float64" else {"atol": 2e-5, "rtol": 1e-4}
    helper_test_op("fused_separable_conv2d", ins,
                   {**attrs, "groups": x_shape[1], "dw_activation": dw_act,
                    "activation": act}, separable_reference, **tol)


def test_channels_last_against_the_float64_reference():
    ins = inputs_for((2, 4, 7, 6), 1, 3, {"paddings": 1}, residual=True, layout="NHWC")
    helper_test_op("fused_separable_conv2d", ins,
                   {"paddings": 1, "groups": 4, "data_layout": "NHWC",
                    "dw_activation": "relu", "activation": "relu"}, separable_reference,
                   atol=2e-5, rtol=1e-4)


def native_only():
    if not (conv_native.available() and conv_depthwise.available()):
        pytest.skip("native kernels not built here")


@pytest.mark.parametrize("x_shape, m, o, attrs", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_separable_kernel_gives_the_two_kernels_bits(x_shape, m, o, attrs, threads):
    """conv_separable.forward equals the depthwise kernel then the pointwise kernel bit
    for bit, with and without the epilogues, a NaN and an infinity included."""
    native_only()
    ins = inputs_for(x_shape, m, o, attrs, residual=True)
    ins["x"][0, 0, 1, 1], ins["x"][-1, -1, -1, -1] = np.nan, np.inf
    x, c = ins["x"], x_shape[1]
    g = conv_im2col.geometry(x.shape, ins["dw_filter"].shape,
                             *(pair(attrs.get(k, d)) for k, d in (("strides", 1), ("paddings", 0),
                                                                  ("dilations", 1))), c)
    for epilogue in (True, False):
        ep = {"dw_bias": ins["dw_bias"], "bias": ins["bias"], "residual": ins["residual"]} \
            if epilogue else {}
        mid = conv_depthwise.forward(x, ins["dw_filter"], g, threads, bias=ep.get("dw_bias"),
                                     relu=epilogue)
        g1 = conv_im2col.geometry(mid.shape, ins["filter"].shape, (1, 1), (0, 0), (1, 1), 1)
        want = conv_native.forward(mid, ins["filter"], g1, threads, bias=ep.get("bias"),
                                   residual=ep.get("residual"), relu=epilogue)
        got = separable.forward(x, ins["dw_filter"], ins["filter"], g, threads,
                                ep.get("dw_bias"), epilogue, ep.get("bias"),
                                ep.get("residual"), epilogue)
        np.testing.assert_array_equal(got, want)


def test_the_launcher_checks_shapes():
    native_only()
    g = conv_im2col.geometry((2, 4, 6, 6), (4, 1, 3, 3), (1, 1), (1, 1), (1, 1), 4)
    x, dw = np.zeros((2, 4, 6, 6), np.float32), np.zeros((4, 1, 3, 3), np.float32)
    with pytest.raises(ValueError, match=r"conv_separable.forward: filter has shape "
                                         r"\(5, 3, 1, 1\), expected \(5, 4, 1, 1\)"):
        separable.forward(x, dw, np.zeros((5, 3, 1, 1), np.float32), g, 2)
    with pytest.raises(ValueError, match=r"conv_separable.forward: residual has shape "
                                         r"\(2, 5, 6, 5\), expected \(2, 5, 6, 6\)"):
        separable.forward(x, dw, np.zeros((5, 4, 1, 1), np.float32), g, 2,
                          residual=np.zeros((2, 5, 6, 5), np.float32))


@pytest.mark.parametrize("n, threads, runs", [(4, 2, "separable"), (1, 2, "two")])
def test_the_op_runs_the_separable_kernel_on_enough_images(n, threads, runs, monkeypatch):
    """As many images as threads (or more): the separable kernel, chosen by time (here
    forced each way, the same bits); fewer: the two kernels, which split channels."""
    native_only()
    calls = []
    forward = separable.forward
    monkeypatch.setattr(separable, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    monkeypatch.setattr(mg.kernels.cpu.blocks, "get_num_threads", lambda: threads)
    ins = inputs_for((n, 8, 6, 6), 1, 5, {"paddings": 1}, residual=True)
    attrs = {"paddings": 1, "groups": 8, "dw_activation": "relu", "activation": "relu"}
    outs = []
    for option in ("separable", "two"):
        with choices.forcing({"fused_separable_conv2d": option}):
            outs.append(helper_test_op("fused_separable_conv2d", ins, attrs,
                                       separable_reference, atol=2e-5, rtol=1e-4)["out"])
    assert bool(calls) == (runs == "separable")
    np.testing.assert_array_equal(outs[0], outs[1])


def build(x_shape=(2, 4, 8, 8), dw_shape=(4, 1, 3, 3), w_shape=(6, 4, 1, 1), **kwargs):
    scope = mg.Scope()
    shapes = {"x": x_shape, "dw_filter": dw_shape, "filter": w_shape,
              "dw_bias": kwargs.pop("dw_bias_shape", None),
              "bias": kwargs.pop("bias_shape", None),
              "residual": kwargs.pop("residual_shape", None)}
    slots = {s: scope.new_var(s) for s, shape in shapes.items() if shape}
    for s, var in slots.items():
        var.declare(shapes[s], "float32")
    attrs = {"groups": 4, "paddings": 1, **kwargs}
    return mg.Operator("fused_separable_conv2d", out=scope.new_var("out"), **slots, **attrs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(groups=2), r"fused_separable_conv2d: input 'x' has 4 channels \(shape \(2, 4, 8, "
                     r"8\)\), but groups=2: the first conv is depthwise"),
    (dict(dw_shape=(4, 2, 3, 3)), r"fused_separable_conv2d: input 'dw_filter' must have 1 "
                                  r"input channels"),
    (dict(w_shape=(6, 4, 3, 3)), r"fused_separable_conv2d: input 'filter' must be a 1x1 "
                                 r"filter \(6, 4, 1, 1\), got shape \(6, 4, 3, 3\)"),
    (dict(w_shape=(6, 5, 1, 1)), r"fused_separable_conv2d: input 'filter' must have 4 input "
                                 r"channels"),
    (dict(dw_bias_shape=(6,)), r"fused_separable_conv2d: input 'dw_bias' must have shape "
                               r"\(4,\) \(one value per output channel of the depthwise"),
    (dict(bias_shape=(4,)), r"fused_separable_conv2d: input 'bias' must have shape \(6,\)"),
    (dict(residual_shape=(2, 6, 4, 4)), r"fused_separable_conv2d: input 'residual' must "
                                        r"have shape \(2, 6, 8, 8\)"),
    (dict(activation="gelu"), r"fused_separable_conv2d: attribute 'activation' must be one "
                              r"of"),
    (dict(dw_activation="silu"), r"fused_separable_conv2d: attribute 'dw_activation' must "
                                 r"be one of"),
])
def test_bad_inputs_name_the_op_and_slot(kwargs, match):
    with pytest.raises(mg.OpError, match=match):
        build(**kwargs)


def test_it_has_no_gradient():
    op = build()
    with pytest.raises(mg.OpError, match="fused_separable_conv2d: an inference-only op, it "
                                         "has no gradient"):
        op.schema.grad(op, {"out": op.outputs["out"]}, lambda v: v)


# ---- the pass ---------------------------------------------------------------------------

def mobile_like(seed=0, layout="NCHW", extra_reader=False):
    """stem conv-BN-ReLU, then two depthwise separable blocks (the second of stride 2 and
    channel multiplier 2, its 1x1 conv without relu), global pool, fc; trained a few
    steps. extra_reader: the first block's depthwise output is also pooled into the
    logits (so it is not fused)."""
    net = mg.Net(seed=seed)
    shape = (-1, 3, 8, 8) if layout == "NCHW" else (-1, 8, 8, 3)
    img = L.data(net, "image", shape=shape)
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")

    def conv_bn(x, filters, size, stride=1, groups=1, relu=True):
        h = L.conv2d(net, x, filters, size, stride=stride, padding=size // 2, groups=groups,
                     bias=False, data_layout=layout)
        h = L.batch_norm(net, h, data_layout=layout)
        return L.relu(net, h) if relu else h

    h = conv_bn(img, 4, 3)
    dw = conv_bn(h, 4, 3, groups=4)
    h = conv_bn(dw, 6, 1)
    h = conv_bn(conv_bn(h, 12, 3, stride=2, groups=6), 8, 1, relu=False)
    h = L.pool2d(net, h, global_pooling=True, pool_type="avg", data_layout=layout)
    logits = L.fc(net, L.flatten(net, h), 5, name="head")
    if extra_reader:
        side = L.pool2d(net, dw, global_pooling=True, pool_type="avg", data_layout=layout)
        logits = L.add(net, logits, L.fc(net, L.flatten(net, side), 5, name="side"))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    r = np.random.default_rng(seed)
    for _ in range(3):
        x = r.standard_normal((8, 3, 8, 8)).astype(np.float32)
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if layout == "NHWC" else x
        net.train(feed={"image": x, "label": r.integers(0, 5, 8)})
    return net, logits


def test_optimize_for_inference_fuses_each_block():
    """Each block, its folded batch norms and relus, in one op; the pass refuses a
    training net and a second run."""
    net, logits = mobile_like()
    with pytest.raises(ValueError, match="fuse_separable_conv2d: needs an infer-only net"):
        mg.passes.fuse_separable_conv2d(net)
    x = np.random.default_rng(1).standard_normal((5, 3, 8, 8)).astype(np.float32)
    (want,) = net.infer(feed={"image": x}, fetch=[logits])
    fast = mg.passes.optimize_for_inference(net)
    (got,) = fast.infer(feed={"image": x}, fetch=[logits.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    types = [op.type for op in fast.section("trunk")]
    assert types == ["fused_conv2d", "fused_separable_conv2d", "fused_separable_conv2d",
                     "pool2d", "flatten", "fused_fc"]
    assert fast.applied[-1] == "fuse_separable_conv2d"
    first, second = (op for op in fast.section("trunk") if op.type == "fused_separable_conv2d")
    assert (first.attrs["dw_activation"], first.attrs["activation"]) == ("relu", "relu")
    assert (second.attrs["activation"], second.attrs["strides"]) == ("none", (2, 2))
    assert all(op.inputs["dw_bias"] is not None and op.inputs["bias"] is not None
               for op in (first, second))                      # the folded batch norms
    assert [str(n) for n in fast.reports["fuse_separable_conv2d"]][0].startswith(
        "fused_conv2d + fused_conv2d -> fused_separable_conv2d computing ")
    with pytest.raises(ValueError, match="fuse_separable_conv2d: already applied"):
        mg.passes.fuse_separable_conv2d(fast)


def test_a_depthwise_output_read_twice_or_channels_last_stays_two_ops():
    net, logits = mobile_like(extra_reader=True)
    fast = mg.passes.optimize_for_inference(net)
    assert [op.type for op in fast.section("trunk")].count("fused_separable_conv2d") == 1
    net, logits = mobile_like(layout="NHWC")
    fast = mg.passes.optimize_for_inference(net)
    assert "fused_separable_conv2d" not in [op.type for op in fast.section("trunk")]
    assert fast.reports["fuse_separable_conv2d"] == []


def test_onnx_export_runs_the_two_convs(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import onnx
    from onnx_helpers import assert_close, onnx_outputs

    net, logits = mobile_like()
    fast = mg.passes.optimize_for_inference(net)
    path = mg.onnx.export(fast, tmp_path / "mobile.onnx", feeds=["image"],
                          fetches=[logits.name])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types.count("Conv") == 5 and types.count("Relu") == 4
    x = np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)
    (want,) = fast.infer(feed={"image": x}, fetch=[logits.name])
    for runtime, (got,) in onnx_outputs(path, {"image": x}).items():
        assert_close(got, want, runtime)


def test_a_large_op_times_both_ways_a_small_one_runs_the_kernel_untimed(monkeypatch):
    """Choices by measurement (choices.pick, kept per machine): the separable kernel
    against the two convs where they make conv2d.MIN_CHOICE_WORK multiply-adds or more;
    below that the kernel, untimed."""
    native_only()
    picked, pick = [], choices.pick

    def spy(kind, key, options, default):
        if kind != "fused_separable_conv2d":
            return pick(kind, key, options, default)
        picked.append(tuple(sorted(options)))
        return "two"
    monkeypatch.setattr(choices, "pick", spy)
    monkeypatch.setattr(mg.kernels.cpu.blocks, "get_num_threads", lambda: 2)
    attrs = {"paddings": 1, "groups": 8, "dw_activation": "relu", "activation": "relu"}
    small = inputs_for((2, 8, 6, 6), 1, 5, {"paddings": 1})
    helper_test_op("fused_separable_conv2d", small, attrs, separable_reference,
                   atol=2e-5, rtol=1e-4)
    assert picked == []
    large = inputs_for((8, 8, 32, 32), 1, 64, {"paddings": 1})
    helper_test_op("fused_separable_conv2d", large, attrs, separable_reference,
                   atol=5e-5, rtol=1e-4)
    assert picked and set(picked) == {("separable", "two")}


def test_the_bound_form_leaves_arrays_it_cannot_take_to_the_kernel():
    """Non-contiguous or float64 arrays: the bound form returns None (the kernel runs);
    C-contiguous float32 ones: the separable kernel's output, the same array each run."""
    native_only()
    op = build(x_shape=(4, 4, 8, 8))
    run = separable.bind_fused_separable_conv2d(op)
    ins = inputs_for((4, 4, 8, 8), 1, 6, {"paddings": 1})
    with choices.forcing({"fused_separable_conv2d": "separable"}):
        first = run(ins)["out"]
        assert run({**ins, "x": ins["x"] + 1})["out"] is first
        assert run({**ins, "x": ins["x"][:, :, :, ::-1]}) is None
        assert run({k: v.astype(np.float64) for k, v in ins.items()}) is None
