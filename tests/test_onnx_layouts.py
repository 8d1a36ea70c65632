"""ONNX export of channels-last (NHWC) nets: ONNX's Conv and pools are NCHW only, so each
NHWC conv, pool and batch norm exports as Transpose, the op, Transpose; the file passes
the full check, and onnxruntime and onnx's reference evaluator give net.infer's outputs,
the folded and fused net's too."""
import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx_helpers import assert_close, max_differences, onnx_outputs  # noqa: E402


def trained(net, loss, feeds, steps=3):
    for k in range(steps):
        net.train(feed=feeds(np.random.default_rng(100 + k), 16), fetch=[loss])
    return net

def channels_last_net():
    """conv NHWC (strided, grouped, dilated) -> batch_norm NHWC -> relu -> max pool NHWC
    (padded) -> conv NHWC + residual -> avg pool NHWC -> global max pool NHWC -> fc,
    trained a few steps."""
    net = mg.Net(seed=5)
    img = L.data(net, "image", shape=(-1, 9, 10, 4))
    h = L.conv2d(net, img, 6, 3, stride=(1, 2), padding=1, groups=2, name="c1",
                 data_layout="NHWC")
    h = L.relu(net, L.batch_norm(net, h, name="bn1", data_layout="NHWC"))
    h = L.pool2d(net, h, 3, pool_stride=1, pool_padding=1, data_layout="NHWC")
    r = L.conv2d(net, h, 6, 3, padding=2, dilation=2, name="c2", data_layout="NHWC")
    h = L.relu(net, L.add(net, r, h))
    h = L.pool2d(net, h, 2, pool_type="avg", data_layout="NHWC")
    h = L.pool2d(net, h, global_pooling=True, data_layout="NHWC")
    logits = L.fc(net, h, 3, name="head")
    loss = L.mean(net, L.multiply(net, logits, logits))
    mg.optimizer.SGD(0.05).minimize(net, loss)
    feed = lambda rng, n: {"image": rng.standard_normal((n, 9, 10, 4)).astype("float32")}  # noqa
    return trained(net, loss, feed), logits, feed


def test_a_channels_last_net_exports_with_transposes(tmp_path):
    """ONNX's Conv and pools are NCHW only: each NHWC op is Transpose, the op, Transpose
    (onnxruntime removes the pairs); outputs equal net.infer, the folded and fused
    net's too."""
    net, logits, feed = channels_last_net()
    path = mg.onnx.export(net, tmp_path / "nhwc.onnx", feeds=["image"], fetches=[logits])
    max_differences(net, path, [logits], feed, ["image"])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types.count("Conv") == 2 and types.count("Transpose") == 2 * 6     # 2 convs,
    fast = mg.passes.optimize_for_inference(net)                  # bn, 3 pools: 2 each
    assert "transpose" not in [op.type for op in fast.ops("infer")]
    path = mg.onnx.export(fast, tmp_path / "fast.onnx", feeds=["image"],
                          fetches=[logits.name])
    for n in (1, 7):
        x = feed(np.random.default_rng(n), n)
        (want,) = net.infer(feed=x, fetch=[logits])
        for runtime, (got,) in onnx_outputs(path, x).items():
            assert_close(got, want, f"{runtime}, N={n}")
