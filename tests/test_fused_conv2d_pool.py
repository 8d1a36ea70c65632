"""fused_conv2d's max pooling (attribute pool "max2x2") and fuse_conv2d folding a
pool2d into the conv chain before it: against the float64 references, the unfused
ops' bits, ONNX runtimes and net.infer."""
import numpy as np
import pytest
from helpers import helper_test_op
from onnx_helpers import onnx_outputs
from references import conv2d, pool2d

import minigraph as mg
from minigraph import layers as L
from minigraph.kernels.cpu import blocks, conv_native
from minigraph.kernels.cpu import pool2d as pool_cpu

rng = np.random.default_rng(3)

# (x, filter, conv attributes): Winograd's kernel (3x3, stride 1, >= 8 channels), the
# direct kernel (few channels, a stride, 5x5), odd output rows or columns, outputs 8 wide
GEOMETRIES = [
    ((2, 8, 10, 12), (6, 8, 3, 3), {"paddings": 1}),
    ((3, 9, 9, 7), (5, 9, 3, 3), {"paddings": 1}),
    ((2, 3, 12, 12), (4, 3, 3, 3), {"paddings": 1}),
    ((2, 3, 11, 10), (5, 3, 5, 5), {"paddings": 2}),
    ((2, 4, 13, 12), (3, 4, 3, 3), {"strides": 2, "paddings": 1}),
    ((1, 16, 9, 8), (20, 16, 1, 1), {}),
    ((2, 8, 8, 8), (6, 8, 3, 3), {"paddings": 1}),             # 8 wide: rows two at a time
    ((2, 3, 6, 8), (4, 3, 3, 3), {"paddings": 1}),             # ... and an odd one left
]


def pooled_reference(x, filter, bias=None, residual=None, activation="none",
                     pool="max2x2", **conv):
    """The float64 conv, bias, residual, relu, then pool2d's max over 2x2 windows."""
    layout = conv.get("data_layout", "NCHW")
    out = conv2d(x, filter, **conv)
    if bias is not None:
        out = out + (bias if layout == "NHWC" else bias.reshape(-1, 1, 1))
    if residual is not None:
        out = out + residual
    if activation == "relu":
        out = np.maximum(out, 0.0)
    return {"out": pool2d(out, "max", 2, data_layout=layout)}


def inputs_for(x_shape, w_shape, attrs, bias, residual, dtype, layout="NCHW"):
    x = rng.standard_normal(x_shape)
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    ins = {"x": x.astype(dtype), "filter": rng.standard_normal(w_shape).astype(dtype)}
    if bias:
        ins["bias"] = rng.standard_normal(w_shape[0]).astype(dtype)
    if residual:
        shape = conv2d(ins["x"].astype(np.float64), ins["filter"].astype(np.float64),
                       **attrs, data_layout=layout).shape
        ins["residual"] = rng.standard_normal(shape).astype(dtype)
    return ins


@pytest.mark.parametrize("x_shape, w_shape, attrs", GEOMETRIES)
@pytest.mark.parametrize("bias, residual, activation", [
    (True, False, "relu"), (True, True, "relu"), (False, True, "none")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_pooled_against_the_float64_reference(x_shape, w_shape, attrs, bias, residual,
                                              activation, dtype, cpu_engine):
    """Every engine (native and numpy), and the bound form (helper_test_op runs it)."""
    ins = inputs_for(x_shape, w_shape, attrs, bias, residual, dtype)
    tol = {} if dtype == "float64" else {"atol": 2e-4, "rtol": 1e-4}
    got = helper_test_op("fused_conv2d", ins, {**attrs, "activation": activation,
                                               "pool": "max2x2"}, pooled_reference, **tol)
    assert got["out"].shape[2:] == tuple(s // 2 for s in conv2d(
        ins["x"].astype(np.float64), ins["filter"].astype(np.float64), **attrs).shape[2:])


@pytest.mark.parametrize("x_shape, w_shape, attrs", GEOMETRIES[:2] + GEOMETRIES[4:5])
def test_pooled_channels_last_against_the_float64_reference(x_shape, w_shape, attrs):
    nchw = (x_shape[0], x_shape[1], x_shape[2], x_shape[3])
    ins = inputs_for(nchw, w_shape, {**attrs}, True, True, "float32", layout="NHWC")
    helper_test_op("fused_conv2d", ins, {**attrs, "activation": "relu", "pool": "max2x2",
                                         "data_layout": "NHWC"},
                   pooled_reference, atol=2e-4, rtol=1e-4)


def run(ins, attrs):
    return helper_test_op("fused_conv2d", ins, attrs)["out"]


@pytest.mark.parametrize("x_shape, w_shape, attrs", GEOMETRIES)
def test_the_native_kernels_pool_the_unpooled_outputs_bit_for_bit(x_shape, w_shape, attrs,
                                                                   monkeypatch):
    """Pooled inside the kernel (each image's outputs in cache) = the fused op's full
    outputs, then pool2d's kernel; on 1, 2 and 3 threads (a thread per image, or
    images split by output channels); NaNs propagate as pool2d's."""
    if not conv_native.available():
        pytest.skip("native kernels not built here")
    monkeypatch.setattr(conv_native, "MIN_THREAD_WORK", 1)     # small convs on every thread
    ins = inputs_for(x_shape, w_shape, attrs, True, True, "float32")
    ins["x"].reshape(-1)[::97] = np.nan
    full_attrs = {**attrs, "activation": "relu"}
    windows = {"ksize": (2, 2), "strides": (2, 2), "paddings": (0, 0), "data_layout": "NCHW"}
    before = blocks.get_num_threads()
    try:
        for threads in (1, 2, 3):
            mg.set_num_threads(threads)
            full = run(ins, full_attrs)
            want = pool_cpu.window_max(full, windows, pool_cpu.out_hw(full.shape, windows))
            got = run(ins, {**full_attrs, "pool": "max2x2"})
            np.testing.assert_array_equal(got, want, err_msg=f"{threads} threads")
            assert np.isnan(got).any()
    finally:
        mg.set_num_threads(before)


def cnn(layout="NCHW", pool=None):
    """conv-BN-ReLU-maxpool twice, fc (a small MNIST CNN), trained a few steps."""
    net = mg.Net(seed=0)
    shape = (-1, 1, 12, 12) if layout == "NCHW" else (-1, 12, 12, 1)
    img, lbl = L.data(net, "image", shape=shape), L.data(net, "label", shape=(-1,),
                                                         dtype="int64")
    h = img
    for k, filters in enumerate((8, 12)):
        h = L.conv2d(net, h, filters, 3, padding=1, name=f"c{k}", data_layout=layout)
        h = L.relu(net, L.batch_norm(net, h, name=f"bn{k}", data_layout=layout))
        h = L.pool2d(net, h, **(pool or {"pool_size": 2}), data_layout=layout)
    logits = L.fc(net, L.flatten(net, h), 10, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    r = np.random.default_rng(0)
    for _ in range(3):
        x = r.standard_normal((8, 1, 12, 12)).astype(np.float32)
        net.train(feed={"image": x if layout == "NCHW" else x.transpose(0, 2, 3, 1),
                        "label": r.integers(0, 10, 8)})
    return net, logits


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_optimize_for_inference_folds_each_max_pool_into_its_conv(layout, tmp_path):
    net, logits = cnn(layout)
    fast = mg.passes.optimize_for_inference(net)
    assert [op.type for op in fast.section("trunk")] == ["fused_conv2d", "fused_conv2d",
                                                         "flatten", "fused_fc"]
    assert [n.ops for n in fast.reports["fuse_conv2d"]] == [
        ("conv2d", "elementwise_add", "relu", "pool2d")] * 2
    assert {op.attrs["pool"] for op in fast.section("trunk") if op.type == "fused_conv2d"} \
        == {"max2x2"}
    x = rng.standard_normal((5, 1, 12, 12)).astype(np.float32)
    x = x if layout == "NCHW" else np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    (want,) = net.infer(feed={"image": x}, fetch=[logits])
    for _ in range(3):                                  # checked, then bound runs
        (got,) = fast.infer(feed={"image": x}, fetch=[logits.name])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    path = mg.onnx.export(fast, tmp_path / "fast.onnx", feeds=["image"],
                          fetches=[logits.name])
    import onnx
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types.count("MaxPool") == 2 and types.count("Relu") == 2
    for runtime, (got,) in onnx_outputs(path, {"image": x}).items():
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=runtime)


@pytest.mark.parametrize("pool", [
    {"pool_size": 2, "pool_type": "avg"}, {"pool_size": 3, "pool_stride": 2},
    {"pool_size": 2, "pool_stride": 1}, {"pool_size": 2, "pool_padding": 1},
    {"global_pooling": True}])
def test_other_pools_stay_pool2d_ops(pool):
    net, logits = cnn(pool=pool)
    fast = mg.passes.optimize_for_inference(net)
    types = [op.type for op in fast.section("trunk")]
    assert types.count("pool2d") == 2
    assert all(op.attrs["pool"] == "none" for op in fast.section("trunk")
               if op.type == "fused_conv2d")
    x = rng.standard_normal((4, 1, 12, 12)).astype(np.float32)
    (want,) = net.infer(feed={"image": x}, fetch=[logits])
    (got,) = fast.infer(feed={"image": x}, fetch=[logits.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_conv_output_read_twice_or_fetched_keeps_its_pool2d():
    net = mg.Net(seed=0)
    img = L.data(net, "image", shape=(-1, 2, 6, 6))
    h = L.relu(net, L.conv2d(net, img, 3, 3, padding=1, name="c"))
    p = L.pool2d(net, h, pool_size=2)
    q = L.pool2d(net, L.relu(net, L.conv2d(net, img, 3, 3, padding=1, name="d")), pool_size=2)
    net.default_fetches = (p, h, q)                     # c's relu: fetched
    fast = mg.passes.fold_batch_norm(net)
    mg.passes.fuse_conv2d(fast)
    assert [op.type for op in fast.section("trunk")] == ["fused_conv2d", "pool2d",
                                                         "fused_conv2d"]
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    for got, want in zip(fast.infer(feed={"image": x}), net.infer(feed={"image": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
