"""Pictures of a net: DOT source (no binary needed) and files rendered by Graphviz.

The picture: ops are boxes (type in bold, attributes below, the mode
attribute a schema declares (`is_infer`) in bold); variables are ovals, data doubly
outlined, persistables filled and bold (parameters blue, other persistables
such as estimates and counters orange). The trunk and the two branches are
clusters (`cluster_trunk`, `cluster_train`, `cluster_infer`); persistables
and data sit outside every cluster, drawn once, with edges into both
branches. An in-place output (`saved_mean` -> `estimated_mean`) is a dashed
edge labelled with its slot; it is grey on infer copies (mode attribute
True), which never write it. With backward=True the backward and update ops join the
picture as a lighter nested cluster of the train branch.
"""
from __future__ import annotations

from pathlib import Path

from minigraph import dot_runner
from minigraph.files import atomic_write

FORMATS = (".svg", ".png", ".pdf")

PARAM_FILL = "#cfe2f3"
PERSIST_FILL = "#fce5cd"
DATA_FILL = "#fff2cc"
OP_FILL = "#e8eef7"
GRAD_FILL = "#f3f3f3"
ALIAS_COLOR = "#d9480f"
IDLE_COLOR = "#999999"


def to_dot(net, backward=False):
    """DOT source of `net` (a str); needs no Graphviz binary.

    Node ids are stable: `var:<scope>:<name>` (scope is root, train or infer)
    and `op:<section>:<index>`. The forward net only, unless backward=True:
    then the backward and update ops (and what only they use) are drawn too.
    """
    names = ("trunk", "train", "infer") + (("backward", "update") if backward else ())
    sections = [(name, net.section(name)) for name in names]
    ops = [(f"op:{name}:{i}", name, op) for name, section in sections
           for i, op in enumerate(section)]
    scope_names = {id(net.scope): "root"}
    scope_names.update({id(s): b for b, s in net.scopes.items()})

    def var_id(var):
        return f"var:{scope_names.get(id(var.scope), f'scope{id(var.scope)}')}:{var.name}"

    # every variable the drawn ops touch, in first-seen order, and where it goes
    variables = {}
    producer = {}
    for _, section, op in ops:
        for var in op.input_vars() + op.output_vars():
            variables.setdefault(var_id(var), var)
        for var in op.output_vars():
            producer.setdefault(var_id(var), section)

    clusters = {"top": [], "trunk": [], "train": [], "infer": [], "backward": []}
    for vid, var in variables.items():
        clusters[_var_home(var, scope_names, producer.get(vid))].append(_var_node(vid, var))
    for oid, section, op in ops:
        home = "backward" if section in ("backward", "update") else section
        clusters[home].append(_op_node(oid, op, light=home == "backward"))

    lines = ["digraph minigraph {",
             '  graph [rankdir=TB, fontname="Helvetica", fontsize=12, newrank=true];',
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8, color="#555555", arrowsize=0.7];']
    lines += [f"  {n}" for n in clusters["top"]]
    if clusters["trunk"]:
        lines += _cluster("cluster_trunk", "trunk (shared)", clusters["trunk"], "#f7f7f7")
    train = list(clusters["train"])
    if clusters["backward"]:
        train += _cluster("cluster_train_backward", "backward and updates",
                          clusters["backward"], "#fbfbfb", style="dashed")
    if train:
        lines += _cluster("cluster_train", "train branch (is_infer=False)", train, "#eef6ee")
    if clusters["infer"]:
        lines += _cluster("cluster_infer", "infer branch (is_infer=True)", clusters["infer"],
                          "#f6eef6")
    for oid, section, op in ops:
        lines += _op_edges(oid, op, var_id, light=section in ("backward", "update"))
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(net, path, backward=False, timeout=None):
    """Write the picture of `net` to `path`: .svg, .png or .pdf by suffix.

    Runs Graphviz's `dot` when it is on PATH, else the pip-installed
    graphviz-pure (svg and png only; .pdf then needs `dot`, and says so). The
    program gets `timeout` seconds (default 60, or MINIGRAPH_DOT_TIMEOUT);
    one that hangs, fails or writes nothing is a RuntimeError and no file is
    written (see minigraph.dot_runner). The file is written atomically (a
    temporary file in the same directory, then renamed). Returns the path.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"render: cannot tell the format of {str(path)!r} from its suffix "
                         f"{suffix or '(none)'!r}; use one of {', '.join(FORMATS)}")
    source = to_dot(net, backward=backward)
    data = dot_runner.pipe(source, suffix[1:], timeout=timeout)
    return atomic_write(path, lambda f: f.write(data))


def missing_dot_message():
    """What to tell someone whose machine can render nothing (no `dot`, no graphviz-pure)."""
    return dot_runner.missing_program_message()


# ---- nodes, clusters and edges --------------------------------------------------

def _var_home(var, scope_names, produced_in):
    if var.persistable or var.is_data:
        return "top"
    scope = scope_names.get(id(var.scope))
    if scope == "root":
        return "trunk"
    if scope == "train" and produced_in in ("backward", "update"):
        return "backward"
    if scope in ("train", "infer"):
        return scope
    return "top"


def _var_node(vid, var):
    label = _html(var.name) + f'<br/><font point-size="8">{_html(_shape_text(var))}</font>'
    if var.persistable:
        fill = PARAM_FILL if var.trainable else PERSIST_FILL
        style = f'style="filled,bold", fillcolor="{fill}", penwidth=2'
    elif var.is_data:
        style = f'style="filled", fillcolor="{DATA_FILL}", peripheries=2'
    else:
        style = 'style="solid"'
    return f"{_q(vid)} [shape=oval, {style}, label=<{label}>];"


def _op_node(oid, op, light):
    rows = [f"<b>{_html(op.type)}</b>"]
    for name, value in op.attrs.items():
        text = _html(f"{name}={_attr_text(value)}")
        rows.append(f"<b>{text}</b>" if name == op.schema.mode_attr else text)
    label = rows[0] + "".join(f'<br/><font point-size="8">{r}</font>' for r in rows[1:])
    if light:
        style = f'style="rounded,filled", fillcolor="{GRAD_FILL}", color="#aaaaaa", ' \
                'fontcolor="#555555"'
    else:
        style = f'style="rounded,filled", fillcolor="{OP_FILL}"'
    return f"{_q(oid)} [shape=box, {style}, label=<{label}>];"


def _cluster(name, label, body, fill, style="filled"):
    out = [f"  subgraph {name} {{",
           f'    label=<<b>{_html(label)}</b>>; style="{style}"; fillcolor="{fill}"; '
           'color="#bbbbbb";']
    out += [line if line.startswith("  ") else f"    {line}" for line in body]
    out.append("  }")
    return out


def _op_edges(oid, op, var_id, light):
    ins = [(s, v) for s, v in op.inputs.items() if v is not None]
    outs = [(s, v) for s, v in op.outputs.items() if v is not None]
    grey = ['color="#bbbbbb"'] if light else []
    mode_attr = op.schema.mode_attr
    alias_color = IDLE_COLOR if mode_attr and op.attrs[mode_attr] is True else ALIAS_COLOR
    lines = []
    for slot, bound in ins:
        attrs = ([f'label="{slot}"'] if len(ins) > 1 else []) + grey
        for var in bound if isinstance(bound, list) else [bound]:
            lines.append(_edge(var_id(var), oid, attrs))
    for slot, bound in outs:
        if slot in op.schema.inplace:
            attrs = ["style=dashed", f'color="{alias_color}"', f'fontcolor="{alias_color}"',
                     f'label="{slot}"', "constraint=false"]
        else:
            attrs = ([f'label="{slot}"'] if len(outs) > 1 else []) + grey
        for var in bound if isinstance(bound, list) else [bound]:
            lines.append(_edge(oid, var_id(var), attrs))
    return lines


def _edge(tail, head, attrs):
    return f"  {_q(tail)} -> {_q(head)}" + (f" [{', '.join(attrs)}];" if attrs else ";")


def _shape_text(var):
    shape, dtype = var.shape, var.dtype
    text = "?" if shape is None else "(" + ", ".join(
        "N" if d < 0 else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    if dtype is not None and str(dtype) != "float32":
        text += f" {dtype}"
    return text


def _attr_text(value):
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_attr_text(v) for v in value) + ")"
    text = str(value)
    return text if len(text) <= 32 else text[:29] + "..."


def _html(text):
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def _q(ident):
    return '"' + ident.replace("\\", "\\\\").replace('"', '\\"') + '"'
