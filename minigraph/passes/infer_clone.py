"""A net's inference graph as a new, independent Net (what inference passes rewrite).

The new net runs what `net.infer` runs for its outputs, nothing more: the
ops pruned to `fetches` (by default the net's predictions, see
`inference_outputs`), so no loss, label or metric is left in it.
"""
from __future__ import annotations

from minigraph import feeds
from minigraph.net import Net
from minigraph.operator import Operator
from minigraph.plan import prune

LEFT_OUT = ("loss", "metric")           # the layer roles an inference net leaves out


class InferOnlyNet(Net):
    """A Net made by an inference pass: it infers its outputs (`default_fetches`);
    `train` is an error."""

    infer_only = True

    def __init__(self, place, seed, made_by):
        super().__init__(place=place, seed=seed)
        self.made_by = made_by

    @property
    def origin(self):
        """Where this inference net comes from, in words."""
        return f"made by {self.made_by}"

    def train(self, feed=None, fetch=None):
        """Always an error: train the source net, then make this one again."""
        outs = ", ".join(repr(v.name) for v in self.default_fetches) or "its outputs"
        raise RuntimeError(f"train: this is an inference net ({self.origin}): it computes "
                           f"{outs} and has no loss, gradients or optimizer; train the net "
                           f"the layers built, then call {self.made_by} on it again")


def check_net(net, who):
    """A TypeError naming `who` unless `net` is a minigraph Net."""
    if not isinstance(net, Net):
        raise TypeError(f"{who}: net must be a minigraph Net, got {type(net).__name__} "
                        f"{net!r:.60}")


def check_infer_only(net, who):
    """A ValueError naming `who` unless every op of `net` is in its trunk (an infer-only
    net, such as fold_batch_norm returns)."""
    if any(net.section(s) for s in ("train", "infer", "backward", "update")):
        raise ValueError(f"{who}: needs an infer-only net (all ops in its trunk), such as "
                         "mg.passes.fold_batch_norm(net) returns")


def record(net, name, notes, verbose):
    """Mark the pass `name` applied to `net` with its notes (Net.mark_applied: kept as
    net.reports[name]), print each note as "name: note" where `verbose`, and return
    the notes."""
    net.mark_applied(name, notes)
    if verbose:
        for note in notes:
            print(f"{name}: {note}")
    return notes


def kept_ids(net):
    """The ids of the Variables a rewrite must leave computed: the net's default fetches
    and their twins."""
    return {id(v) for v in [*net.default_fetches,
                            *filter(None, map(net.twin, net.default_fetches))]}


def clone_for_inference(net, made_by="clone_for_inference", fetches=None):
    """A new infer-only Net (InferOnlyNet, `made_by` naming the pass in its errors)
    holding the ops `net.infer` runs for `fetches` (all in its trunk, pruned to
    them; default: inference_outputs(net)), which become its default fetches, with
    its own copies of the data declarations it reads, temporaries and persistables
    (values copied), so rewriting it leaves `net` untouched. Each op keeps the name
    of the layer that built it. Returns (new net, {id(old Variable): new Variable})."""
    check_net(net, made_by)
    outputs = inference_outputs(net, fetches, made_by)
    ops = prune(net.ops("infer"), outputs)
    feeds.check_no_infer_state(ops, made_by)
    new = InferOnlyNet(net.place, net.seed, made_by)
    made = {}

    def twin(v):
        if v is None:
            return None
        if isinstance(v, list):
            return [twin(x) for x in v]
        found = made.get(id(v))
        if found is not None:
            return found
        if v.is_data:
            found = new.add_data(v.name, v.decl_shape, v.decl_dtype)
        else:
            found = new.scope.new_var(v.name, persistable=v.persistable, trainable=v.trainable)
            found.declare(*_declared(v))
            if v.persistable and v.value is not None:
                found.set(net.place.to_device(v.get()))
        made[id(v)] = found
        return found

    for op in ops:
        slots = {**op.inputs, **op.outputs}
        copy = Operator(op.type, **{s: twin(v) for s, v in slots.items() if v is not None},
                        **op.attrs)
        copy.layer = op.layer
        new.append_op(copy, "trunk")
    lost = next((v for v in outputs if id(v) not in made), None)
    if lost is not None:
        raise ValueError(f"{made_by}: no op of the infer branch computes or reads "
                         f"{lost.name!r}, which it is to fetch; fetch an output of the net")
    new.default_fetches = tuple(made[id(v)] for v in outputs)
    return new, made


def inference_outputs(net, fetches=None, who="clone_for_inference"):
    """The infer-branch Variables an inference net of `net` computes: `fetches`
    (Variables of `net` or names) when given, else the net's default fetches, else
    its predictions: what the net's loss and metric layers (layers with role "loss"
    or "metric", such as softmax_with_cross_entropy and accuracy) read from the
    rest of the net, or, with no such layer, the main output (first output slot) of
    every op whose outputs nothing reads."""
    if fetches is not None:
        if isinstance(fetches, (str, bytes)) or not isinstance(fetches, (list, tuple)):
            raise TypeError(f"{who}: fetches must be a list of Variables or names, got "
                            f"{type(fetches).__name__}")
        if not fetches:
            raise ValueError(f"{who}: fetches is empty; name what the inference net computes")
        return tuple(dict.fromkeys(feeds.fetch_target(net, "infer", f) for f in fetches))
    if net.default_fetches:             # a train-branch Variable: its infer copy
        return tuple(dict.fromkeys(feeds.fetch_target(net, "infer", v)
                                   for v in net.default_fetches))
    ops = net.ops("infer")
    roles = {rec.name: rec.role for rec in net.layers}
    left_out, inputs = set(), []
    for op in ops:
        if roles.get(op.layer) in LEFT_OUT or any(id(v) in left_out for v in op.input_vars()):
            left_out.update(id(v) for v in op.output_vars() if not v.persistable)
            inputs += [v for v in op.input_vars() if id(v) not in left_out]
    made = {id(v) for op in ops for v in op.output_vars() if id(v) not in left_out}
    found = [v for v in inputs if id(v) in made and not v.persistable]
    if not found:
        read = {id(v) for op in ops for v in op.input_vars()}
        mains = [op.output_vars()[0] for op in ops if op.output_vars()]
        found = [v for v in mains if not v.persistable and id(v) not in read]
    if not found:
        raise ValueError(f"{who}: cannot tell what the inference net computes; pass "
                         "fetches=[...] (Variables or names of the net's outputs)")
    return tuple(dict.fromkeys(found))


def _declared(v):
    if v.decl_shape is not None or v.decl_dtype is not None:
        return v.decl_shape, v.decl_dtype
    return v.shape, v.dtype


def drop_unused_persistables(net):
    """Remove the persistables no op of `net` reads or writes any more."""
    used = {id(v) for s in ("init", "trunk", "train", "infer", "backward", "update")
            for op in net.section(s) for v in op.input_vars() + op.output_vars()}
    for name, var in list(net.scope.vars.items()):
        if var.persistable and id(var) not in used:
            del net.scope.vars[name]
