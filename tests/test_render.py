"""Pictures of a net: the op view's DOT source, files rendered with Graphviz (or
graphviz-pure), levels and profiles as arguments."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from dot_helpers import needs_dot, parse, path_without_dot, png_size, ports

import minigraph as mg
from minigraph.examples.train_digits import build_net
from minigraph.pictures import dot, dot_runner
from minigraph.pictures import render as render_mod


@pytest.fixture(scope="module")
def net():
    return build_net(mg.CPUPlace(), seed=0, fuse=False)[0]


def op_id(net, branch, op):
    return f"op:{branch}:{net.section(branch).index(op)}"


def test_dot_has_trunk_and_both_branch_clusters(net):
    dot = net.to_dot()
    assert dot.startswith("digraph") and dot == net.to_dot(level="op")
    g = parse(dot)
    assert set(g.clusters) == {"cluster_trunk", "cluster_train", "cluster_infer"}
    assert g.nodes["op:train:0"][0] == ("cluster_train",)
    assert g.nodes["op:infer:0"][0] == ("cluster_infer",)
    assert g.nodes["op:trunk:0"][0] == ("cluster_trunk",)
    # the branch temporaries share names, not nodes
    assert g.nodes["var:train:bn1.y"][0] == ("cluster_train",)
    assert g.nodes["var:infer:bn1.y"][0] == ("cluster_infer",)
    ops = {n for n in g.nodes if n.startswith("op:")}
    assert len(ops) == sum(len(net.section(s)) for s in ("trunk", "train", "infer"))


def test_each_shared_persistable_is_one_node_outside_the_clusters_with_edges_into_both(net):
    g = parse(net.to_dot())
    shared = {v.name for op in net.section("train") for v in op.input_vars() if v.persistable}
    assert {"bn1.scale", "bn1.estimated_mean", "bn2.num_batches", "fc1.w", "fc2.b"} <= shared
    for name in shared:
        node = f"var:root:{name}"
        assert g.nodes[node][0] == (), f"{name} is drawn inside {g.nodes[node][0]}"
        assert "filled" in g.nodes[node][1] and "bold" in g.nodes[node][1]
        assert not any(n.endswith(f":{name}") for n in g.nodes if n != node)
        heads = {e.head.split(":")[1] for e in g.edges if e.tail == node}
        assert {"train", "infer"} <= heads, f"{name} feeds only {heads}"


def test_edges_start_and_end_at_slots_and_carry_no_labels(net):
    """No edge label can print over another ('x' + 'saved_mean' as 'xsaved_mean'): an
    op with several slots on a side names them in its box, one port each."""
    g = parse(net.to_dot())
    assert not any("label=" in e.attrs for e in g.edges)
    bn = op_id(net, "train", next(op for op in net.section("train") if op.type == "batch_norm"))
    declared = ports(g.nodes[bn][1])
    assert len(declared) == len(set(declared))                      # no port twice
    assert declared == ["i_x", "i_estimated_mean", "i_estimated_var", "i_scale", "i_bias",
                        "i_num_batches", "o_y", "o_batch_mean", "o_batch_var", "o_saved_mean",
                        "o_saved_var", "o_saved_num_batches"]
    into = {e.head_port: e.tail for e in g.edges if e.head == bn}
    assert into["i_x"] == "var:root:conv1.out" and into["i_scale"] == "var:root:bn1.scale"
    for node, (_, attrs) in g.nodes.items():       # every port an edge names is declared
        used = {e.tail_port for e in g.edges if e.tail == node and e.tail_port}
        used |= {e.head_port for e in g.edges if e.head == node and e.head_port}
        assert used <= set(ports(attrs)), node
    relu = op_id(net, "train", next(op for op in net.section("train") if op.type == "relu"))
    assert ports(g.nodes[relu][1]) == []          # one slot a side: edges meet the box


def test_in_place_outputs_are_dashed_edges_from_their_slot(net):
    g = parse(net.to_dot())
    for branch in ("train", "infer"):
        bn = next(op for op in net.section(branch) if op.type == "batch_norm")
        oid = op_id(net, branch, bn)
        for slot, var in (("saved_mean", "estimated_mean"), ("saved_var", "estimated_var"),
                          ("saved_num_batches", "num_batches")):
            alias = [e for e in g.edges if e.tail == oid and e.head == f"var:root:bn1.{var}"]
            assert len(alias) == 1
            assert "style=dashed" in alias[0].attrs and alias[0].tail_port == f"o_{slot}"
            grey = dot.IDLE_COLOR in alias[0].attrs
            assert grey == (branch == "infer")        # the infer copy never writes it
        solid = [e for e in g.edges if e.tail == "var:root:bn1.estimated_mean" and e.head == oid]
        assert solid and "dashed" not in solid[0].attrs
    assert sum("dashed" in e.attrs for e in g.edges) == 2 * 2 * 3   # 2 bns, 2 branches, 3 pairs


def test_is_infer_is_visible_on_mode_dependent_ops(net):
    g = parse(net.to_dot())
    for branch, value in (("train", "False"), ("infer", "True")):
        bns = [op for op in net.section(branch) if op.type == "batch_norm"]
        assert len(bns) == 2
        for op in bns:
            label = g.nodes[op_id(net, branch, op)][1]
            assert f"<b>is_infer={value}</b>" in label
            assert "epsilon=1e-05" in label and "momentum=0.9" in label
    conv = g.nodes["op:trunk:0"][1]
    assert "conv2d" in conv and "strides=(1, 1)" in conv and "paddings=(1, 1)" in conv


def test_dot_is_stable_across_builds(net):
    again = build_net(mg.CPUPlace(), seed=1, fuse=False)[0]
    for level in ("op", "layer"):
        for backward in (False, True):
            assert net.to_dot(backward, level) == again.to_dot(backward, level)


def test_a_bad_level_or_profile_is_an_error_naming_it(net, tmp_path):
    with pytest.raises(ValueError, match=r"to_dot: level must be one of 'op', 'layer', got "
                                         r"'layers'"):
        net.to_dot(level="layers")
    with pytest.raises(ValueError, match="level must be one of"):
        net.render(tmp_path / "net.svg", level=None)
    with pytest.raises(TypeError, match=r"to_dot: profile must be the table net.profile\(...\) "
                                        "returns, got dict"):
        net.to_dot(profile={"conv2d": 0.5})
    assert list(tmp_path.iterdir()) == []


def test_a_profile_colours_the_ops_it_timed_by_their_share(net):
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    table = net.profile({"image": x, "label": np.arange(8) % 10}, steps=2, warmup=1)
    g = parse(net.to_dot(profile=table))
    fills = {}
    for node, (_, attrs) in g.nodes.items():
        if node.startswith("op:"):
            fills[node] = re.search(r'fillcolor="(#[0-9a-f]{6})"', attrs)[1]
    for branch in ("trunk", "train"):
        for i, op in enumerate(net.section(branch)):
            share = table.op_share(op)
            assert share is not None
            label = g.nodes[f"op:{branch}:{i}"][1]
            assert f"{100 * share:.1f}% of the step" in label
            assert fills[f"op:{branch}:{i}"] == dot.Heat(table).colour(share)
    assert all(fills[f"op:infer:{i}"] == dot.OP_FILL             # not timed
               for i in range(len(net.section("infer"))))
    hottest = max(table.by_op, key=lambda r: r.share)
    assert dot.Heat(table).colour(hottest.share) == "#f46d43"
    assert dot.Heat(table).colour(0.0) == "#ffffff"
    header = re.search(r"share of a timed train step \(([0-9.e+-]+) ms", net.to_dot(profile=table))
    assert header, "the header names the base of the shares"
    assert header[1] == f"{table.timed_step_ms:.3g}"   # the step the shares are of
    other = build_net(mg.CPUPlace(), seed=0, fuse=False)[0]
    with pytest.raises(ValueError, match="measured on another net"):
        other.to_dot(profile=table)


def test_a_net_that_never_forks_has_no_branch_clusters():
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3))
    mg.layers.relu(net, mg.layers.fc(net, x, size=2))
    g = parse(net.to_dot())
    assert set(g.clusters) == {"cluster_trunk"}
    assert {n for n in g.nodes if n.startswith("op:")} == {"op:trunk:0", "op:trunk:1",
                                                            "op:trunk:2"}
    assert ("var:root:x", "op:trunk:0", "i_x") in {(e.tail, e.head, e.head_port)
                                                     for e in g.edges}


# ---- files: formats, the fallback renderer, levels -----------------------------------

@needs_dot
def test_render_writes_svg_png_and_pdf(net, tmp_path):
    svg = net.render(tmp_path / "net.svg")
    data = svg.read_bytes()
    assert data.lstrip().startswith(b"<?xml") and b"<svg" in data[:2000]
    assert b"cluster_train" in data and b"cluster_infer" in data
    assert render_mod.render(net, tmp_path / "net.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert render_mod.render(net, tmp_path / "net.pdf").read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.pdf", "net.png", "net.svg"]


@pytest.mark.parametrize("level, backward, most", [
    ("layer", False, (1200, 1600)), ("layer", True, (1800, 1800)),
    ("op", False, (3000, 3200)), ("op", True, (3000, 4000))])
def test_each_level_renders_to_a_png_of_a_readable_size(net, tmp_path, monkeypatch, level,
                                                        backward, most):
    """With Graphviz's dot where it is installed, else with graphviz-pure; each of the
    digits net's pictures stays within a few screens."""
    if shutil.which("dot") is None:
        path_without_dot(tmp_path, monkeypatch)
    png = net.render(tmp_path / "net.png", backward=backward, level=level).read_bytes()
    width, height = png_size(png)
    assert 300 < width <= most[0] and 300 < height <= most[1], (width, height)


def test_unknown_suffix_is_a_value_error_listing_the_formats(net, tmp_path):
    with pytest.raises(ValueError, match=r"\.svg, \.png, \.pdf"):
        net.render(tmp_path / "net.jpg")
    with pytest.raises(ValueError, match="suffix"):
        net.render(tmp_path / "net")


# ---- which program renders, and what happens when it misbehaves ----------------------

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


def _programs():
    found = [dot_runner.FALLBACK] if dot_runner._find_fallback() else []
    return found + (["dot"] if shutil.which("dot") else [])


@pytest.mark.parametrize("program", _programs())
def test_svg_labels_fit_their_boxes_in_a_font_other_than_helvetica(program, tmp_path,
                                                                    monkeypatch):
    """SVGs named only Helvetica: a viewer without it drew wider labels that overflowed
    their boxes ("relu_0relu", cluster titles wider than their clusters). Labels are now
    laid out in DejaVu Sans, the widest font of the list the SVG names, and must fit."""
    from dot_helpers import overflowing_labels

    from minigraph.examples import train_resnet_digits

    exe = shutil.which(program) if program == "dot" else dot_runner._find_fallback()
    monkeypatch.setattr(dot_runner, "find_program", lambda fmt: (exe, program))
    digits, h = build_net(mg.CPUPlace(), seed=0)
    x = np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32)
    digits.train(feed={"image": x, "label": np.arange(8) % 10})
    table = digits.profile({"image": x, "label": np.arange(8) % 10}, steps=1, warmup=1)
    resnet = train_resnet_digits.build_net(seed=0)[0]
    fast = mg.passes.optimize_for_inference(digits)
    pictures = {"ops": (digits, {}), "layers": (digits, {"level": "layer"}),
                "backward": (digits, {"backward": True}),
                "layer_backward": (digits, {"level": "layer", "backward": True}),
                "profile": (digits, {"level": "layer", "profile": table}),
                "resnet": (resnet, {"level": "layer"}), "fast": (fast, {}),
                "fast_layers": (fast, {"level": "layer"})}
    for name, (net, kwargs) in pictures.items():
        svg = net.render(tmp_path / f"{name}.svg", **kwargs).read_bytes()
        assert b'font-family="DejaVu Sans,' in svg and b'"Helvetica"' not in svg
        assert overflowing_labels(svg) == [], name


def test_the_svg_names_a_font_list_with_fallbacks(net, tmp_path):
    svg = net.render(tmp_path / "net.svg").read_text()
    families = set(re.findall(r'font-family="([^"]*)"', svg))
    assert families == {dot.FONT_FAMILY}
    assert dot.FONT_FAMILY.split(",")[0] == dot.FONT and "sans-serif" in dot.FONT_FAMILY
    assert f'fontname="{dot.FONT}"' in net.to_dot()
    # a PNG or PDF carries the face it was drawn in: one graphviz-pure has a sans face for
    raster = dot.raster_source(net.to_dot())
    assert raster.count(f'fontname="{dot.RASTER_FONT}"') == 3 and dot.FONT not in raster
