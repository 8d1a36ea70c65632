"""The layer view of a net: one node per layer (`net.render(path, level="layer")`).

Each layer (minigraph.pictures.layer_map: the name the layer API gave) is one box
`layer:<name>`: its name and kind, the ops it is made of when they are more
than its kind, its output shape, its parameter count and the persistables it
made (`w (16, 1, 3, 3)`), and the parameters it shares with a layer that made
them. Data inputs are ovals `data:<name>`; an edge joins two layers when one
reads what the other computes.

The train/infer fork is drawn once: the layers before it sit in
`cluster_trunk` (run once, shared by both modes), the layers after it in
`cluster_fork` (each runs as a train copy and an infer copy sharing its
parameters); a layer whose ops depend on the mode (batch norm, dropout) is
marked (a bold purple outline and a `differs per mode` row), as is a layer
that only one mode runs. The persistables a layer's train ops update in
place (batch norm's running estimates and counter, dropout's step) are an
orange box `state:<name>` level with it: a solid edge into the layer (read)
and a dashed one back (written in place while training).

backward=True adds, in `cluster_backward`, one light box `grad:<name>` per
layer level with it, naming its gradient ops and the updates of its
parameters; gradients flow up between them against the forward edges. Ops of
no single layer (schedules, clipping) are in the box `grad:(optimizer)`.
profile=table colours each layer (with backward=True: its forward ops; its
gradient box: the rest) by its share of the step.
"""
from __future__ import annotations

import math
from collections import Counter

from minigraph.pictures.dot import (
    ALIAS_COLOR,
    DATA_FILL,
    GRAD_FILL,
    HEADER,
    OP_FILL,
    PERSIST_FILL,
    Heat,
    cluster,
    dims_text,
    html,
    inference_title,
    q,
    shape_text,
)
from minigraph.pictures.layer_map import FORWARD, LayerMap

MODE_FILL = "#f3e8f7"
MODE_COLOR = "#8e44ad"
PARAM_TEXT = "#1f4e79"
OPTIMIZER = "(optimizer)"


def layer_dot(net, backward=False, profile=None):
    """DOT source of the layer view of `net` (see the module doc); profile: a
    net.profile table or None."""
    lmap = LayerMap(net)
    ops = {s: net.section(s) for s in FORWARD + ("backward", "update")}
    units = {}                          # unit -> {section: [ops]}: a layer, or an op of none
    for section in FORWARD:
        for i, op in enumerate(ops[section]):
            unit = lmap.layer_of(op) or f"op:{section}:{i}"
            units.setdefault(unit, {}).setdefault(section, []).append(op)
    order = [n for n in lmap.names if n in units] + [u for u in units if u not in lmap.names]
    producer, edges = {}, []
    for section in FORWARD:
        for i, op in enumerate(ops[section]):
            unit = lmap.layer_of(op) or f"op:{section}:{i}"
            for var in op.input_vars():
                source = (f"data:{var.name}" if var.is_data
                          else producer.get(id(var)))
                if source is not None and source != unit and (source, unit) not in edges:
                    edges.append((source, unit))
            for var in op.output_vars():
                if not var.persistable:
                    producer[id(var)] = unit
    heat = Heat(profile, layers=True)
    inference = inference_title(net)
    trunk, fork, top, states = [], [], [], []
    for unit in order:
        parts = units[unit]
        node, state = _unit_node(lmap, unit, parts, heat, backward, bool(inference))
        (trunk if set(parts) == {"trunk"} else fork).append(node)
        if state:
            (trunk if set(parts) == {"trunk"} else fork).append(state[0])
            states += state[1:]
    fed = {s[len("data:"):] for s, _ in edges if s.startswith("data:")}
    top += [_data_node(var) for name, var in net.data_vars.items() if name in fed]
    what = f"layer view of an {inference[0].lower()}{inference[1:]}" if inference \
        else "layer view"
    lines = ["digraph minigraph {"] + HEADER + heat.legend(
        f'<b>{what}</b> (for every op and variable, draw level="op")')
    lines += [f"  {n}" for n in top]
    if inference:
        lines += cluster("cluster_inference", "the layers infer runs", trunk + fork, "#f6eef6")
    elif trunk:
        lines += cluster("cluster_trunk", "trunk (run once, shared by train and infer)",
                         trunk, "#f7f7f7")
    if fork and not inference:
        lines += cluster("cluster_fork", "after the fork: a train copy and an infer copy of "
                         "each layer, sharing its parameters", fork, "#eef6ee")
    if backward:
        lines += _backward_lines(lmap, ops, order, edges, heat)
    lines += [f"  {_id(a)} -> {_id(b)};" for a, b in edges]
    lines += states
    lines.append("}")
    return "\n".join(lines) + "\n"


def _unit_node(lmap, unit, parts, heat, backward, inference=False):
    """(node line, [state node line, its edges...] or []) of one layer (or op of none);
    in an inference net nothing differs per mode and nothing is written in place."""
    trunk = parts.get("trunk", [])
    train_ops = [] if inference else trunk + parts.get("train", [])
    any_ops = trunk + parts.get("infer", []) if inference else train_ops or parts.get("infer", [])
    rec = lmap.records.get(unit)
    if unit.startswith("op:"):
        title, kind = html(any_ops[0].type), "op of no layer"
    else:
        title, kind = html(unit), html(rec.kind if rec else "layer")
    rows = [f'<b>{title}</b>  <font color="#666666">{kind}</font>']
    types = list(dict.fromkeys(op.type for op in any_ops))
    if rec is None or types != [rec.kind]:
        rows.append(_small(" + ".join(types)))
    shape = _output_shape(rec, any_ops)
    if shape:
        channels_last = any(op.attrs.get("data_layout") == "NHWC" for op in any_ops)
        rows.append(_small(f"out {shape}" + (" NHWC" if channels_last else "")))
    made = list(rec.made) if rec else list({id(v): v for op in any_ops for v in op.input_vars()
                                             if v.persistable}.values())
    inplace = _written_in_place(train_ops)
    listed = [v for v in made if all(v is not w for w in inplace)]
    count = sum(_size(v) for v in listed)
    if count:
        rows.append(_small(f"{count:,} params" + (": " if listed else "") + " · ".join(
            _short(v, unit) + (" frozen" if not v.trainable else "") for v in listed),
            PARAM_TEXT))
    shared = [v for op in any_ops for v in op.input_vars()
              if v.persistable and v.trainable and all(v is not m for m in made)]
    if shared:
        rows.append(_small("shares " + ", ".join(dict.fromkeys(v.name for v in shared)),
                           PARAM_TEXT))
    modes = set() if inference else {op.schema.mode_attr for op in any_ops
                                     if op.schema.mode_attr}
    one_mode = not inference and set(parts) in ({"train"}, {"infer"})
    marked = bool(modes) or one_mode
    if modes:
        rows.append(f'<font point-size="8" color="{MODE_COLOR}"><b>differs per mode</b> '
                    f'({html(", ".join(sorted(modes)))})</font>')
    if one_mode:
        rows.append(f'<font point-size="8" color="{MODE_COLOR}"><b>{next(iter(parts))} '
                    "only</b></font>")
    share = _share(heat, unit, any_ops, backward)
    if share is not None:
        rows.append(_small(f"{100 * share:.1f}% of the step"))
    fill = heat.colour(share) if share is not None else MODE_FILL if modes else OP_FILL
    style = f'style="rounded,filled", fillcolor="{fill}"'
    if marked:
        style += f', color="{MODE_COLOR}", penwidth=2'
    label = "".join(f"<tr><td>{r}</td></tr>" for r in rows)
    node = (f'{_id(unit)} [shape=box, {style}, label=<<table border="0" cellborder="0" '
            f'cellspacing="0" cellpadding="1">{label}</table>>];')
    if not inplace:
        return node, []
    sid = q(f"state:{unit}")
    rows = [_small("<b>updated in place (train)</b>", ALIAS_COLOR)]
    rows += [_small(_short(v, unit)) for v in inplace]
    state = (f'{sid} [shape=box, style="rounded,filled", fillcolor="{PERSIST_FILL}", '
             f'color="{ALIAS_COLOR}", label=<<table border="0" cellborder="0" cellspacing="0" '
             f'cellpadding="1">{"".join(f"<tr><td>{r}</td></tr>" for r in rows)}</table>>];')
    return node, [state, f"  {{rank=same; {sid}; {_id(unit)}}}",
                  f'  {sid} -> {_id(unit)} [color="#888888"];',
                  f'  {_id(unit)} -> {sid} [style=dashed, color="{ALIAS_COLOR}", '
                  "constraint=false];"]


def _backward_lines(lmap, ops, order, edges, heat):
    """The gradient boxes (one per layer with gradient or update ops), level with
    their layers, in `cluster_backward`, and the gradients flowing up between them."""
    grads = {}
    for section in ("backward", "update"):
        for op in ops[section]:
            grads.setdefault(lmap.layer_of(op) or OPTIMIZER, []).append(op)
    body, lines = [], []
    for unit in [u for u in order if u in grads] + ([OPTIMIZER] if OPTIMIZER in grads else []):
        counts = Counter(op.type for op in grads[unit])
        text = ", ".join(t if n == 1 else f"{n} × {t}" for t, n in counts.items())
        rows = [f"<b>{html('gradients of ' + unit if unit != OPTIMIZER else unit)}</b>",
                _small(text)]
        share = heat.ops_share(grads[unit]) if heat.profile is not None else None
        if share is not None:
            rows.append(_small(f"{100 * share:.1f}% of the step"))
        fill = heat.colour(share) if share is not None else GRAD_FILL
        body.append(f'{q("grad:" + unit)} [shape=box, style="rounded,filled", '
                    f'fillcolor="{fill}", color="#aaaaaa", label=<{"<br/>".join(rows)}>];')
        if unit != OPTIMIZER:
            lines.append(f'  {{rank=same; {_id(unit)}; {q("grad:" + unit)}}}')
    lines += [f'  {q("grad:" + a)} -> {q("grad:" + b)} [dir=back, color="#888888"];'
              for a, b in edges if a in grads and b in grads]
    return cluster("cluster_backward", "gradients and updates (train only)", body,
                   "#fbfbfb", style="dashed") + lines


def _share(heat, unit, ops, backward):
    if heat.profile is None:
        return None
    return heat.ops_share(ops) if backward else heat.layer_share(unit)


def _written_in_place(ops):
    """The persistables `ops` write through in-place slots, once each, in order."""
    found = {}
    for op in ops:
        for slot in op.schema.inplace:
            for var in _listed(op.outputs.get(slot)):
                if var.persistable:
                    found.setdefault(id(var), var)
    return list(found.values())


def _listed(bound):
    return [] if bound is None else bound if isinstance(bound, list) else [bound]


def _output_shape(rec, ops):
    if rec is not None and rec.output_shape is not None:
        return dims_text(rec.output_shape)
    outs = [v for v in ops[-1].output_vars() if not v.persistable] if ops else []
    if not outs or outs[0].shape is None:
        return ""
    return dims_text(outs[0].decl_shape if outs[0].decl_shape is not None else outs[0].shape)


def _short(var, unit):
    name = var.name
    return html(name[len(unit) + 1:] if name.startswith(unit + ".") else name) + \
        f" {html(shape_text(var))}"


def _size(var):
    return math.prod(var.shape) if var.shape is not None else 0


def _small(text, colour=None):
    font = f' color="{colour}"' if colour else ""
    return f'<font point-size="8"{font}>{text}</font>'


def _data_node(var):
    label = f'{html(var.name)}<br/><font point-size="8">{html(shape_text(var))}</font>'
    return (f'{q("data:" + var.name)} [shape=oval, style="filled", fillcolor="{DATA_FILL}", '
            f"peripheries=2, label=<{label}>];")


def _id(unit):
    return q(unit if unit.startswith(("op:", "data:")) else f"layer:{unit}")
