"""Graph pass: each batch norm and the relu after it become one batch_norm_relu op, in
the train branch (forward and backward) and in the infer branch.

    batch_norm (or sync_batch_norm) -> relu      =>   batch_norm_relu (sync_batch_norm_relu)

A pair is fused when the batch norm's y is read by that relu alone (in every
section: forward, backward, update) and is not fetched by default. The relu's
output Variable becomes the fused op's y, so whatever reads it is unchanged; the
batch norm's y is no longer computed (fetch the relu's output, not it). The fused
op binds the batch norm's Variables and copies all its attributes, so the
persistables (names, values, in-place estimates, the counter) and the
all-or-nothing step are exactly as before. After minimize(), the pair's grad
ops - the relu's, which writes the gradient of the batch norm's y, and the batch
norm's, its only reader - become one batch_norm_relu_grad that reads the relu's
output for its mask. Ops are found by role ("batch_norm", "batch_norm_relu",
"relu"), never by type name; the fused type of a sync batch norm is the fused
op's sync_variant.

What it pays (benchmarks/bn_cpu.py, benchmarks/bn_gpu.py): one pass over the
tensor fewer forward (the relu's read and write) and the relu's gradient pass
backward; no intermediate tensor is kept for backward.
"""
from __future__ import annotations

from dataclasses import dataclass

from minigraph.operator import Operator
from minigraph.passes.infer_clone import check_net, record
from minigraph.schema import get_schema, ops_with_role

NAME = "fuse_batch_norm_relu"
SECTIONS = ("trunk", "train", "infer")


@dataclass(frozen=True)
class FusedPair:
    """One fused pair: the section, the batch norm's y (no longer computed), the
    fused op's output (the relu's) and type, and whether its grad ops were fused."""

    section: str
    batch_norm_y: str
    out: str
    into: str
    backward: bool

    def __str__(self):
        grads = " (and its grad ops)" if self.backward else ""
        return f"{self.section}: batch norm + relu -> {self.into} computing {self.out!r}{grads}"


def fuse_batch_norm_relu(net, verbose=False):
    """Rewrite `net` in place, fusing every batch norm + relu pair of the module doc,
    before or after minimize(). Returns a FusedPair per fused pair, also kept as
    `net.reports["fuse_batch_norm_relu"]`; a second call is an error. Every pair is
    checked before anything is rewritten."""
    check_net(net, NAME)
    plain, sync = _fused_types()
    kept = {id(v) for f in net.default_fetches for v in (f, net.twin(f)) if v is not None}
    pairs = []
    for section in SECTIONS:
        for bn in [op for op in net.section(section) if op.schema.has_role("batch_norm")
                   and not op.schema.has_role("batch_norm_relu")]:
            relu = _only_relu_reader(net, bn.outputs["y"], kept)
            if relu is not None:
                grads = _grad_pair(net, bn, relu) if section != "infer" else None
                pairs.append((section, bn, relu, sync if _is_sync(bn.type) else plain, grads))
    notes = []
    for section, bn, relu, fused_type, grads in pairs:
        if grads is not None:
            _fuse_grads(net, bn, relu, fused_type, *grads)
        slots = {s: v for s, v in {**bn.inputs, **bn.outputs}.items() if v is not None}
        slots["y"] = relu.outputs["out"]
        net.replace_op(section, bn, Operator(fused_type, **slots, **bn.attrs))
        net.remove_op(section, relu)
        notes.append(FusedPair(section, bn.outputs["y"].name, relu.outputs["out"].name,
                               fused_type, grads is not None))
    return record(net, NAME, notes, verbose)


def _fused_types():
    """(the fused op type, its sync form), from the ops declaring "batch_norm_relu"."""
    fused = [t for t in ops_with_role("batch_norm_relu") if get_schema(t).sync_variant]
    if len(fused) != 1:
        raise ValueError(f"{NAME}: expected one batch_norm_relu op with a sync variant, found "
                         f"{fused}")
    return fused[0], get_schema(fused[0]).sync_variant


def _is_sync(op_type):
    """True when `op_type` is the sync variant of another batch norm op."""
    return any(get_schema(t).sync_variant == op_type for t in ops_with_role("batch_norm"))


def _readers(net, var):
    return [(s, op) for s in ("trunk", "train", "infer", "backward", "update")
            for op in net.section(s) if any(v is var for v in op.input_vars())]


def _only_relu_reader(net, y, kept):
    """The relu that alone reads `y` (in any section), or None."""
    if id(y) in kept:
        return None
    readers = _readers(net, y)
    if len(readers) != 1 or not readers[0][1].schema.has_role("relu"):
        return None
    return readers[0][1]


def _grad_pair(net, bn, relu):
    """After minimize: (the relu's grad op, the batch norm's grad op) - the one op that
    writes the gradient of the batch norm's y and the one that reads it; None before
    minimize. A ValueError when the backward section does not have that shape."""
    d_y = net.grads.get(bn.outputs["y"].name)
    if d_y is None or net.grads.get(relu.outputs["out"].name) is None:
        return None
    ops = net.section("backward")
    writers = [op for op in ops if any(v is d_y for v in op.output_vars())]
    readers = [op for op in ops if any(v is d_y for v in op.input_vars())]
    if len(writers) != 1 or len(readers) != 1 or readers[0].inputs.get("dy") is not d_y or \
            readers[0].inputs.get("x") is not bn.inputs["x"]:
        raise ValueError(f"{NAME}: the gradient {d_y.name!r} of the batch norm's output is not "
                         "made by the relu's grad op alone and read by the batch norm's alone; "
                         "fuse before rewriting the backward section")
    return writers[0], readers[0]


def _fuse_grads(net, bn, relu, fused_type, relu_grad, bn_grad):
    """Replace the pair's grad ops with the fused op's: the batch norm's grad op's slots
    and attributes, dy the gradient of the relu's output, y the relu's output."""
    slots = {s: v for s, v in {**bn_grad.inputs, **bn_grad.outputs}.items() if v is not None}
    slots.update(dy=net.grads[relu.outputs["out"].name], y=relu.outputs["out"])
    net.replace_op("backward", bn_grad, Operator(fused_type + "_grad", **slots,
                                                 **bn_grad.attrs))
    net.remove_op("backward", relu_grad)
    del net.grads[bn.outputs["y"].name]
