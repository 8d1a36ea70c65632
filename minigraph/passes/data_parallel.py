"""Graph pass: the data-parallel rewrite of a net's backward section.

After it, K ranks running the same net on their own rows train like one
process on all the rows (with sync_batch_norm for the batch statistics):
  * before the update ops, one `c_allreduce_avg` (per dtype) replaces each
    parameter gradient by its average over ranks: at the end of the backward
    section for a step's own gradients; in the update section, so only on the
    steps that update, for the gradients GradientMerge hands the optimizer —
    right after they are made (its means of the merged gradients) or, for
    the merged sums themselves (persistables kept across steps: `avg=False`,
    `k_steps=1`), before the first update op. With the loss a mean over
    the local rows and equal per-rank batch sizes, that average is the
    gradient of the mean loss over the whole batch. For uneven sizes pass
    `batch_size_from`: the loss gradient is first scaled by size·B_r/ΣB
    (`c_scale_by_batch_share`), which weights each rank by its share;
  * outputs an op declares presummed (`OpSchema.presummed`: sync_batch_norm
    grad's dscale and dbias, already sums over every rank) are divided by
    the world size where they are made: by the op itself when its schema
    declares the attribute that does it (`OpSchema.presummed_average`: the
    sync grad ops' `average_ranks`, folded into their kernels), else by a
    `c_avg_presummed` op after it (no communication either way); such values,
    and a gradient made only of replicated values (`OpSchema.replication`),
    need no allreduce at all.
The pass knows the ops only through what their schemas declare.
"""
from __future__ import annotations

from minigraph.operator import Operator

NAME = "data_parallel"


def rewrite(net, batch_size_from=None):
    """Insert the gradient averaging into `net` (after minimize); see the module doc.
    batch_size_from: a data Variable (or its name) whose leading dimension is the
    local batch size. Returns the number of allreduce ops inserted."""
    if net.optimizer is None or net.loss is None:
        raise ValueError("data_parallel: call an optimizer's minimize(net, loss) first; the "
                         "gradient averaging goes between the backward and the update ops")
    net.mark_applied(NAME)
    if batch_size_from is not None:
        _weight_loss_grad(net, _data_var(net, batch_size_from))
    _divide_presummed(net)
    producers = _producers(net.section("backward"))
    partial = {}
    seen = set()
    for op in net.section("update"):
        grads = op.inputs.get("grad")
        for grad in grads if isinstance(grads, list) else [grads]:
            if grad is None or id(grad) in seen or _replicated(grad, producers):
                continue
            seen.add(id(grad))
            partial.setdefault(grad.dtype, []).append(grad)
    count = 0
    for grads in partial.values():
        makers = _update_makers(net.section("update"), grads)
        late = [g for g in grads if id(g) in makers or g.persistable]
        early = [g for g in grads if not (id(g) in makers or g.persistable)]
        if early:
            net.append_op(Operator("c_allreduce_avg", x=early, out=early), "backward")
        if late:
            net.insert_op("update", _late_index(net.section("update"), late, makers),
                          Operator("c_allreduce_avg", x=late, out=late))
        count += bool(early) + bool(late)
    return count


def _first_reader(ops, var):
    return next((i for i, op in enumerate(ops) if any(v is var for v in op.input_vars())),
                len(ops))


def _update_makers(ops, grads):
    """{id(grad): index of the update op that makes the value the update ops read}
    for the gradients made in the update section (GradientMerge's means); a
    gradient made in the backward section (or a merged sum, which the update
    section only zeroes after using it) has none."""
    makers = {}
    for g in grads:
        before = ops[:_first_reader(ops, g)]
        made = [i for i, op in enumerate(before) if any(v is g for v in op.output_vars())]
        if made:
            makers[id(g)] = made[-1]
    return makers


def _late_index(ops, late, makers):
    """Where in the update section the allreduce of `late` goes: after the ops that
    make any of them, before the first op that reads one."""
    index = max((makers[id(g)] + 1 for g in late if id(g) in makers), default=0)
    first_read = min(_first_reader(ops, g) for g in late)
    if first_read < index:
        raise ValueError(f"data_parallel: update op {first_read} ({ops[first_read].type}) "
                         "reads a gradient before all of them are made; cannot place their "
                         "averaging")
    return index


def _data_var(net, batch):
    if isinstance(batch, str):
        if batch not in net.data_vars:
            raise KeyError(f"data_parallel: {batch!r} is not a data variable of this net; data: "
                           f"{', '.join(net.data_vars)}")
        return net.data_vars[batch]
    return batch


def _weight_loss_grad(net, batch):
    dloss = net.grads.get(net.loss.name)
    for i, op in enumerate(net.section("backward")):
        if dloss is not None and dloss in op.output_vars():
            net.insert_op("backward", i + 1, Operator("c_scale_by_batch_share", x=dloss,
                                                      batch=batch, out=dloss))
            return
    raise ValueError("data_parallel: could not find the op that seeds d(loss)")


def _divide_presummed(net):
    """Divide each op's presummed outputs by the world size: the op's own attribute
    where its schema declares one (presummed_average), else a c_avg_presummed after it."""
    for op in net.section("backward"):
        declared = op.schema.presummed
        grads = [op.outputs[s] for s in (declared(op) if declared else ())
                 if op.outputs.get(s) is not None]
        if not grads:
            continue
        attr = op.schema.presummed_average
        if attr is not None:
            slots = {s: v for s, v in {**op.inputs, **op.outputs}.items() if v is not None}
            net.replace_op("backward", op, Operator(op.type, **slots, **{**op.attrs, attr: True}))
            continue
        index = net.section("backward").index(op)
        net.insert_op("backward", index + 1, Operator("c_avg_presummed", x=grads, out=grads))


def _producers(ops):
    """id(var) -> the last op writing it."""
    last = {}
    for op in ops:
        for v in op.output_vars():
            last[id(v)] = op
    return last


def _replicated(var, producers, visiting=frozenset()):
    """True when `var` has the same value on every rank, by what the schemas of
    the ops that made it declare. A value that feeds its own update (an
    accumulator such as GradientMerge's `add_inplace` into its merged gradient) is
    replicated when everything else added to it is: it starts replicated
    (data_parallel broadcasts the persistables)."""
    if id(var) in visiting:
        return True
    op = producers.get(id(var))
    declared = op.schema.presummed if op is not None else None
    if declared and any(op.outputs.get(s) is var for s in declared(op)):
        return True                     # a sum over every rank: the same on each
    rule = op.schema.replication if op is not None else None
    if rule == "always":
        return True
    if rule == "inputs":
        inner = visiting | {id(var)}
        return all(_replicated(v, producers, inner) for v in op.input_vars())
    return False
