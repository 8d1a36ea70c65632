"""Graph pass: fuse conv2d chains of an inference net into one fused_conv2d op each.

    conv2d -> elementwise_add (a per-channel parameter, axis 1)   the layer's bias
           -> add (another value of the same shape)               a residual
           -> relu

The ops are found by their declared roles ("conv", "bias_add", "add", "relu";
the fused op is the one with the "fused_conv" role), never by type name.

Every step after the conv2d is optional; a chain stops where a value has
another reader, is fetched by default, or the next op does not fit. The
chain's last output Variable becomes the fused op's output, so what reads it
is unchanged; the values inside a chain are no longer computed (fetch the
net's outputs, not those). `optimize_for_inference(net)` = fold_batch_norm,
which returns a new infer-only net, then this pass on it: with the batch
norms folded into the convolutions, a ResNet block is two fused ops.
"""
from __future__ import annotations

from dataclasses import dataclass

from minigraph.operator import Operator
from minigraph.passes.fold_bn import fold_batch_norm
from minigraph.passes.infer_clone import check_net
from minigraph.schema import op_for_role

NAME = "fuse_conv2d"


@dataclass(frozen=True)
class FuseNote:
    """One fused chain: the op types it replaced and the Variable it computes."""

    ops: tuple
    out: str

    def __str__(self):
        return f"{' + '.join(self.ops)} -> fused_conv2d computing {self.out!r}"


def optimize_for_inference(net, verbose=False):
    """A new infer-only Net equal to `net.infer` (to float rounding): batch norms
    folded into the convolutions and fc layers before them (fold_batch_norm), then
    conv2d chains fused (fuse_conv2d). `net` is untouched; the new net's `reports`
    hold both passes' notes. Fetch from it by name."""
    check_net(net, "optimize_for_inference")
    fast = fold_batch_norm(net, verbose=verbose)
    fast.made_by = "optimize_for_inference"
    fuse_conv2d(fast, verbose=verbose)
    return fast


def fuse_conv2d(net, verbose=False):
    """Rewrite the trunk of an infer-only net (one from fold_batch_norm or
    clone_for_inference: every op in its trunk) in place, fusing each conv2d
    chain of the module doc into a fused_conv2d. Returns a FuseNote per fused
    chain, also kept as `net.reports["fuse_conv2d"]`."""
    check_net(net, NAME)
    if any(net.section(s) for s in ("train", "infer", "backward", "update")):
        raise ValueError(f"{NAME}: needs an infer-only net (all ops in its trunk), such as "
                         "mg.passes.fold_batch_norm(net) returns")
    kept = {id(v) for v in net.default_fetches}
    notes = []
    fused_type = op_for_role("fused_conv")
    for conv in [op for op in net.section("trunk") if op.schema.has_role("conv")]:
        chain, parts = _chain(net.section("trunk"), conv, kept)
        if len(chain) == 1:
            continue
        out = chain[-1].outputs["out"]
        fused = Operator(fused_type, x=conv.inputs["x"], filter=conv.inputs["filter"],
                         out=out, **parts, **conv.attrs)
        net.replace_op("trunk", chain[-1], fused)
        for op in chain[:-1]:
            net.remove_op("trunk", op)
        notes.append(FuseNote(tuple(op.type for op in chain), out.name))
    net.mark_applied(NAME, notes)
    if verbose:
        for note in notes:
            print(f"{NAME}: {note}")
    return notes


def _chain(ops, conv, kept):
    """([conv, ...the ops fused after it], fused_conv2d keyword arguments)."""
    chain, parts = [conv], {}
    v = conv.outputs["out"]
    nxt = _only_reader(ops, v, kept)
    if nxt is not None and _is_bias_add(nxt, v, conv):
        parts["bias"] = nxt.inputs["y"]
        chain.append(nxt)
        v = nxt.outputs["out"]
        nxt = _only_reader(ops, v, kept)
    if nxt is not None and nxt.schema.has_role("add"):
        other = nxt.inputs["y"] if nxt.inputs["x"] is v else nxt.inputs["x"]
        if other is not v and _same_meta(other, v):
            parts["residual"] = other
            chain.append(nxt)
            v = nxt.outputs["out"]
            nxt = _only_reader(ops, v, kept)
    if nxt is not None and nxt.schema.has_role("relu"):
        parts["activation"] = "relu"
        chain.append(nxt)
    return chain, parts


def _only_reader(ops, v, kept):
    """The one op that reads `v`, or None (several, none, or `v` is fetched by default)."""
    if id(v) in kept:
        return None
    readers = [op for op in ops if any(u is v for u in op.input_vars())]
    return readers[0] if len(readers) == 1 else None


def _is_bias_add(op, v, conv):
    if not op.schema.has_role("bias_add") or op.inputs["x"] is not v:
        return False
    b = op.inputs["y"]
    channels = conv.inputs["filter"].shape[0] if conv.inputs["filter"].shape else None
    return (b.persistable and b.shape == (channels,) and op.attrs["axis"] == 1
            and b.dtype == v.dtype)


def _same_meta(a, b):
    return (a.shape is not None and a.shape == b.shape and -1 not in a.shape[1:]
            and a.dtype == b.dtype)
