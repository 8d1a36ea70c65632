"""The building blocks of every picture of a net: DOT nodes for ops and variables,
edges attached to op slots, clusters, the profile's heat colours, shape and
attribute text, and the graph header (fonts with fallbacks, see FONT).
"""
from __future__ import annotations

PARAM_FILL = "#cfe2f3"
PERSIST_FILL = "#fce5cd"
DATA_FILL = "#fff2cc"
OP_FILL = "#e8eef7"
GRAD_FILL = "#f3f3f3"
ALIAS_COLOR = "#d9480f"
IDLE_COLOR = "#999999"
SLOT_COLOR = "#666666"
HEAT = ((255, 255, 255), (244, 109, 67))     # no time -> the hottest node's share

# Graphviz sizes every box for its label as set in FONT, the widest of the fonts a
# viewer may pick from FONT_FAMILY (DejaVu Sans = Bitstream Vera Sans; Liberation
# Sans = Arial's metrics; Helvetica is close to Arial), so a label fits whichever of
# them the viewer has. SVG files name the whole list (svg_fonts); PNG and PDF files
# carry the face they were drawn in (raster_source).
FONT = "DejaVu Sans"
FONT_FAMILY = "DejaVu Sans,Bitstream Vera Sans,Liberation Sans,Arial,Helvetica,sans-serif"
RASTER_FONT = "Helvetica"
HEADER = [f'  graph [rankdir=TB, fontname="{FONT}", fontsize=12, newrank=true, '
          'nodesep=0.25, ranksep=0.3];',
          f'  node [fontname="{FONT}", fontsize=10, margin="0.08,0.03"];',
          f'  edge [fontname="{FONT}", fontsize=8, color="#555555", arrowsize=0.6];']


def raster_source(source):
    """DOT source for a PNG or PDF, which carry the font Graphviz drew with: set in
    RASTER_FONT, a face both Graphviz (through fontconfig) and graphviz-pure (its
    Arial-compatible face) have, where graphviz-pure would draw FONT in a serif."""
    return source.replace(f'fontname="{FONT}"', f'fontname="{RASTER_FONT}"')


def svg_fonts(svg):
    """SVG bytes from Graphviz with FONT replaced by FONT_FAMILY in every
    font-family, so a viewer without FONT falls back to a font no wider."""
    return svg.replace(f'font-family="{FONT}"'.encode(), f'font-family="{FONT_FAMILY}"'.encode())



class Ids:
    """Stable node ids of a net's variables: `var:<scope>:<name>`."""

    def __init__(self, net):
        self.scopes = {id(net.scope): "root"}
        self.scopes.update({id(s): b for b, s in net.scopes.items()})

    def var(self, var):
        """The node id of `var`."""
        return f"var:{self.scopes.get(id(var.scope), f'scope{id(var.scope)}')}:{var.name}"

    def scope(self, var):
        """"root", "train" or "infer": the scope holding `var` (None for another)."""
        return self.scopes.get(id(var.scope))


def forward_edges(oid, op, var_id):
    """(tail, tail slot, head, head slot, attrs) of a forward op: each input to its
    slot, each output slot to its variable; an in-place output is dashed (grey
    where the op never writes it: a mode-dependent op's infer copy)."""
    mode_attr = op.schema.mode_attr
    alias = IDLE_COLOR if mode_attr and op.attrs[mode_attr] is True else ALIAS_COLOR
    edges = [(var_id(v), None, oid, f"i_{slot}", ()) for slot in slots(op.inputs)
             for v in as_list(op.inputs[slot])]
    for slot in slots(op.outputs):
        attrs = (("style=dashed", f'color="{alias}"', "constraint=false")
                 if slot in op.schema.inplace else ())
        edges += [(oid, f"o_{slot}", var_id(v), None, attrs)
                  for v in as_list(op.outputs[slot])]
    return edges


def variables_of(ops, ids):
    """Every variable the ops touch, in first-seen order: {node id: Variable}."""
    found = {}
    for _, _, op in ops:
        for var in op.input_vars() + op.output_vars():
            found.setdefault(ids.var(var), var)
    return found


def var_node(vid, var, strip=None):
    """A variable's oval: name (without the prefix `strip.`, inside the cluster of
    the layer `strip`) and shape; filled and bold for persistables, doubly
    outlined for data."""
    name = var.name
    if strip and name.startswith(strip + "."):      # inside its layer's cluster
        name = name[len(strip) + 1:]
    label = html(name) + f'<br/><font point-size="8">{html(shape_text(var))}</font>'
    if var.persistable:
        fill = PARAM_FILL if var.trainable else PERSIST_FILL
        style = f'style="filled,bold", fillcolor="{fill}", penwidth=2'
    elif var.is_data:
        style = f'style="filled", fillcolor="{DATA_FILL}", peripheries=2'
    else:
        style = 'style="solid"'
    return f"{q(vid)} [shape=oval, {style}, label=<{label}>];"


def op_node(oid, op, used, light=False, heat=None, attrs=True):
    """An op's box: its slots with edges named along it where there are several on a
    side (inputs on top, outputs below; the other way round for a light gradient op,
    whose gradients come from below), its type, its attributes (with attrs, and not
    for light ops) and, with a profile, its share of the step."""
    rows = [f"<b>{html(op.type)}</b>"]
    for name, value in op.attrs.items() if attrs and not light else ():
        text = html(f"{name}={_attr_text(value)}")
        rows.append(f'<font point-size="8"><b>{text}</b></font>' if name == op.schema.mode_attr
                    else f'<font point-size="8">{text}</font>')
    share = heat.op_share(op) if heat is not None else None
    if share is not None:
        rows.append(f'<font point-size="8">{100 * share:.1f}% of the step</font>')
    mode = op.schema.mode_attr
    idle = mode is not None and op.attrs[mode] is True
    ins, outs = _port_slots(op, used)
    top = _port_row("i", ins, lambda s: SLOT_COLOR) if len(ins) > 1 else []
    bottom = _port_row("o", outs, lambda s: (IDLE_COLOR if idle else ALIAS_COLOR)
                       if s in op.schema.inplace else SLOT_COLOR) if len(outs) > 1 else []
    if light:
        top, bottom = bottom, top
    body = top + [f"<tr><td>{r}</td></tr>" for r in rows] + bottom
    label = ('<table border="0" cellborder="0" cellspacing="0" cellpadding="0">'
             + "".join(body) + "</table>")
    fill = heat.colour(share) if share is not None else GRAD_FILL if light else OP_FILL
    extra = ', color="#aaaaaa"' if light else ""
    return f'{q(oid)} [shape=box, style="rounded,filled", fillcolor="{fill}"{extra}, ' \
           f"label=<{label}>];"


def _port_slots(op, used):
    """The input and output slots of `op` that edges attach to, in the schema's order."""
    used = used or set()
    return ([s for s in slots(op.inputs) if f"i_{s}" in used],
            [s for s in slots(op.outputs) if f"o_{s}" in used])


def used_slots(edges):
    """{op id: the ports (`i_<slot>`, `o_<slot>`) that the edges attach to}."""
    used = {}
    for tail, tail_port, head, head_port, _ in edges:
        for node, port in ((tail, tail_port), (head, head_port)):
            if port is not None:
                used.setdefault(node, set()).add(port)
    return used


def edge_line(edge, used):
    """An edge's DOT line: an end attaches to its slot where the op names its slots
    on that side (more than one used), on the side it faces in a forward op."""
    tail, tail_port, head, head_port, attrs = edge
    back = "dir=back" in attrs

    def end(node, port, compass):
        ports = used.get(node, ())
        if port is None or sum(p[0] == port[0] for p in ports) < 2:
            return q(node)
        return f"{q(node)}:{port}" + ("" if back or not node.startswith("op:") or
                                      _light(node) else compass)

    text = f"  {end(tail, tail_port, ':s')} -> {end(head, head_port, ':n')}"
    return text + (f" [{', '.join(attrs)}];" if attrs else ";")


def _light(oid):
    return oid.startswith(("op:backward:", "op:update:"))


def _port_row(prefix, slots, colour):
    cells = "".join(f'<td port="{prefix}_{s}"><font point-size="7" color="{colour(s)}">'
                    f'{html(s)}</font></td>' for s in slots)
    return ['<tr><td><table border="0" cellborder="0" cellspacing="3" cellpadding="0"><tr>'
            + cells + "</tr></table></td></tr>"]


def cluster(name, label, body, fill, style="filled"):
    """The lines of a DOT cluster `name` titled `label` holding `body` (lines)."""
    out = [f"  subgraph {name} {{",
           f'    label=<<b>{html(label)}</b>>; style="{style}"; fillcolor="{fill}"; '
           'color="#bbbbbb";']
    out += [line if line.startswith("  ") else f"    {line}" for line in body]
    out.append("  }")
    return out


def slots(bound):
    """The slots of an op's inputs or outputs (a dict) that are bound."""
    return [s for s, v in bound.items() if v is not None and v != []]


def as_list(bound):
    """A slot's Variables as a list (a duplicable slot holds one already)."""
    return bound if isinstance(bound, list) else [bound]


class Heat:
    """Fill colours from a profile table (net.profile): white for no time, HEAT[1]
    for the share of the hottest op (layers=False) or layer (layers=True)."""

    def __init__(self, profile, layers=False):
        self.profile, self.layers = profile, layers
        rows = () if profile is None else profile.by_layer if layers else profile.by_op
        self.top = max((r.share for r in rows if r.name != "(executor)"), default=0.0)

    def op_share(self, op):
        """The share of the step `op` took, or None (no profile, or not timed)."""
        return None if self.profile is None else self.profile.op_share(op)

    def ops_share(self, ops):
        """The share of the step `ops` took together, or None."""
        return None if self.profile is None else self.profile.ops_share(ops)

    def layer_share(self, name):
        """The share of the step the layer `name` took, or None."""
        return None if self.profile is None else self.profile.layer_share(name)

    def colour(self, share):
        """The fill for `share` (0..1 of the step)."""
        t = 0.0 if self.top <= 0 else min(1.0, share / self.top)
        return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(*HEAT))

    def legend(self, title=None):
        """The graph's title line: `title` (DOT HTML) and, with a profile, what the
        colours mean."""
        parts = [title] if title else []
        if self.profile is not None:
            p = self.profile
            parts.append(f"fill: share of a timed {html(p.mode)} step ({p.timed_step_ms:.3g} "
                         f"ms with its kernels timed, mean of {p.steps}; {p.step_ms:.3g} ms "
                         f"untimed); the hottest {'layer' if self.layers else 'op'} takes "
                         f"{100 * self.top:.0f}%")
        return [f"  label=<{'<br/>'.join(parts)}>; labelloc=t;"] if parts else []


def shape_text(var):
    """A Variable's shape as `(N, 16, 8, 8)` (see dims_text), with its dtype when that
    is not float32. The declared shape (data declarations, shape inference) wins
    over the value a run left: a picture shows what the net is, not the batch it
    ran last."""
    shape = var.decl_shape if var.decl_shape is not None else var.shape
    text = dims_text(shape)
    if var.dtype is not None and str(var.dtype) != "float32":
        text += f" {var.dtype}"
    return text


def dims_text(shape):
    """`shape` as `(N, 16, 8, 8)`: N for a size each feed gives (-1, such as the
    batch); "?" when unknown (None)."""
    if shape is None:
        return "?"
    return "(" + ", ".join("N" if d < 0 else str(d) for d in shape) + (
        "," if len(shape) == 1 else "") + ")"


def _attr_text(value):
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_attr_text(v) for v in value) + ")"
    text = str(value)
    return text if len(text) <= 32 else text[:29] + "..."


def html(text):
    """`text` escaped for a DOT HTML label."""
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def q(ident):
    """`ident` as a quoted DOT id."""
    return '"' + ident.replace("\\", "\\\\").replace('"', '\\"') + '"'


def inference_title(net):
    """"inference net (made by optimize_for_inference)" and the like for a net that
    only infers (`net.infer_only`), as DOT HTML; "" for a net that trains."""
    if not getattr(net, "infer_only", False):
        return ""
    origin = getattr(net, "origin", "")
    return html(f"inference net ({origin})" if origin else "inference net")
