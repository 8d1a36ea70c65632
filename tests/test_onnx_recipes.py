"""ONNX export of the training-recipe ops: the elementwise math, the reductions, batched
matmul, embedding (Gather), the regression and binary losses and label smoothing.
Each file passes the full check, and onnxruntime and onnx's reference evaluator give
net.infer's outputs at two batch sizes, at opsets 13, 17 and 18 (ReduceMean and
ReduceMax take their axes as an input from 18)."""
import math

import pytest

import minigraph as mg
from minigraph import layers as L

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx_helpers import max_differences  # noqa: E402

OPSETS = [13, 17, 18]


def math_net():
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 3, 4))
    h = L.fc(net, x, 4, name="a")                          # (N, 4)
    pos = L.scale(net, L.abs(net, h), 1.0, 0.5)
    outs = [L.subtract(net, h, pos), L.divide(net, h, pos), L.exp(net, L.clip(net, h, -2, 2)),
            L.log(net, pos), L.sqrt(net, pos), L.square(net, h), L.pow(net, pos, 1.5),
            L.clip(net, h, min=0.0), L.reduce_sum(net, x, axis=(1, 2)),
            L.reduce_mean(net, x, axis=-1, keepdim=True), L.reduce_max(net, x, axis=1),
            L.reduce_mean(net, L.reduce_max(net, x))]
    return net, outs


@pytest.mark.parametrize("opset", OPSETS)
def test_math_and_reductions(tmp_path, opset):
    net, outs = math_net()
    path = mg.onnx.export(net, tmp_path / "math.onnx", ["x"], outs, opset=opset)
    types = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Sub", "Div", "Exp", "Log", "Sqrt", "Pow", "Clip", "Abs", "ReduceSum",
            "ReduceMean", "ReduceMax"} <= types
    feed = lambda rng, n: {"x": rng.standard_normal((n, 3, 4)).astype("float32")}  # noqa
    max_differences(net, path, outs, feed, ["x"], sizes=(1, 5))


def attention_net():
    net = mg.Net(seed=1)
    ids = L.data(net, "ids", (-1, 6), "int64")
    e = L.embedding(net, ids, 20, 8, padding_idx=0, name="emb")
    w = net.create_parameter("wq", (8, 8), "float32", mg.initializer.Normal(0.0, 0.3))
    q = L.matmul(net, e, w)
    scores = L.scale(net, L.matmul(net, q, e, transpose_y=True), 1 / math.sqrt(8))
    ctx = L.matmul(net, L.softmax(net, scores), e)
    pooled = L.reduce_mean(net, ctx, axis=1)
    t = L.matmul(net, e, q, transpose_x=True)              # (N, 8, 8)
    return net, [L.fc(net, pooled, 3, name="head"), t]


@pytest.mark.parametrize("opset", OPSETS)
def test_embedding_and_batched_matmul(tmp_path, opset):
    net, outs = attention_net()
    path = mg.onnx.export(net, tmp_path / "att.onnx", ["ids"], outs, opset=opset)
    types = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "Gather" in types and types.count("MatMul") >= 4 and "Transpose" in types
    feed = lambda rng, n: {"ids": rng.integers(0, 20, (n, 6))}  # noqa: E731
    max_differences(net, path, outs, feed, ["ids"], sizes=(1, 4))


def losses_net():
    net = mg.Net(seed=2)
    x = L.data(net, "x", (-1, 5))
    t = L.data(net, "t", (-1, 3))
    y = L.data(net, "y", (-1,), "int64")
    z = L.fc(net, x, 3, name="z")
    outs = [L.mse_loss(net, z, t), L.l1_loss(net, z, t, reduction="sum"),
            L.huber_loss(net, z, t, delta=0.5, reduction="none"),
            L.binary_cross_entropy_with_logits(net, z, L.sigmoid(net, t)),
            L.softmax_with_cross_entropy(net, z, y, label_smoothing=0.2),
            L.mean(net, L.softmax_with_cross_entropy(net, z, y))]
    return net, outs


@pytest.mark.parametrize("opset", OPSETS)
def test_losses_and_label_smoothing(tmp_path, opset):
    net, outs = losses_net()
    path = mg.onnx.export(net, tmp_path / "loss.onnx", ["x", "t", "y"], outs, opset=opset)

    def feed(rng, n):
        return {"x": rng.standard_normal((n, 5)).astype("float32") * 3,
                "t": rng.standard_normal((n, 3)).astype("float32"),
                "y": rng.integers(0, 3, n)}
    max_differences(net, path, outs, feed, ["x", "t", "y"], sizes=(1, 6))
