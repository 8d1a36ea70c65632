"""Graph pass: turn every batch_norm of a net into sync_batch_norm, in place."""
from __future__ import annotations

from minigraph.operator import Operator
from minigraph.passes.infer_clone import check_net


def convert_sync_batchnorm(net):
    """Rewrite every `batch_norm` op of `net` as `sync_batch_norm`, in place: each op
    whose schema declares a `sync_variant` (batch_norm and batch_norm_grad) becomes
    that op.

    Both branches are rewritten (the infer copy makes no collective anyway),
    and so are `batch_norm_grad` ops when backward was already appended.
    Each new op binds the same Variables with the same attributes and takes
    the old op's position, so parameters, estimates, fetch targets and
    gradients stay where they were. Returns the number of ops rewritten.
    """
    check_net(net, "convert_sync_batchnorm")
    count = 0
    for section in ("trunk", "train", "infer", "backward"):
        for op in net.section(section):
            new_type = op.schema.sync_variant
            if new_type is None:
                continue
            kwargs = {**{k: v for k, v in op.inputs.items() if v is not None},
                      **{k: v for k, v in op.outputs.items() if v is not None},
                      **dict(op.attrs)}
            net.replace_op(section, op, Operator(new_type, **kwargs))
            count += 1
    if count:
        net.mark_applied("convert_sync_batchnorm")
    return count
