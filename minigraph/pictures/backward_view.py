"""The op view with backward=True: the train path of a net with its gradients.

Each layer is a cluster (`cluster_layer_<k>`, k its place in LayerMap.names;
a trunk layer's title says so) holding its forward ops, variables and
persistables, inside `cluster_forward`. Beside it, in `cluster_backward`, a
lighter cluster (`cluster_layer_<k>_grad`) holds the gradient ops of that
layer (minigraph.pictures.layer_map) and the updates of its parameters, each level with
the forward op it differentiates (`rank=same`). Gradients flow upwards from op to
op: a gradient variable is an edge from the slot that computes it to the slot
that reads it, not a node, unless nothing reads it. An update writing its
parameter in place is a dashed edge. Ops of no single layer (learning-rate
schedules, clipping) are in `cluster_optimizer`, drawn without their many
edges. The forward values a gradient op reads are not drawn: they sit level
with it. Attributes are not drawn either; the infer branch and the
attributes are the forward picture's.
"""
from __future__ import annotations

from minigraph.pictures.dot import (
    ALIAS_COLOR,
    HEADER,
    Heat,
    Ids,
    as_list,
    cluster,
    edge_line,
    forward_edges,
    op_node,
    q,
    slots,
    used_slots,
    var_node,
    variables_of,
)
from minigraph.pictures.layer_map import GRAD_MARK, LayerMap


def backward_dot(net, profile=None):
    """DOT source of the train path of `net` with its gradient and update ops, each
    layer's beside it (see the module doc); profile: a net.profile table or None."""
    ids, lmap = Ids(net), LayerMap(net)
    ops = [(f"op:{name}:{i}", name, op) for name in ("trunk", "train", "backward", "update")
           for i, op in enumerate(net.section(name))]
    forward = [t for t in ops if t[1] in ("trunk", "train")]
    grad_from = {}                      # id(gradient) -> (op id, slot) of the op computing it
    for oid, section, op in ops:
        if section == "backward":
            for slot in slots(op.outputs):
                for var in as_list(op.outputs[slot]):
                    if GRAD_MARK in var.name and not var.persistable:
                        grad_from.setdefault(id(var), (oid, f"o_{slot}"))
    read = {id(v) for _, s, op in ops if s != "trunk" for v in op.input_vars()}
    variables = variables_of(forward, ids)
    for _, section, op in ops:
        if section == "backward":       # a gradient nothing reads ends in a node of its own
            variables.update((ids.var(v), v) for v in op.output_vars() if id(v) not in read)
    home = {oid: ("forward", lmap.layer_of(op), s in ("backward", "update"))
            for oid, s, op in ops}
    made_in = {id(v): home[oid] for oid, s, op in ops if s != "update"
               for v in op.output_vars()}
    trunk = {home[oid][1] for oid, s, _ in forward if s == "trunk"}
    for vid, var in variables.items():
        layer = lmap.var_layer(var) if var.persistable else None
        if var.is_data or (var.persistable and layer is None):
            home[vid] = ("top", None, False)
        elif var.persistable:           # in its layer's cluster
            home[vid] = ("forward", layer, False)
        else:
            home[vid] = made_in.get(id(var), ("forward", None, True))
    edges = [e for oid, _, op in forward for e in forward_edges(oid, op, ids.var)]
    for oid, section, op in ops:
        if section in ("backward", "update") and home[oid][1] is not None:
            edges += _grad_edges(oid, op, ids.var, grad_from, variables)
    used = used_slots(edges)
    heat = Heat(profile)
    placed = {"top": [], "forward": {}, "backward": {}}
    nodes = [(vid, var_node(vid, var, strip=home[vid][1])) for vid, var in variables.items()]
    nodes += [(oid, op_node(oid, op, used.get(oid), light=s in ("backward", "update"),
                             heat=heat, attrs=False)) for oid, s, op in ops]
    for nid, node in nodes:
        outer, layer, grad = home[nid]
        if outer == "top":
            placed["top"].append(node)
        else:
            placed["backward" if grad else outer].setdefault(layer, []).append(node)
    lines = ["digraph minigraph {"] + HEADER + heat.legend(
        "<b>train path with gradients</b>: each layer's gradient ops beside it, level with "
        "the ops they differentiate; gradients flow up (the infer branch: backward=False)")
    lines += [f"  {n}" for n in placed["top"]]
    lines += _layer_clusters(placed, lmap.names, trunk)
    lines += _levels(ops, home, lmap, grad_from)
    lines += [edge_line(e, used) for e in edges]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _grad_edges(oid, op, var_id, grad_from, drawn):
    """The edges of a gradient or update op: each gradient it reads, from the slot of
    the op that computed it, drawn against the flow (`dir=back`: gradients rise);
    each output to a drawn variable (an in-place parameter update dashed)."""
    edges = []
    for slot in slots(op.inputs):
        for var in as_list(op.inputs[slot]):
            source = grad_from.get(id(var))
            if source is not None and source[0] != oid:
                edges.append((oid, f"i_{slot}", source[0], source[1],
                              ("dir=back", 'color="#888888"')))
    for slot in slots(op.outputs):
        for var in as_list(op.outputs[slot]):
            if var_id(var) in drawn:
                attrs = (("style=dashed", f'color="{ALIAS_COLOR}"', "constraint=false")
                         if slot in op.schema.inplace else ('color="#888888"',))
                edges.append((oid, f"o_{slot}", var_id(var), None, attrs))
    return edges


def _layer_clusters(placed, order, trunk):
    """The forward cluster and the backward cluster, each of a cluster per layer."""
    lines = []
    for outer, title, fill in (("forward", "forward: the trunk, then the train branch "
                                "(is_infer=False)", "#eef6ee"),
                               ("backward", "gradients and updates (train only)", "#fbfbfb")):
        body = []
        for layer, inner in sorted(placed[outer].items(),
                                   key=lambda kv: -1 if kv[0] is None else order.index(kv[0])):
            if layer is None:
                body += inner if outer != "backward" else cluster(
                    "cluster_optimizer", "optimizer (no single layer)", inner, "#ffffff",
                    style="dashed")
            elif outer != "backward":
                body += cluster(f"cluster_layer_{order.index(layer)}",
                                f"{layer} (trunk)" if layer in trunk else layer, inner,
                                "#ffffff")
            else:
                body += cluster(f"cluster_layer_{order.index(layer)}_grad",
                                f"{layer} (gradients)", inner, "#ffffff", style="dashed")
        if body:
            lines += cluster(f"cluster_{outer}", title, body, fill)
    return lines


def _levels(ops, home, lmap, grad_from):
    """Each gradient op level with the forward op it differentiates, each update level
    with the op computing its gradient."""
    oid_of = {id(op): oid for oid, _, op in ops}
    lines = []
    for oid, section, op in ops:
        partner = None
        if section == "backward":
            partner = oid_of.get(id(lmap.forward_of(op)))
        elif section == "update" and home[oid][1] is not None:
            partner = next((grad_from[id(v)][0] for v in op.input_vars()
                            if id(v) in grad_from), None)
        if partner is not None:
            lines.append(f"  {{rank=same; {q(partner)}; {q(oid)}}}")
    return lines
