"""ONNX export of the norms' PyTorch options: group_norm and instance_norm channels last
(transposed to NCHW and back), without affine parameters or with the scale alone,
instance_norm with running estimates (BatchNormalization on them), inputs without a
batch axis (reshapes), batch_norm with bias=False and PyTorch's estimate rule, layer_norm
with the scale alone: onnxruntime and onnx's reference evaluator equal net.infer."""
import numpy as np
import onnx
import pytest
from onnx_helpers import max_differences

import minigraph as mg
from minigraph import layers as L


def train(net, loss, feed, steps=3):
    for k in range(steps):
        net.train(feed=feed(np.random.default_rng(100 + k), 8), fetch=[loss])


def options_net():
    net = mg.Net(seed=5)
    img = L.data(net, "image", shape=(-1, 4, 5, 6))
    h = L.conv2d(net, img, 6, 3, padding=1, name="c1")
    h = L.group_norm(net, L.transpose(net, h, (0, 2, 3, 1)), 3, data_layout="NHWC",
                     bias=False, name="gn_nhwc")                       # (N, 5, 6, 6)
    h = L.instance_norm(net, h, data_layout="NHWC", affine=False, name="in_nhwc")
    h = L.instance_norm(net, L.transpose(net, h, (0, 3, 1, 2)), track_running_stats=True,
                        momentum=0.5, first_batch_sets_estimates=False, name="in_tracked")
    h = L.instance_norm(net, L.transpose(net, h, (0, 2, 3, 1)), track_running_stats=True,
                        data_layout="NHWC", bias=False, name="in_tracked_nhwc")
    h = L.batch_norm(net, h, data_layout="NHWC", bias=False, first_batch_sets_estimates=False,
                     name="bn")
    h = L.group_norm(net, L.transpose(net, h, (0, 3, 1, 2)), 2, affine=False, epsilon=0.0,
                     name="gn_bare")
    f = L.layer_norm(net, L.flatten(net, h), shift=False, name="ln_scale")
    logits = L.fc(net, f, 3, name="head")
    loss = L.mean(net, L.multiply(net, logits, logits))
    mg.optimizer.SGD(0.05).minimize(net, loss)
    feed = lambda rng, n: {"image": rng.standard_normal((n, 4, 5, 6)).astype("float32")}  # noqa
    train(net, loss, feed)
    return net, logits, feed


@pytest.mark.parametrize("opset", [13, 17])
def test_the_norms_options_export(tmp_path, opset):
    net, logits, feed = options_net()
    path = mg.onnx.export(net, tmp_path / "norms.onnx", ["image"], [logits], opset=opset)
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types.count("InstanceNormalization") == 3              # two group norms, one IN
    assert types.count("BatchNormalization") == 3                 # two tracked INs, the BN
    assert types.count("Transpose") >= 8
    max_differences(net, path, [logits], feed, ["image"], sizes=(1, 5))


def test_an_input_without_a_batch_axis_exports_with_its_reshapes(tmp_path):
    net = mg.Net(seed=1)
    x = L.data(net, "x", shape=(3, 7))
    y = L.instance_norm(net, x, spatial_dims=1, affine=False, name="a")
    y = L.instance_norm(net, y, spatial_dims=1, track_running_stats=True, name="b")
    loss = L.mean(net, L.multiply(net, y, y))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    feed = lambda rng, n: {"x": rng.standard_normal((3, 7)).astype("float32")}  # noqa: E731
    train(net, loss, feed)
    path = mg.onnx.export(net, tmp_path / "unbatched.onnx", ["x"], [y])
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert types.count("Reshape") == 4
    max_differences(net, path, [y], feed, ["x"], sizes=(1,))
