"""Reading the DOT source minigraph.render writes, for the picture tests."""
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
