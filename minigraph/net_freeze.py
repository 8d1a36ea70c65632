"""Parameters frozen after minimize(): what a train step then leaves out.

`var.trainable = False` on a parameter the optimizer updates (`net.trained`)
stops its updates from the next train step on, as PyTorch's
`requires_grad_(False)` does: its update op (which would also apply weight
decay and momentum) is left out of the step, its optimizer state (moments,
velocity) stays as it is, and its gradient is left out of global-norm
clipping (as clip_grad_norm_ skips a parameter without a gradient).
`var.trainable = True` brings it back. Its gradient is still computed (and
accumulated by GradientMerge). The run plans are keyed by the frozen set, so
switching back and forth costs one plan each.

A parameter minimize() did not update because it was frozen then
(`net.frozen_at_minimize`) has no gradient: making it trainable afterwards is
an error at the next train step, which says how to do it instead.
"""
from __future__ import annotations

from minigraph.operator import Operator

CLIP_ROLE = "clip_gradients"
MERGED_ROLE = "merged_update"


def frozen(net):
    """The ids of the parameters of `net.trained` now frozen, as a sorted tuple; a
    ValueError when a parameter frozen at minimize() was made trainable since."""
    thawed = [p.name for p in net.frozen_at_minimize if p.trainable]
    if thawed:
        raise ValueError(
            f"train: {', '.join(map(repr, thawed))} {'was' if len(thawed) == 1 else 'were'} "
            "made trainable after minimize(), which built no gradient or update for "
            f"{'it' if len(thawed) == 1 else 'them'} (frozen then). Set trainable = False "
            "again; to train a parameter only for part of the run, leave it trainable for "
            "minimize() and set trainable = False while it should not change")
    return tuple(sorted(id(p) for p in net.trained if not p.trainable))


def plan_ops(net, mode, update, frozen_ids):
    """The ops `net.train` / `net.infer` runs in `mode` (net.ops), without the update
    section's ops of the frozen parameters (`without_frozen`)."""
    ops = net.ops(mode, update)
    if not (frozen_ids and update):
        return ops
    n = len(net.section("update"))
    return ops[:len(ops) - n] + without_frozen(ops[len(ops) - n:], frozen_ids)


def without_frozen(ops, frozen_ids):
    """The update-section `ops` without the update ops writing a parameter whose id
    is in `frozen_ids`, and each clipping op (schema role "clip_gradients", slots
    x and out) without those parameters' gradients (dropped when none is left). A
    merged update (role "merged_update") keeps the parameters that are not frozen."""
    frozen_ids = set(frozen_ids)
    kept, grads = [], set()
    for op in ops:
        if op.schema.has_role(MERGED_ROLE):
            op = _merged_without(op, frozen_ids, grads)
            if op is not None:
                kept.append(op)
            continue
        if any(id(v) in frozen_ids for v in op.output_vars()):
            grad = op.inputs.get("grad")
            if grad is not None:
                grads.add(id(grad))
            continue
        kept.append(op)
    out = []
    for op in kept:
        if grads and op.schema.has_role(CLIP_ROLE):
            pairs = [(x, o) for x, o in zip(op.inputs["x"], op.outputs["out"])
                     if id(x) not in grads]
            if not pairs:
                continue
            if len(pairs) < len(op.inputs["x"]):
                op = Operator(op.type, x=[x for x, _ in pairs], out=[o for _, o in pairs],
                              **op.attrs)
        out.append(op)
    return out


def _merged_without(op, frozen_ids, grads):
    """The merged update `op` with each list cut to the parameters whose in-place
    outputs are not in `frozen_ids` (`op` itself when none is; None when all are);
    the cut parameters' gradients are added to `grads`."""
    lists = {slot: v for slot, v in {**op.inputs, **op.outputs}.items() if isinstance(v, list)}
    count = len(op.inputs["param"])
    out_lists = [op.outputs[slot] for slot in op.schema.inplace]
    keep = [i for i in range(count) if not any(id(o[i]) in frozen_ids for o in out_lists)]
    if len(keep) == count:
        return op
    grads.update(id(op.inputs["grad"][i]) for i in range(count) if i not in keep)
    if not keep:
        return None
    singles = {slot: v for slot, v in {**op.inputs, **op.outputs}.items()
               if v is not None and not isinstance(v, list)}
    return Operator(op.type, **singles, **{slot: [v[i] for i in keep] for slot, v in
                                          lists.items()}, **op.attrs)
