"""The op view: every op and variable of the trunk and both branches (see
minigraph.pictures.render for what the picture shows); an inference net (made by
an inference pass or loaded by mg.io.load_inference) is one cluster, titled so."""
from __future__ import annotations

from minigraph.pictures.dot import (
    HEADER,
    Heat,
    Ids,
    cluster,
    edge_line,
    forward_edges,
    inference_title,
    op_node,
    used_slots,
    var_node,
    variables_of,
)


def op_dot(net, profile=None):
    """DOT source of the op view of `net`, coloured by `profile` (or None)."""
    ids = Ids(net)
    ops = [(f"op:{name}:{i}", name, op) for name in ("trunk", "train", "infer")
           for i, op in enumerate(net.section(name))]
    edges = [e for oid, _, op in ops for e in forward_edges(oid, op, ids.var)]
    used = used_slots(edges)
    heat = Heat(profile)
    clusters = {"top": [], "trunk": [], "train": [], "infer": []}
    for vid, var in variables_of(ops, ids).items():
        scope = ids.scope(var)
        home = ("top" if var.persistable or var.is_data or scope is None
                else "trunk" if scope == "root" else scope)
        clusters[home].append(var_node(vid, var))
    for oid, section, op in ops:
        clusters[section].append(op_node(oid, op, used.get(oid), heat=heat))
    inference = inference_title(net)
    lines = ["digraph minigraph {"] + HEADER + heat.legend(inference and f"<b>{inference}</b>")
    lines += [f"  {n}" for n in clusters["top"]]
    if inference:
        body = clusters["trunk"] + clusters["train"] + clusters["infer"]
        lines += cluster("cluster_inference", "the ops infer runs", body, "#f6eef6")
    for name, title, fill in (("trunk", "trunk (shared)", "#f7f7f7"),
                              ("train", "train branch (is_infer=False)", "#eef6ee"),
                              ("infer", "infer branch (is_infer=True)", "#f6eef6")):
        if clusters[name] and not inference:
            lines += cluster(f"cluster_{name}", title, clusters[name], fill)
    lines += [edge_line(e, used) for e in edges]
    lines.append("}")
    return "\n".join(lines) + "\n"
