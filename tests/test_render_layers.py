"""The layer view: one node per layer, the fork drawn once, in-place state, gradients."""
from __future__ import annotations

import re

import numpy as np
import pytest
from dot_helpers import parse

import minigraph as mg
from minigraph.examples import train_digits, train_resnet_digits
from minigraph.pictures import dot as render

DIGITS_CHAIN = ["data:image", "conv1", "bn1", "relu_0", "pool2d_0", "fc1", "bn2", "relu_1",
                "fc2", "softmax_with_cross_entropy_0", "mean_0"]


@pytest.fixture(scope="module")
def digits():
    return train_digits.build_net(mg.CPUPlace(), seed=0, fuse=False)


@pytest.fixture(scope="module")
def resnet():
    return train_resnet_digits.build_net(mg.CPUPlace(), seed=0, fuse=False)[0]


def layer_nodes(g):
    return {n[len("layer:"):]: attrs for n, (_, attrs) in g.nodes.items()
            if n.startswith("layer:")}


def test_one_node_per_layer_with_its_name_shape_and_parameters(digits):
    net = digits[0]
    g = parse(net.to_dot(level="layer"))
    nodes = layer_nodes(g)
    assert list(nodes) == [rec.name for rec in net.layers]
    for rec in net.layers:
        label = nodes[rec.name]
        assert label.count(f"<b>{rec.name}</b>") == 1 and rec.kind in label
        assert sum(f"<b>{rec.name}</b>" in a for _, a in g.nodes.values()) == 1
    assert "out (N, 16, 8, 8)" in nodes["conv1"] and "conv2d + elementwise_add" in nodes["conv1"]
    assert "160 params: w (16, 1, 3, 3) · b (16,)" in nodes["conv1"]
    assert "16,448 params: w (256, 64) · b (64,)" in nodes["fc1"]
    assert "32 params: scale (16,) · bias (16,)" in nodes["bn1"]
    assert "params" not in nodes["relu_0"] and "out (N, 64)" in nodes["relu_1"]
    assert not any(n.startswith("op:") for n in g.nodes)          # no op drawn on its own


def test_the_fork_is_drawn_once_with_the_mode_dependent_layers_marked(digits):
    net = digits[0]
    g = parse(net.to_dot(level="layer"))
    assert set(g.clusters) == {"cluster_trunk", "cluster_fork"}
    assert g.nodes["layer:conv1"][0] == ("cluster_trunk",)
    nodes = layer_nodes(g)
    for name in DIGITS_CHAIN[2:]:
        assert g.nodes[f"layer:{name}"][0] == ("cluster_fork",)
        marked = "differs per mode</b> (is_infer)" in nodes[name]
        assert marked == name.startswith("bn"), name
        assert ("penwidth=2" in nodes[name]) == marked
    assert g.nodes["data:image"][0] == () and g.nodes["data:label"][0] == ()


def test_edges_join_the_layers_that_read_each_others_outputs(digits):
    net = digits[0]
    g = parse(net.to_dot(level="layer"))
    flow = [(e.tail.removeprefix("layer:"), e.head.removeprefix("layer:")) for e in g.edges
            if not e.tail.startswith("state:") and not e.head.startswith("state:")]
    assert sorted(flow) == sorted(list(zip(DIGITS_CHAIN, DIGITS_CHAIN[1:])) + [
        ("data:label", "softmax_with_cross_entropy_0")])
    assert not any(e.attrs and "label=" in e.attrs for e in g.edges)


def test_persistables_written_in_place_are_a_state_box_beside_the_layer(digits):
    net = digits[0]
    g = parse(net.to_dot(level="layer"))
    states = {n for n in g.nodes if n.startswith("state:")}
    assert states == {"state:bn1", "state:bn2"}
    label = g.nodes["state:bn1"][1]
    for text in ("updated in place (train)", "estimated_mean (16,)", "estimated_var (16,)",
                 "num_batches () int64"):
        assert text in label
    assert ("state:bn1", "layer:bn1") in g.ranks
    read = [e for e in g.edges if e.tail == "state:bn1" and e.head == "layer:bn1"]
    write = [e for e in g.edges if e.tail == "layer:bn1" and e.head == "state:bn1"]
    assert len(read) == len(write) == 1
    assert "style=dashed" in write[0].attrs and "dashed" not in read[0].attrs


def test_the_residual_net_shows_its_shortcuts_shared_state_and_dropout(resnet):
    g = parse(resnet.to_dot(level="layer"))
    edges = {(e.tail, e.head) for e in g.edges}
    assert ("layer:relu_0", "layer:block1.add") in edges          # the identity shortcut
    assert ("layer:block1.b.bn", "layer:block1.add") in edges
    assert ("layer:down.proj.bn", "layer:down.add") in edges       # the projection
    assert {("layer:relu_2", "layer:mixed.1x1"), ("layer:relu_2", "layer:mixed.3x3"),
            ("layer:mixed.1x1", "layer:concat_0"), ("layer:mixed.3x3", "layer:concat_0")} <= edges
    nodes = layer_nodes(g)
    assert len(nodes) == len(resnet.layers) == 30
    assert "differs per mode" in nodes["drop"] and "step () int64" in g.nodes["state:drop"][1]
    assert "2,304 params: w (16, 16, 3, 3)" in nodes["block1.a.conv"]


def test_a_shared_parameter_is_named_on_the_layer_that_shares_it():
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 4))
    h = mg.layers.fc(net, x, 4, name="a", param_attr="tied", bias_attr=False)
    mg.layers.fc(net, h, 4, name="b", param_attr="tied", bias_attr=False)
    nodes = layer_nodes(parse(net.to_dot(level="layer")))
    assert "16 params: tied (4, 4)" in nodes["a"] and "shares tied" in nodes["b"]
    assert "params" not in nodes["b"]


def test_a_net_without_layer_records_is_drawn_from_its_output_names(digits):
    folded = mg.passes.fold_batch_norm(digits[0])
    assert folded.layers == []
    g = parse(folded.to_dot(level="layer"))
    assert {"layer:conv1", "layer:fc1", "layer:fc2", "layer:relu_0"} <= set(g.nodes)
    assert "batch_norm" not in "".join(a for _, a in g.nodes.values())     # folded away
    assert "differs per mode" not in "".join(a for _, a in g.nodes.values())
    # conv1 now adds the folded batch norm's bias too: named as the source net named it
    assert ">conv2d + elementwise_add<" in g.nodes["layer:conv1"][1]
    assert "params: w (16, 1, 3, 3)" in g.nodes["layer:conv1"][1]
    assert "shares" not in "".join(a for _, a in g.nodes.values())


def test_backward_adds_a_gradient_box_level_with_each_layer(digits):
    net = digits[0]
    g = parse(net.to_dot(level="layer", backward=True))
    grads = {n for n in g.nodes if n.startswith("grad:")}
    assert grads == {f"grad:{rec.name}" for rec in net.layers}
    for node in grads:
        assert g.nodes[node][0] == ("cluster_backward",)
        assert (f"layer:{node[5:]}", node) in g.ranks
    assert "batch_norm_grad, 2 × momentum" in g.nodes["grad:bn1"][1]
    back = {(e.tail, e.head) for e in g.edges if "dir=back" in e.attrs}
    assert ("grad:conv1", "grad:bn1") in back and len(back) == len(DIGITS_CHAIN) - 2


def test_resnet_backward_has_an_optimizer_box(resnet):
    g = parse(resnet.to_dot(level="layer", backward=True))
    assert "lr_schedule, clip_by_global_norm" in g.nodes["grad:(optimizer)"][1]


def test_a_profile_colours_each_layer_by_its_share(digits):
    net, h = digits
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    table = net.profile({"image": x, "label": np.arange(8) % 10}, steps=2, warmup=1)
    g = parse(net.to_dot(level="layer", profile=table))
    heat = render.Heat(table, layers=True)
    for rec in net.layers:
        attrs = g.nodes[f"layer:{rec.name}"][1]
        share = table.layer_share(rec.name)
        assert f"{100 * share:.1f}% of the step" in attrs
        assert re.search(r'fillcolor="(#[0-9a-f]{6})"', attrs)[1] == heat.colour(share)
    hottest = max(table.by_layer[:-1], key=lambda r: r.share).name
    assert 'fillcolor="#f46d43"' in g.nodes[f"layer:{hottest}"][1]
    g = parse(net.to_dot(level="layer", backward=True, profile=table))
    forward = [op for op in net.ops("train", update=False) if op in net.section("train")
               and op.type == "batch_norm"][:1]
    assert f"{100 * table.ops_share(forward):.1f}% of the step" in g.nodes["layer:bn1"][1]
    assert "% of the step" in g.nodes["grad:bn1"][1]


INFERENCE_NETS = {
    "fold_batch_norm": lambda net, tmp: mg.passes.fold_batch_norm(net),
    "optimize_for_inference": lambda net, tmp: mg.passes.optimize_for_inference(net),
    "load_inference": lambda net, tmp: mg.io.load_inference(mg.io.save_inference(
        mg.passes.optimize_for_inference(net), tmp / "model", feeds=["image"],
        fetches=["fc2.out"])),
}


@pytest.mark.parametrize("made_by", INFERENCE_NETS)
def test_an_inference_net_is_drawn_as_what_it_runs(made_by, tmp_path):
    """The layer picture of an optimize_for_inference net was titled "trunk (run once,
    shared by train and infer)", drew dropout as "updated in place (train)", the loss
    ops and the label, and named conv1 after its relu (relu_0)."""
    net, h = train_digits.build_net(mg.CPUPlace(), seed=0)
    net.train(feed={"image": np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32),
                    "label": np.arange(8) % 10})
    inference = INFERENCE_NETS[made_by](net, tmp_path)
    for level in ("layer", "op"):
        text = inference.to_dot(level=level)
        g = parse(text)
        assert "inference net (" in text and ("made by" in text or "loaded from" in text)
        assert "trunk (" not in text and "after the fork" not in text and " branch (" not in text
        assert set(g.clusters) == {"cluster_inference"}
        for absent in ("softmax_with_cross_entropy", "mean_0", ":label\"", "updated in place",
                       "differs per mode", "train only", "infer only"):
            assert absent not in text, (level, absent)
    names = set(layer_nodes(parse(inference.to_dot(level="layer"))))
    assert {"conv1", "relu_0", "pool2d_0", "fc1", "relu_1", "fc2"} >= names >= {"conv1", "fc2"}
    assert "bn1" not in names and "bn2" not in names          # folded into conv1 and fc1
    if made_by != "fold_batch_norm":                # fused: conv + bias + relu + max pool
        assert names == {"conv1", "fc1", "fc2"}
    with pytest.raises(RuntimeError, match=r"train: this is an inference net \((made by|"
                                           r"loaded from) .*it computes 'fc2.out'"):
        inference.train(feed={"image": np.zeros((2, 1, 8, 8), np.float32)})


def test_a_picture_shows_the_declared_batch_not_the_last_run(digits):
    """The op view labelled the train branch (N, 32, 28, 28) but the trunk and the infer
    branch (500, ...): the sizes of the last run."""
    net, h = train_digits.build_net(mg.CPUPlace(), seed=0)
    rng = np.random.default_rng(0)
    net.train(feed={"image": rng.random((7, 1, 8, 8), dtype=np.float32),
                    "label": np.arange(7) % 10})
    net.infer(feed={"image": rng.random((500, 1, 8, 8), dtype=np.float32)},
              fetch=[h["logits"]])
    assert h["logits"].value is not None or net.var("fc2.out", "infer").value is not None
    for level in ("op", "layer"):
        text = net.to_dot(level=level)
        assert "(N, 16, 8, 8)" in text and "(N, 10)" in text
        assert not re.search(r"\((7|500), ", text), level


def test_channels_last_layers_say_so_with_their_shapes():
    """A channels-last layer's output shape is (N, H, W, C) and its box says NHWC (also
    in the folded and fused net, drawn from its op names); its filter keeps (out, in,
    kh, kw); NCHW layers say nothing more."""
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "image", shape=(-1, 8, 6, 3))
    h = mg.layers.conv2d(net, x, 4, 3, padding=1, name="c", data_layout="NHWC")
    h = mg.layers.relu(net, mg.layers.batch_norm(net, h, name="bn", data_layout="NHWC"))
    h = mg.layers.pool2d(net, h, 2, name="p", data_layout="NHWC")
    mg.layers.conv2d(net, mg.layers.transpose(net, h, (0, 3, 1, 2)), 2, 1, name="nchw")
    nodes = layer_nodes(parse(net.to_dot(level="layer")))
    assert "out (N, 8, 6, 4) NHWC" in nodes["c"] and "w (4, 3, 3, 3) · b (4,)" in nodes["c"]
    assert "out (N, 8, 6, 4) NHWC" in nodes["bn"] and "out (N, 4, 3, 4) NHWC" in nodes["p"]
    assert "out (N, 2, 4, 3)<" in nodes["nchw"]
    fast = mg.passes.optimize_for_inference(net)
    nodes = layer_nodes(parse(fast.to_dot(level="layer")))
    assert "out (N, 4, 3, 4) NHWC" in nodes["c"] and ">fused_conv2d<" in nodes["c"]  # pooled
    ops = parse(net.to_dot())
    assert any("data_layout=NHWC" in a and "pool2d" in a for _, a in ops.nodes.values())


def test_a_fused_batch_norm_relu_is_drawn_in_its_batch_norm_layer():
    """The demo net fuses each batch norm and its relu (mg.passes.fuse_batch_norm_relu):
    the layer view draws the batch norm's layer with the fused op (the relu layers have
    no op left), its state box and the chain through it; the op view draws the fused
    op, which writes the relu's output."""
    net = train_digits.build_net(mg.CPUPlace(), seed=0)[0]
    g = parse(net.to_dot(level="layer", backward=True))
    nodes = layer_nodes(g)
    assert "relu_0" not in nodes and "relu_1" not in nodes
    assert "batch_norm_relu" in nodes["bn1"] and "32 params: scale (16,) · bias (16,)" in \
        nodes["bn1"]
    assert "differs per mode</b> (is_infer)" in nodes["bn1"]
    edges = {(e.tail, e.head) for e in g.edges}
    assert ("layer:conv1", "layer:bn1") in edges and ("layer:bn1", "layer:pool2d_0") in edges
    assert "grad:bn1" in g.nodes and "batch_norm_relu_grad" in g.nodes["grad:bn1"][1]
    ops = parse(net.to_dot())
    fused = [attrs for node, (_, attrs) in ops.nodes.items()
             if node.startswith("op:train:") and "batch_norm_relu" in attrs]
    assert len(fused) == 2
    assert "var:train:relu_0.out" in ops.nodes and "var:train:bn1.y" not in ops.nodes
