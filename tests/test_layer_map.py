"""Which layer each op belongs to (minigraph.pictures.layer_map)."""
from __future__ import annotations

import pytest

import minigraph as mg
from minigraph import layers as L
from minigraph.examples import train_digits, train_resnet_digits
from minigraph.pictures.layer_map import LayerMap


@pytest.fixture(scope="module")
def digits():
    """The digits net with its batch norms and relus as separate ops."""
    return train_digits.build_net(mg.CPUPlace(), seed=0, fuse=False)[0]


def owners(net, section):
    lmap = LayerMap(net)
    return [(op.type, lmap.layer_of(op)) for op in net.section(section)]


def test_forward_ops_of_both_branches_belong_to_the_layer_that_appended_them(digits):
    assert owners(digits, "trunk") == [("conv2d", "conv1"), ("elementwise_add", "conv1")]
    expected = [("batch_norm", "bn1"), ("relu", "relu_0"), ("pool2d", "pool2d_0"),
                ("mul", "fc1"), ("elementwise_add", "fc1"), ("batch_norm", "bn2"),
                ("relu", "relu_1"), ("mul", "fc2"), ("elementwise_add", "fc2"),
                ("softmax_with_cross_entropy", "softmax_with_cross_entropy_0"),
                ("mean", "mean_0")]
    assert owners(digits, "train") == expected and owners(digits, "infer") == expected
    assert LayerMap(digits).names == [rec.name for rec in digits.layers]


def test_gradient_ops_belong_to_the_layer_whose_outputs_gradients_they_read(digits):
    assert owners(digits, "backward") == [
        ("fill_constant", "mean_0"), ("mean_grad", "mean_0"),
        ("softmax_with_cross_entropy_grad", "softmax_with_cross_entropy_0"),
        ("elementwise_add_grad", "fc2"), ("mul_grad", "fc2"), ("relu_grad", "relu_1"),
        ("batch_norm_grad", "bn2"), ("elementwise_add_grad", "fc1"), ("mul_grad", "fc1"),
        ("pool2d_grad", "pool2d_0"), ("relu_grad", "relu_0"), ("batch_norm_grad", "bn1"),
        ("elementwise_add_grad", "conv1"), ("conv2d_grad", "conv1")]
    lmap = LayerMap(digits)
    mul_grad = next(op for op in digits.section("backward") if op.type == "mul_grad")
    assert lmap.forward_of(mul_grad) is digits.section("train")[7]      # fc2's mul
    assert lmap.forward_of(digits.section("train")[0]) is None          # not a gradient op


def test_updates_belong_to_their_parameters_layer_and_shared_ops_to_none():
    net = train_resnet_digits.build_net(mg.CPUPlace(), seed=0, fuse=False)[0]
    update = owners(net, "update")
    assert update[:2] == [("lr_schedule", None), ("clip_by_global_norm", None)]
    assert ("adam", "stem.conv") in update and ("adam", "head") in update
    backward = owners(net, "backward")
    # the gradient of a value two layers read is summed in the layer that computed it
    assert [layer for op_type, layer in backward if op_type == "sum"] == ["relu_3", "relu_2",
                                                                          "relu_0"]
    lmap = LayerMap(net)      # dotted layer names: the longest prefix wins
    assert lmap.name_layer("block1.a.bn.estimated_mean") == "block1.a.bn"
    assert lmap.name_layer("block1.a.conv.out@GRAD@1") == "block1.a.conv"
    assert lmap.name_layer("block1.w") is None and lmap.name_layer("learning_rate_0") is None


def test_an_inference_net_keeps_the_layer_names_of_its_source(digits):
    folded = mg.passes.fold_batch_norm(digits)
    lmap = LayerMap(folded)
    assert lmap.records == {} and lmap.names[:3] == ["conv1", "relu_0", "pool2d_0"]
    # the bias add that now writes the folded batch norm's output is conv1's
    trunk = folded.section("trunk")
    assert [(op.type, lmap.layer_of(op)) for op in trunk][:2] == [("conv2d", "conv1"),
                                                                   ("elementwise_add", "conv1")]


def test_a_net_without_layer_names_gets_its_layers_from_output_names(digits):
    folded = mg.passes.fold_batch_norm(digits)
    for op in folded.section("trunk"):         # as a model saved before ops named their layer
        op.layer = None
    lmap = LayerMap(folded)
    assert lmap.records == {} and lmap.names[:2] == ["conv1", "bn1"]
    # conv1's bias add now writes the folded batch norm's output, bn1.y
    trunk = folded.section("trunk")
    assert [(op.type, lmap.layer_of(op)) for op in trunk][:2] == [("conv2d", "conv1"),
                                                                   ("elementwise_add", "bn1")]


def test_ops_updating_state_in_place_belong_to_their_layer():
    """A KV cache's ops write its state (length, slabs) in place: those outputs say
    nothing of the op's layer, so each belongs to the layer that appended it."""
    net = mg.Net(seed=0)
    tok = L.data(net, "tok", (-1, -1), "int64")
    cache = L.KVCache(8)
    h = L.position_embedding(net, L.embedding(net, tok, 5, 4, name="wte"), 8, kv_cache=cache,
                             name="wpe")
    L.multi_head_attention(net, h, 2, causal=True, kv_cache=cache, name="attn")
    layers = LayerMap(net)
    owners = {op.type: layers.layer_of(op) for op in net.section("infer")}
    assert owners["position_embedding"] == "wpe" and owners["kv_cache_write"] == "attn"
    assert "kv_cache_0" not in layers.names


def test_a_fused_batch_norm_relu_and_its_grad_belong_to_the_batch_norm_layer():
    """batch_norm_relu writes the relu's output and the batch norm's statistics (two
    layers' names): it belongs to the layer of the persistables it reads, and its grad op
    to its forward op's layer; the relu layers are left without ops."""
    net = train_digits.build_net(mg.CPUPlace(), seed=0)[0]
    expected = [("batch_norm_relu", "bn1"), ("pool2d", "pool2d_0"), ("mul", "fc1"),
                ("elementwise_add", "fc1"), ("batch_norm_relu", "bn2"), ("mul", "fc2")]
    for section in ("train", "infer"):
        assert owners(net, section)[:6] == expected
    grads = [(t, layer) for t, layer in owners(net, "backward") if t.startswith("batch_norm")]
    assert grads == [("batch_norm_relu_grad", "bn2"), ("batch_norm_relu_grad", "bn1")]
