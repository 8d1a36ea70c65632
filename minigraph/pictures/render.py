"""Pictures of a net: DOT source (no binary needed) and files rendered by Graphviz.

Two levels. `level="layer"` (minigraph.pictures.layer_view) draws one node per
layer. `level="op"` (this module) draws every op and variable:

ops are boxes (type in bold, attributes below, the mode attribute a schema
declares (`is_infer`) in bold); an op with several input or output slots
names them in small type along its edges, and each edge starts or ends at
its slot, so edges carry no labels. Variables are ovals, data doubly
outlined, persistables filled and bold (parameters blue, other persistables
such as estimates and counters orange). The trunk and the two branches are
clusters (`cluster_trunk`, `cluster_train`, `cluster_infer`); persistables
and data sit outside every cluster, drawn once, with edges into both
branches. An in-place output (`saved_mean` -> `estimated_mean`) is a dashed
edge from its slot; it is grey on infer copies (mode attribute True), which
never write it.

backward=True draws the train path with each layer's gradient ops beside
it (minigraph.pictures.backward_view).

profile=table (net.profile's) fills each op the table timed with a colour
for its share of the step and adds that share to its label.
"""
from __future__ import annotations

from pathlib import Path

from minigraph.io.files import atomic_write
from minigraph.pictures import dot_runner
from minigraph.pictures.dot import raster_source, svg_fonts

FORMATS = (".svg", ".png", ".pdf")
LEVELS = ("op", "layer")


def to_dot(net, backward=False, level="op", profile=None):
    """DOT source of `net` (a str); needs no Graphviz binary.

    level: "op" (every op and variable) or "layer" (one node per layer; see
    minigraph.pictures.layer_view). backward: also draw the gradient and update ops.
    profile: a table from net.profile() to colour the nodes by their share of
    the step. Node ids are stable: `var:<scope>:<name>` (scope is root, train
    or infer) and `op:<section>:<index>` in the op view; `layer:<name>`,
    `data:<name>` (and `grad:<name>`, `state:<name>`) in the layer view."""
    if level not in LEVELS:
        raise ValueError(f"to_dot: level must be one of {', '.join(map(repr, LEVELS))}, got "
                         f"{level!r}")
    if profile is not None:
        from minigraph.pictures.profile import check_table

        check_table(profile, net, "to_dot")
    if level == "layer":
        from minigraph.pictures.layer_view import layer_dot

        return layer_dot(net, backward=backward, profile=profile)
    if backward:
        from minigraph.pictures.backward_view import backward_dot

        return backward_dot(net, profile)
    from minigraph.pictures.op_view import op_dot

    return op_dot(net, profile)


def render(net, path, backward=False, timeout=None, level="op", profile=None):
    """Write the picture of `net` to `path`: .svg, .png or .pdf by suffix.

    level, backward and profile as in to_dot. Runs Graphviz's `dot` when it is
    on PATH, else the pip-installed graphviz-pure (svg and png only; .pdf then
    needs `dot`, and says so). The program gets `timeout` seconds (default 60,
    or MINIGRAPH_DOT_TIMEOUT); one that hangs, fails or writes nothing is a
    RuntimeError and no file is written (see minigraph.pictures.dot_runner). The file is
    written atomically (a temporary file in the same directory, then renamed).
    Returns the path.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"render: cannot tell the format of {str(path)!r} from its suffix "
                         f"{suffix or '(none)'!r}; use one of {', '.join(FORMATS)}")
    source = to_dot(net, backward=backward, level=level, profile=profile)
    if suffix != ".svg":
        source = raster_source(source)
    data = dot_runner.pipe(source, suffix[1:], timeout=timeout)
    if suffix == ".svg":
        data = svg_fonts(data)
    return atomic_write(path, lambda f: f.write(data))


def missing_dot_message():
    """What to tell someone whose machine can render nothing (no `dot`, no graphviz-pure)."""
    return dot_runner.missing_program_message()
