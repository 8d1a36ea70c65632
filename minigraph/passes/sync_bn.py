"""Graph pass: turn every batch_norm of a net into sync_batch_norm, in place."""
from __future__ import annotations

from minigraph.operator import Operator

RENAMES = {"batch_norm": "sync_batch_norm", "batch_norm_grad": "sync_batch_norm_grad"}


def convert_sync_batchnorm(net):
    """Rewrite every `batch_norm` op of `net` as `sync_batch_norm`, in place.

    Both branches are rewritten (the infer copy makes no collective anyway),
    and so are `batch_norm_grad` ops when backward was already appended.
    Each new op binds the same Variables with the same attributes and takes
    the old op's position, so parameters, estimates, fetch targets and
    gradients stay where they were. Returns the number of ops rewritten.
    """
    count = 0
    for section in ("trunk", "train", "infer", "backward"):
        for op in net.section(section):
            new_type = RENAMES.get(op.type)
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
