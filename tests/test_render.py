"""Pictures of a net: the DOT source and files rendered with Graphviz."""
from __future__ import annotations

import re
import shutil

import pytest

import minigraph as mg
from minigraph import dot_runner
from minigraph import render as render_mod
from minigraph.examples.train_digits import build_net

NODE = re.compile(r'^\s*("(?:[^"\\]|\\.)*") \[(.*)\];$')
EDGE = re.compile(r'^\s*("(?:[^"\\]|\\.)*") -> ("(?:[^"\\]|\\.)*")(?: \[(.*)\])?;$')
needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="the Graphviz 'dot' program is not installed")


def parse(dot):
    """(nodes, edges): nodes {id: (cluster path, attrs)}, a node declared twice
    fails; edges [(tail, head, attrs)]."""
    nodes, edges, clusters = {}, [], []
    for line in dot.splitlines():
        text = line.strip()
        if text.startswith("subgraph "):
            clusters.append(text.split()[1])
        elif text == "}" and clusters:
            clusters.pop()
        elif (m := EDGE.match(line)) is not None:
            edges.append((m[1].strip('"'), m[2].strip('"'), m[3] or ""))
        elif (m := NODE.match(line)) is not None and not text.startswith(("graph", "node",
                                                                           "edge")):
            node = m[1].strip('"')
            assert node not in nodes, f"node {node} declared twice"
            nodes[node] = (tuple(clusters), m[2])
    return nodes, edges


@pytest.fixture(scope="module")
def net():
    return build_net(mg.CPUPlace(), seed=0)[0]


def op_id(net, branch, op):
    return f"op:{branch}:{net.section(branch).index(op)}"


def test_dot_has_trunk_and_both_branch_clusters(net):
    dot = net.to_dot()
    assert dot.startswith("digraph")
    for name in ("cluster_trunk", "cluster_train", "cluster_infer"):
        assert f"subgraph {name} {{" in dot
    nodes, _ = parse(dot)
    assert nodes["op:train:0"][0] == ("cluster_train",)
    assert nodes["op:infer:0"][0] == ("cluster_infer",)
    assert nodes["op:trunk:0"][0] == ("cluster_trunk",)
    # the branch temporaries share names, not nodes
    assert nodes["var:train:bn1.y"][0] == ("cluster_train",)
    assert nodes["var:infer:bn1.y"][0] == ("cluster_infer",)


def test_each_shared_persistable_is_one_node_outside_the_clusters_with_edges_into_both(net):
    nodes, edges = parse(net.to_dot())
    shared = {v.name for op in net.section("train") for v in op.input_vars() if v.persistable}
    assert {"bn1.scale", "bn1.estimated_mean", "bn2.num_batches", "fc1.w", "fc2.b"} <= shared
    for name in shared:
        node = f"var:root:{name}"
        assert node in nodes
        assert nodes[node][0] == (), f"{name} is drawn inside {nodes[node][0]}"
        assert "filled" in nodes[node][1] and "bold" in nodes[node][1]
        assert not any(n.endswith(f":{name}") for n in nodes if n != node)
        heads = {h.split(":")[1] for t, h, _ in edges if t == node}
        assert {"train", "infer"} <= heads, f"{name} feeds only {heads}"


def test_in_place_outputs_are_dashed_edges_labelled_with_the_slot(net):
    _, edges = parse(net.to_dot())
    for branch in ("train", "infer"):
        bn = next(op for op in net.section(branch) if op.type == "batch_norm")
        oid = op_id(net, branch, bn)
        for slot, var in (("saved_mean", "estimated_mean"), ("saved_var", "estimated_var"),
                          ("saved_num_batches", "num_batches")):
            alias = [a for t, h, a in edges if t == oid and h == f"var:root:bn1.{var}"]
            assert len(alias) == 1
            assert "style=dashed" in alias[0] and f'label="{slot}"' in alias[0]
        # the inputs are ordinary solid edges
        solid = [a for t, h, a in edges if t == "var:root:bn1.estimated_mean" and h == oid]
        assert solid and "dashed" not in solid[0]
    others = [a for _, _, a in edges if "dashed" in a]
    assert len(others) == 2 * 2 * 3          # two batch norms, two branches, three pairs


def test_is_infer_is_visible_on_mode_dependent_ops(net):
    nodes, _ = parse(net.to_dot())
    for branch, value in (("train", "False"), ("infer", "True")):
        bns = [op for op in net.section(branch) if op.type == "batch_norm"]
        assert len(bns) == 2
        for op in bns:
            label = nodes[op_id(net, branch, op)][1]
            assert f"is_infer={value}" in label
            assert "epsilon=1e-05" in label and "momentum=0.9" in label
    conv = nodes["op:trunk:0"][1]
    assert "conv2d" in conv and "strides=(1, 1)" in conv and "paddings=(1, 1)" in conv


def test_backward_and_updates_are_an_option_inside_the_train_cluster(net):
    plain = net.to_dot()
    assert "_grad" not in plain and "velocity" not in plain
    nodes, edges = parse(render_mod.to_dot(net, backward=True))
    grads = [n for n in nodes if n.startswith(("op:backward:", "op:update:"))]
    assert len(grads) == len(net.section("backward")) + len(net.section("update"))
    assert all(nodes[n][0] == ("cluster_train", "cluster_train_backward") for n in grads)
    assert nodes["var:root:fc1.w.velocity"][0] == ()
    # sgd/momentum write the parameter in place: a dashed edge back to it
    assert any(t.startswith("op:update:") and h == "var:root:fc1.w" and "dashed" in a
               for t, h, a in edges)


def test_dot_is_stable_across_builds(net):
    again = build_net(mg.CPUPlace(), seed=1)[0]
    assert net.to_dot() == again.to_dot()


@needs_dot
def test_render_writes_svg_png_and_pdf(net, tmp_path):
    svg = net.render(tmp_path / "net.svg")
    data = svg.read_bytes()
    assert data.lstrip().startswith(b"<?xml") and b"<svg" in data[:2000]
    assert b"cluster_train" in data and b"cluster_infer" in data
    assert render_mod.render(net, tmp_path / "net.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert render_mod.render(net, tmp_path / "net.pdf").read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.pdf", "net.png", "net.svg"]


def test_unknown_suffix_is_a_value_error_listing_the_formats(net, tmp_path):
    with pytest.raises(ValueError, match=r"\.svg, \.png, \.pdf"):
        net.render(tmp_path / "net.jpg")
    with pytest.raises(ValueError, match="suffix"):
        net.render(tmp_path / "net")


# ---- which program renders, and what happens when it misbehaves ----------------------

def path_without_dot(tmp_path, monkeypatch, fake=None):
    """PATH = one fresh folder holding only `fake` (a `dot` shell script body), if given."""
    folder = tmp_path / "bin"
    folder.mkdir()
    if fake is not None:
        script = folder / "dot"
        script.write_text("#!/bin/sh\nPATH=/usr/bin:/bin\n" + fake)
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    return folder


def test_without_dot_the_fallback_writes_svg_and_png(net, tmp_path, monkeypatch):
    path_without_dot(tmp_path, monkeypatch)
    assert shutil.which("dot") is None
    exe, name = dot_runner.find_program("svg")
    assert name == "graphviz-pure"
    out = tmp_path / "out"
    out.mkdir()
    data = net.render(out / "net.svg").read_bytes()
    assert data.lstrip().startswith(b"<?xml") and b"<svg" in data[:2000]
    assert b"cluster_train" in data and b"cluster_infer" in data and b"batch_norm" in data
    png = render_mod.render(net, out / "net.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert sorted(p.name for p in out.iterdir()) == ["net.png", "net.svg"]


def test_without_dot_pdf_says_it_needs_dot(net, tmp_path, monkeypatch):
    path_without_dot(tmp_path, monkeypatch)
    with pytest.raises(RuntimeError) as err:
        net.render(tmp_path / "net.pdf")
    msg = str(err.value)
    assert "needs Graphviz's 'dot'" in msg and "apt install graphviz" in msg
    assert "graphviz-pure" in msg and ".svg" in msg
    assert not (tmp_path / "net.pdf").exists()


def test_with_nothing_to_render_with_the_error_says_what_to_install(net, tmp_path, monkeypatch):
    path_without_dot(tmp_path, monkeypatch)
    monkeypatch.setattr(dot_runner, "_find_fallback", lambda: None)
    (tmp_path / "net.svg").write_text("old picture")
    with pytest.raises(RuntimeError) as err:
        net.render(tmp_path / "net.svg")
    msg = str(err.value)
    assert "pip install graphviz-pure" in msg and "apt install graphviz" in msg
    assert "to_dot()" in msg and msg == render_mod.missing_dot_message()
    assert (tmp_path / "net.svg").read_text() == "old picture"


@pytest.mark.parametrize("script, message", [
    ("exec sleep 30\n", "did not finish within 0.5 s"),
    ("sleep 30 & wait\n", "did not finish within 0.5 s"),
    ("echo 'Error: syntax error in line 3' >&2; exit 1\n", "failed with exit code 1: Error: "
                                                            "syntax error in line 3"),
    ("kill -9 $$\n", "was killed by signal 9"),
    ("cat > /dev/null; exit 0\n", "wrote nothing"),
    ("cat > /dev/null; echo not a picture\n", "did not write a .svg file"),
])
def test_a_dot_that_hangs_fails_or_writes_nothing_is_an_error(net, tmp_path, monkeypatch,
                                                              script, message):
    import time

    path_without_dot(tmp_path, monkeypatch, fake=script)
    assert shutil.which("dot") == str(tmp_path / "bin" / "dot")
    target = tmp_path / "net.svg"
    target.write_text("old picture")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=re.escape(message)) as err:
        render_mod.render(net, target, timeout=0.5)
    assert time.monotonic() - start < 10
    assert "no file was written" in str(err.value) and "dot" in str(err.value)
    assert target.read_text() == "old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "net.svg"]


def test_the_timeout_comes_from_the_environment_and_is_checked(net, tmp_path, monkeypatch):
    path_without_dot(tmp_path, monkeypatch, fake="exec sleep 30\n")
    monkeypatch.setenv("MINIGRAPH_DOT_TIMEOUT", "0.3")
    with pytest.raises(RuntimeError, match="within 0.3 s"):
        net.render(tmp_path / "net.svg")
    monkeypatch.setenv("MINIGRAPH_DOT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MINIGRAPH_DOT_TIMEOUT"):
        net.render(tmp_path / "net.svg")
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            render_mod.render(net, tmp_path / "net.svg", timeout=bad)
    assert dot_runner.DOT_TIMEOUT == 60.0


def test_a_dot_that_cannot_start_is_an_error(net, tmp_path, monkeypatch):
    folder = path_without_dot(tmp_path, monkeypatch, fake="")
    (folder / "dot").write_bytes(b"\x7fELF not really")
    with pytest.raises(RuntimeError, match="could not run dot"):
        net.render(tmp_path / "net.svg")


def test_a_net_that_never_forks_has_no_branch_clusters():
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3))
    mg.layers.relu(net, mg.layers.fc(net, x, size=2))
    nodes, edges = parse(net.to_dot())
    assert "subgraph cluster_train" not in net.to_dot()
    assert {n for n in nodes if n.startswith("op:")} == {"op:trunk:0", "op:trunk:1",
                                                          "op:trunk:2"}
    assert ("var:root:x", "op:trunk:0", 'label="x"') in edges
