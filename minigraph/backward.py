"""Autodiff: append grad ops to a net's train branch, built by each op's grad maker."""
from __future__ import annotations

from minigraph.schema import OpDesc, op_for_role
from minigraph.scope import GRAD_MARK


def append_backward(net, loss, parameters=None):
    """Append the ops computing d(loss)/d(p) for every trainable parameter.

    Walks the train path (trunk, then train branch) in reverse, asking each
    op's grad maker for grad ops. A variable read by several ops gets the sum
    of their gradients. Returns [(parameter, grad Variable or None)] and
    records every gradient in `net.grads` (see `net.grad`).
    """
    if net.loss is not None:
        raise ValueError("append_backward: this net already has a backward pass")
    params = list(parameters) if parameters is not None else net.parameters()
    forward = net.section("trunk") + net.section("train")
    if not any(loss in op.output_vars() for op in forward):
        raise ValueError(f"append_backward: {loss.name!r} is not computed by the train path")
    if loss.shape is not None and tuple(loss.shape) not in ((), (1,)):
        raise ValueError(f"append_backward: the loss must be a scalar (shape ()), got "
                         f"{loss.name!r} of shape {tuple(loss.shape)}; reduce it first, e.g. "
                         "with layers.mean")
    grad_scope = net.scopes["train"]
    wanted = _reaching(forward, params)
    pending = {}                         # id(var) -> [grad contributions]

    def new_grad_var(var):
        name = f"{var.name}{GRAD_MARK}"
        k = 0
        while grad_scope.find_local_var(name) is not None:
            k += 1
            name = f"{var.name}{GRAD_MARK}@{k}"
        return grad_scope.new_var(name)

    def make_grad(var):
        if id(var) not in wanted:
            return None
        g = new_grad_var(var)
        pending.setdefault(id(var), []).append(g)
        return g

    def total_grad(var):
        parts = pending.get(id(var))
        if not parts:
            return None
        if len(parts) > 1:
            total = new_grad_var(var)
            net.append_op(OpDesc(op_for_role("accumulate"), dict(x=parts, out=total)),
                          "backward")
            pending[id(var)] = [total]
        net.grads[var.name] = pending[id(var)][0]
        return pending[id(var)][0]

    dloss = new_grad_var(loss)
    net.append_op(OpDesc(op_for_role("fill"), dict(out=dloss, shape=tuple(loss.shape or ()),
                                                    dtype=str(loss.dtype or "float32"),
                                                    value=1.0)), "backward")
    pending[id(loss)] = [dloss]
    for op in reversed(forward):
        if op.schema.grad is None:
            continue
        dout = {}
        for slot, var in op.outputs.items():
            if var is None or slot in op.schema.inplace:
                dout[slot] = None
            elif isinstance(var, list):
                dout[slot] = [total_grad(v) for v in var]
            else:
                dout[slot] = total_grad(var)
        if not any(_flat(dout.values())):
            continue
        for desc in op.schema.grad(op, dout, make_grad):
            net.append_op(desc, "backward")
    net.loss = loss
    return [(p, total_grad(p)) for p in params]


def _reaching(forward, params):
    """ids of the parameters and every variable computed from them."""
    reach = {id(p) for p in params}
    for op in forward:
        if any(id(v) in reach for v in op.input_vars()):
            for slot, var in op.outputs.items():
                if slot in op.schema.inplace:
                    continue
                reach.update(id(v) for v in (var if isinstance(var, list) else [var])
                             if v is not None)
    return reach


def _flat(values):
    for v in values:
        if isinstance(v, list):
            yield from v
        else:
            yield v
