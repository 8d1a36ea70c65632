"""The op view with backward=True: each layer's gradient ops beside it."""
from __future__ import annotations

import shutil
import time

import pytest
from dot_helpers import parse, path_without_dot

import minigraph as mg
from minigraph.examples import train_digits, train_resnet_digits
from minigraph.pictures.layer_map import LayerMap


@pytest.fixture(scope="module")
def digits():
    return train_digits.build_net(mg.CPUPlace(), seed=0, fuse=False)[0]


@pytest.fixture(scope="module")
def resnet():
    return train_resnet_digits.build_net(mg.CPUPlace(), seed=0, fuse=False)[0]


def test_each_layer_is_a_cluster_with_its_gradient_cluster_beside_it(digits):
    g = parse(digits.to_dot(backward=True))
    names = [rec.name for rec in digits.layers]
    lmap = LayerMap(digits)
    for k in range(len(names)):
        assert g.clusters[f"cluster_layer_{k}"] == ("cluster_forward",)
        assert g.clusters[f"cluster_layer_{k}_grad"] == ("cluster_backward",)
    dot = digits.to_dot(backward=True)
    assert "label=<<b>conv1 (trunk)</b>>" in dot and "label=<<b>bn1</b>>" in dot
    for section in ("trunk", "train", "backward", "update"):
        for i, op in enumerate(digits.section(section)):
            k = names.index(lmap.layer_of(op))
            home = f"cluster_layer_{k}" + ("_grad" if section in ("backward", "update") else "")
            assert g.nodes[f"op:{section}:{i}"][0][-1] == home, (section, i, op.type)
    # the layer's persistables sit in its cluster, named without the layer's prefix
    assert g.nodes["var:root:bn1.estimated_mean"][0][-1] == f"cluster_layer_{names.index('bn1')}"
    assert "label=<estimated_mean<br/>" in g.nodes["var:root:bn1.estimated_mean"][1]
    assert "cluster_infer" not in g.clusters and not any(":infer:" in n for n in g.nodes)


def test_gradient_ops_are_level_with_the_ops_they_differentiate(digits):
    g = parse(digits.to_dot(backward=True))
    ranks = dict((b, a) for a, b in g.ranks)
    backward = digits.section("backward")
    train = digits.section("train")
    pairs = {(backward[int(b.split(":")[2])].type, a) for b, a in ranks.items()
             if b.startswith("op:backward:")}
    bn = f"op:train:{[op.type for op in train].index('batch_norm')}"
    assert ("batch_norm_grad", bn) in pairs
    assert ("conv2d_grad", "op:trunk:0") in pairs
    assert all(f"op:backward:{i}" in ranks for i in range(len(backward)))
    # each update is level with the op computing its parameter's gradient
    updates = [n for n in ranks if n.startswith("op:update:")]
    assert len(updates) == len(digits.section("update")) == 10
    assert all(ranks[n].startswith("op:backward:") for n in updates)


def test_gradients_flow_up_between_slots_and_are_not_nodes(digits):
    g = parse(digits.to_dot(backward=True))
    assert not any("@GRAD" in n for n in g.nodes)          # every gradient here is read
    flow = [e for e in g.edges if "dir=back" in e.attrs]
    assert flow and all(e.tail.startswith("op:") and e.head.startswith("op:backward:")
                        for e in flow)
    backward = digits.section("backward")
    mul_grad = next(i for i, op in enumerate(backward) if op.type == "mul_grad")
    relu_grad = next(i for i, op in enumerate(backward) if op.type == "relu_grad")
    # relu_1's gradient reads dx of fc2's mul_grad (its dy goes to fc2.w's update)
    edge = next(e for e in flow if e.tail == f"op:backward:{relu_grad}")
    assert edge.head == f"op:backward:{mul_grad}" and edge.head_port == "o_dx"
    # updates write their parameter in place: dashed edges to it
    writes = {e.head for e in g.edges if e.tail.startswith("op:update:")
              and "dir=back" not in e.attrs}
    assert all("style=dashed" in e.attrs for e in g.edges if e.head in writes)
    assert writes == {f"var:root:{p.name}" for p in digits.parameters()}
    assert not any("label=" in e.attrs for e in g.edges)


def test_ops_of_no_single_layer_sit_in_the_optimizer_cluster(resnet):
    g = parse(resnet.to_dot(backward=True))
    update = resnet.section("update")
    for name in ("lr_schedule", "clip_by_global_norm"):
        i = [op.type for op in update].index(name)
        assert g.nodes[f"op:update:{i}"][0] == ("cluster_backward", "cluster_optimizer")
        assert not any(f"op:update:{i}" in (e.tail, e.head) for e in g.edges)
    # the residual shortcut's gradients add up beside the layer whose output both read
    sums = [i for i, op in enumerate(resnet.section("backward")) if op.type == "sum"]
    assert len(sums) == 3


def test_the_residual_nets_backward_picture_renders_in_under_two_seconds(resnet, tmp_path,
                                                                        monkeypatch):
    """With graphviz-pure, the renderer a machine without Graphviz gets."""
    path_without_dot(tmp_path, monkeypatch)
    assert shutil.which("dot") is None
    start = time.perf_counter()
    svg = resnet.render(tmp_path / "backward.svg", backward=True).read_bytes()
    assert time.perf_counter() - start < 2.0
    assert b"cluster_layer_0_grad" in svg and b"conv2d_grad" in svg
