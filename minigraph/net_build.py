"""How ops are added to a Net's sections: one op in the trunk before the fork, a
train copy and an infer copy from it on (twins that share every persistable),
an op of the infer branch alone (state only inference keeps, such as a KV
cache's), each op's output Variables made in the scope of its section, and the
value rules of the persistables an op writes (checkpoint checks) marked.
Net.append and Net.append_infer call these.
"""
from __future__ import annotations

from minigraph.operator import Operator
from minigraph.schema import get_schema
from minigraph.scope import Variable, check_reserved_name

BRANCHES = ("train", "infer")


def append(net, op_type, inputs, outputs, attrs=None, infer=None):
    """Net.append (see its doc)."""
    attrs = dict(attrs or {})
    mode_attr = get_schema(op_type).mode_attr
    if mode_attr is not None or infer:
        net.forked = True
    if not net.forked:
        op = build_op(op_type, inputs, outputs, attrs, net.scope)
        net._sections["trunk"].append(op)
        mark_value_rules(op)
        net._changed()
        return op.outputs
    built = {}
    for b in BRANCHES:
        ins, outs, battrs = inputs, outputs, dict(attrs)
        if b == "infer":
            ins = {s: infer_copy(net, v) for s, v in inputs.items()}
            if infer:
                ins = {**ins, **infer.get("inputs", {})}
                outs = {**outputs, **infer.get("outputs", {})}
                battrs.update(infer.get("attrs", {}))
        if mode_attr is not None:
            battrs[mode_attr] = b == "infer"
        built[b] = build_op(op_type, ins, outs, battrs, net.scopes[b])
    for slot, var in built["train"].outputs.items():
        twin = built["infer"].outputs[slot]
        for t, i in zip(*((var, twin) if isinstance(var, list) else ([var], [twin]))):
            if t is not None and i is not None and t is not i:
                net._twins[id(t)], net._twins[id(i)] = i, t
    for b in BRANCHES:
        net._sections[b].append(built[b])
        mark_value_rules(built[b])
    net._changed()
    return built["train"].outputs


def append_infer(net, op_type, inputs, outputs, attrs=None, twins=None):
    """Net.append_infer (see its doc)."""
    net.forked = True
    ins = {s: infer_copy(net, v) for s, v in inputs.items()}
    op = build_op(op_type, ins, outputs, dict(attrs or {}), net.scopes["infer"])
    net._sections["infer"].append(op)
    for slot, train_var in (twins or {}).items():
        out = op.outputs[slot]
        net._twins[id(train_var)], net._twins[id(out)] = out, train_var
    net._changed()
    return op.outputs


def infer_copy(net, v):
    """What the infer branch reads where the train branch reads `v` (a Variable or a
    list of them): its twin, or `v` itself (a persistable, data, a trunk value)."""
    if isinstance(v, list):
        return [infer_copy(net, x) for x in v]
    return net._twins.get(id(v), v)


def build_op(op_type, inputs, outputs, attrs, scope):
    """An Operator with its output Variables made in `scope` (outputs: {slot: a name,
    a list of names, or an existing Variable}); if it cannot be built, the Variables
    made for it are removed again."""
    outs = {}
    made = []
    try:
        for slot, target in outputs.items():
            if isinstance(target, Variable):
                outs[slot] = target
            elif isinstance(target, (list, tuple)):
                for t in target:
                    check_reserved_name(t, scope)
                    made.append(scope.new_var(t))
                outs[slot] = made[len(made) - len(target):]
            else:
                check_reserved_name(target, scope)
                outs[slot] = scope.new_var(target)
                made.append(outs[slot])
        return Operator(op_type, **inputs, **outs, **attrs)
    except BaseException:
        for v in made:
            del scope.vars[v.name]
        raise


def mark_value_rules(op):
    """Give the persistables `op` writes the value checks of a checkpoint load."""
    from minigraph.io.checkpoint_values import mark_rules  # io imports net: not at the top
    mark_rules(op)
