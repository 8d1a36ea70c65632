"""Graph passes: fuse the conv2d and fc chains of an inference net into one op each.

fuse_conv2d makes a fused_conv2d of each

    conv2d -> elementwise_add (a per-channel parameter on the      the layer's bias
                               channel axis: 1, or 3 in NHWC)
           -> add (another value of the same shape)               a residual
           -> relu
           -> pool2d (max over 2x2 windows at stride 2, no        pool "max2x2"
                      padding, in the conv's layout)

and fuse_fc a fused_fc of each

    mul -> elementwise_add (a parameter, one value per column, on the last axis)
        -> add (another value of the product's dtype; fused_fc      a residual
                broadcasts it as add does)
        -> relu or gelu

then folds into a fused_fc (or fused_fc_group) the layer_norm before it whose y it
alone reads, as its x only, over the same axes (its x_num_col_dims is the norm's
begin_norm_axis), when nothing reads the norm's mean and variance: the op then
normalises x itself (normalize, norm_scale, norm_bias, norm_epsilon).

The ops are found by their declared roles ("conv", "matrix_product", "bias_add",
"add", "relu", "gelu", "pool"; the fused ops are the ones with the "fused_conv" and
"fused_fc" roles), never by type name.

Every step after the conv2d is optional; a chain stops where a value has
another reader, is fetched by default, or the next op does not fit. The
chain's last output Variable becomes the fused op's output, so what reads it
is unchanged; the values inside a chain are no longer computed (fetch the
net's outputs, not those). `optimize_for_inference(net)` = fold_batch_norm,
which returns a new infer-only net, then remove_dropout and these passes on it:
with the batch norms folded into the convolutions and fc layers, a ResNet block is
two fused ops, and a hidden fc layer with its batch norm and relu is one.

fuse_fc also takes a training net: it then fuses the chains of its infer branch
only (the train branch, backward and updates keep their ops), with fused ops that
leave their weights to the optimizer (fused_fc's weight_fixed=False), so that
net.infer between training steps runs one op per linear layer; there, the fused_fc
ops of one layer that read the same x, with persistable weights and neither a
residual nor an activation, then become one fused_fc_group (a multi_head_attention's
q, k and v products). A generated token's pass: a transformer block's two
layer_norms, six products with their biases, two residual adds and gelu are four ops.
"""
from __future__ import annotations

from dataclasses import dataclass

from minigraph.operator import Operator
from minigraph.passes.fold_bn import fold
from minigraph.passes.infer_clone import check_infer_only, check_net, kept_ids, record
from minigraph.passes.remove_dropout import remove_dropout
from minigraph.schema import op_for_role

NAME = "fuse_conv2d"
FC_NAME = "fuse_fc"


@dataclass(frozen=True)
class FuseNote:
    """One fused chain: the op types it replaced, the Variable it computes and the
    fused op's type."""

    ops: tuple
    out: str
    into: str = "fused_conv2d"

    def __str__(self):
        return f"{' + '.join(self.ops)} -> {self.into} computing {self.out!r}"


def optimize_for_inference(net, fetches=None, verbose=False):
    """A new infer-only Net equal to `net.infer` for `fetches` (to float rounding;
    fetches as in fold_batch_norm, by default the net's predictions): batch norms
    folded into the convolutions and fc layers before them (fold_batch_norm), its
    dropouts removed (remove_dropout: in inference they copy), then conv2d chains
    fused (fuse_conv2d), then fc chains (fuse_fc), then depthwise and 1x1 conv pairs
    (fuse_separable_conv2d). `net` is untouched; the new net's `reports` hold the five
    passes' notes. Fetch from it by name, or fetch nothing to get its default
    fetches."""
    from minigraph.passes.fuse_separable import fuse_separable_conv2d  # it imports fuse

    check_net(net, "optimize_for_inference")
    fast = fold(net, fetches, verbose, "optimize_for_inference")
    remove_dropout(fast, verbose=verbose)
    fuse_conv2d(fast, verbose=verbose)
    fuse_fc(fast, verbose=verbose)
    fuse_separable_conv2d(fast, verbose=verbose)
    return fast


def fuse_conv2d(net, verbose=False):
    """Rewrite the trunk of an infer-only net (one from fold_batch_norm or
    clone_for_inference: every op in its trunk) in place, fusing each conv2d
    chain of the module doc into a fused_conv2d. Returns a FuseNote per fused
    chain, also kept as `net.reports["fuse_conv2d"]`."""
    return _fuse(net, NAME, "conv", op_for_role("fused_conv"), _conv_chain, verbose)


def fuse_fc(net, verbose=False):
    """Rewrite the trunk of an infer-only net in place as fuse_conv2d does, fusing
    each mul chain of the module doc (an fc layer: its product, bias add and relu)
    into a fused_fc; in a training net, the chains of its infer branch, into fused_fc
    ops whose weights the optimizer goes on updating (weight_fixed=False: nothing is
    packed; net.infer gives the same bits as before), then groups (a training net's)
    and folds layer_norms into them (the module doc). Returns a FuseNote per fused
    chain, group and fold, also kept as `net.reports["fuse_fc"]`."""
    check_net(net, FC_NAME)
    training = any(net.section(s) for s in ("train", "backward", "update"))
    if not training:
        _fix_weights(net)
    section = "infer" if training else "trunk"
    notes = _fuse(net, FC_NAME, "matrix_product", op_for_role("fused_fc"), _fc_chain, verbose,
                  section=section, attrs={"weight_fixed": False} if training else {})
    if training:
        notes += _group(net, section, verbose)           # the list net.reports keeps
    notes += _fold_norms(net, section, verbose)
    return notes


def _fold_norms(net, section, verbose):
    """Fold each layer_norm of `section` into the fused_fc or fused_fc_group op that is
    the only reader of its y, as its x alone, where it normalises from that op's
    x_num_col_dims and nothing reads or fetches its mean and variance (the op
    normalises x itself: attribute normalize). FuseNotes of the folds."""
    kept = kept_ids(net)
    notes = []
    for norm in [op for op in net.section(section) if op.schema.has_role("layer_norm")]:
        y = norm.outputs["y"]
        op = _only_reader(net.section(section), y, kept)
        if (op is None or not (op.schema.has_role("fused_fc")
                               or op.schema.has_role("fused_fc_group"))
                or op.inputs["x"] is not y or op.attrs["normalize"]
                or sum(u is y for u in op.input_vars()) > 1          # a residual too
                or op.attrs["x_num_col_dims"] != norm.attrs["begin_norm_axis"]
                or any(_is_read(net.section(section), norm.outputs[s], kept)
                       for s in ("mean", "variance"))):
            continue
        affine = {f"norm_{s}": norm.inputs[s] for s in ("scale", "bias")
                  if norm.inputs[s] is not None}
        folded = Operator(op.type, **{**{s: v for s, v in op.inputs.items() if v is not None},
                                      "x": norm.inputs["x"], **affine},
                          **op.outputs, **{**op.attrs, "normalize": True,
                                           "norm_epsilon": norm.attrs["epsilon"]})
        folded.layer = op.layer
        net.replace_op(section, op, folded)
        net.remove_op(section, norm)
        out = op.outputs["out"]
        notes.append(FuseNote((norm.type, op.type), ", ".join(
            v.name for v in (out if isinstance(out, list) else [out])), op.type))
        if verbose:
            print(f"{FC_NAME}: {notes[-1]}")
    return notes


def _group(net, section, verbose):
    """Replace the fused_fc ops of one layer in `section` that read the same x, with
    persistable weights (and biases, all or none), weight_fixed False and neither a
    residual nor an activation, by one fused_fc_group at the first one's place (their
    inputs are all there by then). FuseNotes of the groups."""
    groups = {}
    for op in net.section(section):
        ins = op.inputs
        if (op.schema.has_role("fused_fc") and not op.attrs["weight_fixed"]
                and ins.get("residual") is None and op.attrs["activation"] == "none"
                and all(ins.get(s) is None or ins[s].persistable for s in ("y", "bias"))):
            key = (id(ins["x"]), op.layer, op.attrs["x_num_col_dims"], ins.get("bias") is None)
            groups.setdefault(key, []).append(op)
    group_type, notes = op_for_role("fused_fc_group"), []
    for ops in (ops for ops in groups.values() if len(ops) > 1):
        first = ops[0]
        biases = {} if first.inputs.get("bias") is None else {
            "bias": [op.inputs["bias"] for op in ops]}
        group = Operator(group_type, x=first.inputs["x"], y=[op.inputs["y"] for op in ops],
                         out=[op.outputs["out"] for op in ops], **biases,
                         x_num_col_dims=first.attrs["x_num_col_dims"])
        group.layer = first.layer
        net.replace_op(section, first, group)
        for op in ops[1:]:
            net.remove_op(section, op)
        notes.append(FuseNote(tuple(op.type for op in ops),
                              ", ".join(op.outputs["out"].name for op in ops), group_type))
        if verbose:
            print(f"{FC_NAME}: {notes[-1]}")
    return notes


def _fix_weights(net):
    """The fused_fc ops an infer-only net copied from a training net's fused infer
    branch, with weight_fixed: no op of this net writes their weights."""
    for op in net.section("trunk"):
        if op.schema.has_role("fused_fc") and not op.attrs["weight_fixed"]:
            fixed = Operator(op.type, **{s: v for s, v in op.inputs.items() if v is not None},
                             **op.outputs, **{**op.attrs, "weight_fixed": True})
            fixed.layer = op.layer
            net.replace_op("trunk", op, fixed)


def _fuse(net, name, role, fused_type, chain_of, verbose, section="trunk", attrs=None):
    """Replace each chain chain_of finds in `section` from an op of `role` with one
    `fused_type` (with `attrs` besides the first op's)."""
    check_net(net, name)
    if section == "trunk":
        check_infer_only(net, name)
    kept = kept_ids(net)
    notes = []
    for first in [op for op in net.section(section) if op.schema.has_role(role)]:
        chain, parts = chain_of(net.section(section), first, kept)
        if len(chain) == 1:
            continue
        out = chain[-1].outputs["out"]
        fused = Operator(fused_type, **{s: v for s, v in first.inputs.items() if v is not None},
                         out=out, **parts, **first.attrs, **(attrs or {}))
        fused.layer = first.layer           # the conv's or fc's layer, not its relu's
        net.replace_op(section, chain[-1], fused)
        for op in chain[:-1]:
            net.remove_op(section, op)
        notes.append(FuseNote(tuple(op.type for op in chain), out.name, fused_type))
    return record(net, name, notes, verbose)


def _fc_chain(ops, mul, kept):
    """([mul, ...the ops fused after it], fused_fc keyword arguments): fused_fc adds a
    residual as add does (broadcasting), so any of the product's dtype fits."""
    return _chain(ops, mul, kept, _is_fc_bias, lambda other, v: other.dtype == v.dtype,
                  ("relu", "gelu"))


def _conv_chain(ops, conv, kept):
    """([conv, ...the ops fused after it], fused_conv2d keyword arguments): _chain's,
    then a max pooling of 2x2 windows at stride 2 (pool "max2x2")."""
    chain, parts = _chain(ops, conv, kept, _is_conv_bias, _same_meta, ("relu",))
    v = chain[-1].outputs["out"]
    pool = _only_reader(ops, v, kept)
    if pool is not None and pool.schema.has_role("pool") and pool.inputs["x"] is v:
        a = pool.attrs
        if (a["pool_type"] == "max" and not a["global_pooling"] and a["ksize"] == (2, 2)
                and a["strides"] == (2, 2) and a["paddings"] == (0, 0)
                and a["data_layout"] == conv.attrs["data_layout"]):
            parts["pool"] = "max2x2"
            chain.append(pool)
    return chain, parts


def _chain(ops, first, kept, is_bias, residual_fits, activations):
    """([first, then its bias add, a residual add (of a value residual_fits(value, v)
    takes) and an activation of `activations` (roles), as far as they fit], the fused
    op's keyword arguments)."""
    chain, parts = [first], {}
    v = first.outputs["out"]
    nxt = _only_reader(ops, v, kept)
    if (nxt is not None and nxt.schema.has_role("bias_add") and nxt.inputs["x"] is v
            and is_bias(nxt, v, first)):
        parts["bias"] = nxt.inputs["y"]
        chain.append(nxt)
        v = nxt.outputs["out"]
        nxt = _only_reader(ops, v, kept)
    if nxt is not None and nxt.schema.has_role("add"):
        other = nxt.inputs["y"] if nxt.inputs["x"] is v else nxt.inputs["x"]
        if other is not v and residual_fits(other, v):
            parts["residual"] = other
            chain.append(nxt)
            v = nxt.outputs["out"]
            nxt = _only_reader(ops, v, kept)
    act = next((a for a in activations if nxt is not None and nxt.schema.has_role(a)), None)
    if act is not None:
        parts["activation"] = act
        chain.append(nxt)
    return chain, parts


def _is_read(ops, v, kept):
    """Whether an op of `ops` reads `v`, or `v` is fetched by default."""
    return id(v) in kept or any(u is v for op in ops for u in op.input_vars())


def _only_reader(ops, v, kept):
    """The one op that reads `v`, or None (several, none, or `v` is fetched by default)."""
    if id(v) in kept:
        return None
    readers = [op for op in ops if any(u is v for u in op.input_vars())]
    return readers[0] if len(readers) == 1 else None


def _is_conv_bias(add, v, conv):
    """The bias add `add` on conv's output `v` adds one parameter value per channel, on
    the channel axis of the conv's layout (OpSchema.weight_axes)."""
    b = add.inputs["y"]
    channels = conv.inputs["filter"].shape[0] if conv.inputs["filter"].shape else None
    rank = len(v.shape) if v.shape else 4
    axis = conv.schema.weight_axes(conv)[2] % rank
    start = rank - 1 if add.attrs["axis"] == -1 else add.attrs["axis"]    # y is 1-D
    return b.persistable and b.shape == (channels,) and start == axis and b.dtype == v.dtype


def _is_fc_bias(add, v, mul):
    """The bias add `add` on mul's output `v` adds one parameter value per column, on
    v's last axis."""
    b = add.inputs["y"]
    columns = mul.inputs["y"].shape[1] if mul.inputs["y"].shape else None
    rank = len(v.shape) if v.shape else 0
    return (b.persistable and b.shape == (columns,) and b.dtype == v.dtype
            and add.attrs["axis"] in (-1, rank - 1))


def _same_meta(a, b):
    return (a.shape is not None and a.shape == b.shape and -1 not in a.shape[1:]
            and a.dtype == b.dtype)
