"""Regenerate the pictures of the demo net shown in docs/pictures.md and the README.

    python docs/make_pictures.py [--out docs/pictures]

Writes the layer view of the digits demo net (minigraph.examples.train_digits)
as digits_layers.png and its op view as digits_ops.svg, and prints their
sizes. They are drawn by Graphviz's `dot` when it is on PATH, else by
graphviz-pure; the committed ones were drawn by graphviz-pure, which draws
the same picture on every platform. The net is built, not trained: a
picture shows the graph, which training does not change.
"""
from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PICTURES = (("digits_layers.png", "layer"), ("digits_ops.svg", "op"))


def make(out):
    """Write the pictures into `out` (created if missing); returns [(path, size text)]."""
    import minigraph as mg
    from minigraph.examples.train_digits import build_net

    out.mkdir(parents=True, exist_ok=True)
    net, _ = build_net(mg.CPUPlace(), seed=0)
    done = []
    for name, level in PICTURES:
        path = net.render(out / name, level=level)
        done.append((path, _size(path)))
    return done


def _size(path):
    data = path.read_bytes()
    kib = f"{len(data) / 1024:.0f} KiB"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        width, height = struct.unpack(">II", data[16:24])
        return f"{width}x{height} px, {kib}"
    return kib


def main(argv=None):
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "pictures",
                        help="folder for the pictures (default: docs/pictures)")
    args = parser.parse_args(argv)
    try:
        done = make(args.out)
    except RuntimeError as e:           # nothing on this machine can render
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path, size in done:
        print(f"wrote {path} ({size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
