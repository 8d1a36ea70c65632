"""Graph pass: an inference net's dropouts go; their readers read the dropout's x.

In inference (is_infer) a dropout's out is a copy of its x: the same values in a new
array, which costs a pass over memory (20-40 us for MNIST's 0.4 MB on a 2-core
machine) and nothing else. PyTorch's dropout in eval mode returns its input, and
Paddle's inference passes delete the op (delete_dropout_op_pass); here each op
reading the dropout's out is rebuilt to read its x, and the dropout is removed. A
dropout stays where its out is fetched by default (or its twin is), where it trains
(is_infer False), or where a reader writes that input in place (it would write the
dropout's x, which others may read). The dropout's step counter is left as it is.
"""
from __future__ import annotations

from minigraph.operator import Operator
from minigraph.passes.infer_clone import check_infer_only, check_net, kept_ids

NAME = "remove_dropout"


def remove_dropout(net, verbose=False):
    """Remove the inference dropouts of an infer-only net's trunk (one from
    fold_batch_norm or clone_for_inference) as the module doc says, in place. Returns
    the names of the removed dropouts' outputs, also kept as
    `net.reports["remove_dropout"]`."""
    check_net(net, NAME)
    check_infer_only(net, NAME)
    kept = kept_ids(net)
    removed = []
    for dropout in [op for op in net.section("trunk") if op.schema.has_role("dropout")]:
        out, x = dropout.outputs["out"], dropout.inputs["x"]
        readers = [op for op in net.section("trunk") if any(v is out for v in op.input_vars())]
        if (not dropout.attrs["is_infer"] or id(out) in kept
                or any(_writes_in_place(op, out) for op in readers)):
            continue
        for op in readers:
            net.replace_op("trunk", op, _reading(op, out, x))
        net.remove_op("trunk", dropout)
        removed.append(out.name)
        if verbose:
            print(f"{NAME}: {dropout.type} computing {out.name!r}: its readers read "
                  f"{x.name!r}")
    net.mark_applied(NAME, removed)
    return removed


def _writes_in_place(op, v):
    """Whether `op` writes its input `v` in place (a declared in-place pair)."""
    return any(u is v for u in op.in_place_outputs())


def _reading(op, old, new):
    """A copy of `op` that reads `new` wherever it read `old` (lists too)."""
    def swap(value):
        if isinstance(value, list):
            return [new if v is old else v for v in value]
        return new if value is old else value

    rebuilt = Operator(op.type, **{s: swap(v) for s, v in op.inputs.items() if v is not None},
                       **{s: v for s, v in op.outputs.items() if v is not None}, **op.attrs)
    rebuilt.layer = op.layer
    return rebuilt
