"""A net's inference graph as a new, independent Net (what inference passes rewrite)."""
from __future__ import annotations

from minigraph.feeds import check_no_infer_state
from minigraph.net import Net
from minigraph.operator import Operator


class InferOnlyNet(Net):
    """A Net made by an inference pass: it infers; `train` is an error (it has no
    loss, gradients or optimizer, and its batch norms may be folded away)."""

    infer_only = True

    def __init__(self, place, seed, made_by):
        super().__init__(place=place, seed=seed)
        self.made_by = made_by

    def train(self, feed=None, fetch=None):
        """Always an error: train the source net, then make this one again."""
        raise RuntimeError(f"train: this net was made by {self.made_by} and can only infer (it "
                           "has no loss, gradients or optimizer); train the net the layers "
                           f"built, then call {self.made_by} again")


def check_net(net, who):
    """A TypeError naming `who` unless `net` is a minigraph Net."""
    if not isinstance(net, Net):
        raise TypeError(f"{who}: net must be a minigraph Net, got {type(net).__name__} "
                        f"{net!r:.60}")


def clone_for_inference(net, made_by="clone_for_inference"):
    """A new infer-only Net (InferOnlyNet, `made_by` naming the pass in its errors)
    holding the ops `net.infer` runs (all in its trunk), with its own copies of the
    data declarations, temporaries and persistables (values copied), so
    rewriting it leaves `net` untouched. Returns (new net, {id(old Variable): new
    Variable})."""
    check_net(net, made_by)
    check_no_infer_state(net.ops("infer"), made_by)
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

    for op in net.ops("infer"):
        slots = {**op.inputs, **op.outputs}
        new.append_op(Operator(op.type, **{s: twin(v) for s, v in slots.items() if v is not None},
                               **op.attrs), "trunk")
    new.default_fetches = tuple(twin(v) for v in net.default_fetches if id(v) in made)
    return new, made


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
