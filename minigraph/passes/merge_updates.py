"""Graph pass: the optimizer's per-parameter update ops become one op per group.

    momentum, momentum, ..., momentum   =>   merged_momentum (lists aligned by parameter)

After minimize(), the update ops whose schema declares a `merged_variant`
(momentum's is merged_momentum) and that agree on everything but the parameter -
one op type, the same learning-rate Variable and other lone inputs (a cycled
momentum), the same attributes (a parameter group with another weight decay is
another group) and one parameter dtype - become one op of that variant, where the
first of them was. An update moves up to it only past ops that neither write what
it reads nor read or write what it writes (the clipping op, GradientMerge's means
and zeroing stay in order). A group of one op stays as it is.

Every parameter, its gradient and its state stay the same Variables, so
checkpoints, the all-or-nothing step (the journal's spare arrays), frozen
parameters (net_freeze cuts the lists) and data_parallel work as before. Each
parameter gets the momentum op's formulas in the same order; the merged op makes
every update with the native kernel, which momentum uses for its larger parameters
only, and whose fused multiply-adds may round the last bit of a small parameter's
update otherwise than numpy's separate steps.

What it pays (benchmarks/nets_cpu.py, the digits net): a per-parameter op costs
the executor's step and the kernel's call, some 20-30 us on a small net, and the
merged op makes all the updates in one native call.
"""
from __future__ import annotations

from dataclasses import dataclass

from minigraph.operator import Operator
from minigraph.passes.infer_clone import check_net, record
from minigraph.schema import get_schema

NAME = "merge_updates"


@dataclass(frozen=True)
class MergedRun:
    """One merged op: the op type it replaced, the op it became and its parameters."""

    merged: str
    into: str
    params: tuple

    def __str__(self):
        return f"{len(self.params)} {self.merged} ops -> {self.into} ({', '.join(self.params)})"


def merge_updates(net, verbose=False):
    """Rewrite `net`'s update section in place (after minimize), merging the updates of
    the module doc. Returns a MergedRun per merged op, also kept as
    `net.reports["merge_updates"]`; a second call is an error, and so is a net with
    no optimizer yet."""
    check_net(net, NAME)
    if getattr(net, "optimizer", None) is None:
        raise ValueError(f"{NAME}: the net has no update ops yet; call the optimizer's "
                         "minimize() first")
    ops = net.section("update")
    open_groups, groups = {}, []
    for index, op in enumerate(ops):
        if not get_schema(op.type).merged_variant:
            continue
        key = _key(op)
        group = open_groups.get(key)
        if group is None or not _may_join(ops[group[0]:index], group, ops, op):
            group = open_groups[key] = []
            groups.append(group)
        group.append(index)
    notes = []
    for group in (g for g in groups if len(g) > 1):
        run = [ops[i] for i in group]
        merged = _merged_op(run)
        net.replace_op("update", run[0], merged)
        for op in run[1:]:
            net.remove_op("update", op)
        notes.append(MergedRun(run[0].type, merged.type,
                               tuple(op.inputs["param"].name for op in run)))
    return record(net, NAME, notes, verbose)


def _key(op):
    """What the updates merged into one op share: the type, the attributes, the
    Variables of the slots that stay single in the merged op, the parameter dtype."""
    variant = get_schema(get_schema(op.type).merged_variant)
    lone = tuple((slot, id(v)) for slot, v in op.inputs.items()
                 if not variant.slot(slot).duplicable)
    return op.type, tuple(sorted(op.attrs.items())), lone, str(op.inputs["param"].dtype)


def _may_join(span, group, ops, op):
    """Whether `op` may move up to the group's first op (`span`: the ops from there to
    `op`): no op in between that is not in the group writes what `op` reads, or reads
    or writes what `op` writes."""
    members = {id(ops[i]) for i in group}
    reads = {id(v) for v in op.input_vars()}
    writes = {id(v) for v in op.output_vars()}
    for other in span:
        if id(other) in members:
            continue
        if any(id(v) in reads or id(v) in writes for v in other.output_vars()) or \
                any(id(v) in writes for v in other.input_vars()):
            return False
    return True


def _merged_op(run):
    """The merged variant's Operator for the ops of `run`: each of its list slots lists
    the run's Variables of that slot, each lone slot takes the first op's."""
    variant = get_schema(get_schema(run[0].type).merged_variant)
    slots = {}
    for slot in variant.inputs + variant.outputs:
        bound = {**run[0].inputs, **run[0].outputs}.get(slot.name)
        if slot.duplicable:
            slots[slot.name] = [{**op.inputs, **op.outputs}[slot.name] for op in run]
        elif bound is not None:
            slots[slot.name] = bound
    return Operator(variant.type, **slots, **run[0].attrs)
