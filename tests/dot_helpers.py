"""Reading the DOT source minigraph.pictures writes, for the picture tests."""
from __future__ import annotations

import re
import shutil
import struct
from typing import NamedTuple

import pytest

ID = r'"(?:[^"\\]|\\.)*"'
END = rf'({ID})(?::(\w+))?(?::[nsew])?'
NODE = re.compile(rf'^\s*({ID}) \[(.*)\];$')
EDGE = re.compile(rf'^\s*{END} -> {END}(?: \[(.*)\])?;$')
RANK = re.compile(rf'^\s*\{{rank=same; ({ID}); ({ID})\}}$')
PORT = re.compile(r'port="(\w+)"')
needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="the Graphviz 'dot' program is not installed")


class Edge(NamedTuple):
    tail: str
    tail_port: str | None
    head: str
    head_port: str | None
    attrs: str


class Dot(NamedTuple):
    nodes: dict           # id -> (cluster path, attrs)
    edges: list           # [Edge]
    ranks: list           # [(a, b)] of {rank=same; a; b}
    clusters: dict        # cluster name -> its parent cluster path


def parse(dot):
    """The nodes, edges, rank constraints and clusters of `dot`; a node declared twice,
    or a line that is none of these, fails the test."""
    nodes, edges, ranks, clusters, path = {}, [], [], {}, []
    lines = dot.splitlines()
    assert lines[0] == "digraph minigraph {" and lines[-1] == "}"
    for line in lines[1:-1]:
        text = line.strip()
        if text.startswith("subgraph "):
            name = text.split()[1]
            assert name not in clusters, f"cluster {name} twice"
            clusters[name] = tuple(path)
            path.append(name)
        elif text == "}":
            path.pop()
        elif (m := RANK.match(line)) is not None:
            ranks.append((m[1][1:-1], m[2][1:-1]))
        elif (m := EDGE.match(line)) is not None:
            edges.append(Edge(m[1][1:-1], m[2], m[3][1:-1], m[4], m[5] or ""))
        elif (m := NODE.match(line)) is not None:
            node = m[1][1:-1]
            assert node not in nodes, f"node {node} declared twice"
            nodes[node] = (tuple(path), m[2])
        else:
            assert text.startswith(("graph ", "node ", "edge ", "label=")), text
    assert not path
    return Dot(nodes, edges, ranks, clusters)


def ports(attrs):
    """The port names a node's label declares, in order."""
    return PORT.findall(attrs)


def png_size(data):
    """(width, height) of PNG bytes."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


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


# ---- do rendered labels fit their boxes? ------------------------------------------

SVG_NS = "{http://www.w3.org/2000/svg}"


def text_width(text, size, bold):
    """The advance width (points) of `text` set in DejaVu Sans (the widest font of the
    pictures' font list) at `size` points, from the TrueType file matplotlib ships, so
    the answer does not depend on the fonts this machine has."""
    ImageFont = pytest.importorskip("PIL.ImageFont")
    import matplotlib

    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    font = ImageFont.truetype(f"{matplotlib.get_data_path()}/fonts/ttf/{name}", 1000)
    return font.getlength(text) * size / 1000


def _extent(group):
    """(xmin, xmax) of the shapes drawn in an SVG group (polygons, paths, ellipses)."""
    xs = []
    for el in group.iter():
        tag = el.tag.replace(SVG_NS, "")
        if tag == "polygon":
            xs += [float(p.split(",")[0]) for p in el.get("points").split()]
        elif tag == "path":
            numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", el.get("d"))]
            xs += numbers[0::2]
        elif tag == "ellipse":
            cx, rx = float(el.get("cx")), float(el.get("rx"))
            xs += [cx - rx, cx + rx]
    return (min(xs), max(xs)) if xs else None


def overflowing_labels(svg, tolerance=0.5):
    """The texts of an SVG picture written by Graphviz that stick out of the node,
    cluster or graph they label when set in DejaVu Sans: [(group title, text,
    text width, box width)]. A text inside a node must lie within the node's shape;
    the graph's own title within the graph."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)
    found = []
    for group in root.iter(f"{SVG_NS}g"):
        kind = group.get("class")
        if kind not in ("node", "cluster", "graph"):
            continue
        box = _extent(group if kind != "graph" else _first_shape(group))
        title = group.find(f"{SVG_NS}title")
        title = title.text if title is not None else ""
        for text in group.findall(f"{SVG_NS}text"):
            content = "".join(text.itertext())
            if not content.strip() or box is None:
                continue
            width = text_width(content, float(text.get("font-size")),
                               text.get("font-weight") == "bold")
            x = float(text.get("x"))
            anchor = text.get("text-anchor", "start")
            left = x - width / 2 if anchor == "middle" else x - width if anchor == "end" else x
            if left < box[0] - tolerance or left + width > box[1] + tolerance:
                found.append((title, content, round(width, 1), round(box[1] - box[0], 1)))
    return found


def _first_shape(group):
    """A group holding only the first polygon of `group` (the graph's background)."""
    import xml.etree.ElementTree as ET

    holder = ET.Element("g")
    holder.append(group.find(f"{SVG_NS}polygon"))
    return holder
