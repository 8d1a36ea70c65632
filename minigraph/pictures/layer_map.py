"""Which layer each op of a net belongs to: the grouping behind the layer view, the op
view's per-layer clusters and the profile's time per layer.

Layers name what they make after themselves (`conv1.out`, `conv1.w`, `bn1.y`;
see minigraph.layers), optimizers name a parameter's state after
themselves and the parameter (`momentum_0.conv1.w.velocity`, which points at
no layer) and backward names a gradient after its
variable (`conv1.out@GRAD`, `@GRAD@1` for a second part). So:

- a forward op (trunk, train, infer) belongs to the layer that built it
  (`op.layer`: the layer API records it, rewrites and inference passes keep
  it, inference models save it), else to the layer whose name is the longest
  dotted prefix of its outputs' names (its non-persistable outputs first);
  when they name several layers, to the layer of the persistables it reads,
  if they name one;
- a backward op belongs to the layer of its forward op (the train-path op whose
  outputs' gradients it reads: batch_norm_relu_grad reads the relu output's
  gradient but belongs to the batch norm's layer, as its forward op does), else
  to the layer of the variables whose gradients it reads, or, reading none (the
  loss gradient's fill), of those it writes;
- an update op belongs to the layer of the persistables it writes (those
  that point at a layer: the parameter, not its optimizer state).

An op whose variables point at no layer, or at several (gradient clipping,
learning-rate schedules), belongs to none (None). This needs no record of
the ops a layer appended, so it holds for nets rewritten by passes too; a net
with no layer records (one loaded with mg.io.load_inference, or made by a
pass) gets its layer names from its forward outputs (`fc1.out` -> `fc1`).
"""
from __future__ import annotations

FORWARD = ("trunk", "train", "infer")
GRAD_MARK = "@GRAD"


class LayerMap:
    """The layers of `net` and the layer of each op of its sections.

    names: the layer names in build order (those of net.layers, then any found
    from output names); records: {name: LayerRecord} (layers built by the layer
    API); layer_of(op) -> layer name or None; forward_of(op): for a backward op,
    the forward op whose outputs' gradients it reads (None when there is none)."""

    def __init__(self, net):
        self.records = {rec.name: rec for rec in net.layers}
        self.names = list(self.records)
        for section in FORWARD:
            for op in net.section(section):
                if op.layer is not None and op.layer not in self.names:
                    self.names.append(op.layer)
        self._names = sorted(self.names, key=len, reverse=True)
        for section in FORWARD:
            for op in net.section(section):
                if op.layer is not None:
                    continue
                for var in op.output_vars():
                    base = var.name.split(GRAD_MARK, 1)[0]
                    if not var.persistable and "." in base and self.name_layer(base) is None:
                        self.names.append(base.rsplit(".", 1)[0])
                        self._names = sorted(self.names, key=len, reverse=True)
        self._made = {id(v): rec.name for rec in net.layers for v in rec.made}
        self._layer = {}
        self._producer = {}              # forward var name -> the train-path op writing it
        for section in ("trunk", "train"):
            for op in net.section(section):
                for var in op.output_vars():
                    if not var.persistable:
                        self._producer.setdefault(var.name, op)
        for section in FORWARD + ("backward", "update"):
            for op in net.section(section):
                self._layer[id(op)] = self._owner(op, section)

    def layer_of(self, op):
        """The name of the layer `op` belongs to, or None (see the module doc)."""
        return self._layer.get(id(op))

    def var_layer(self, var):
        """The layer that made `var` (a persistable listed in a LayerRecord's `made`)
        or whose name is the longest dotted prefix of `var`'s name (gradient marks
        stripped); None when there is none."""
        found = self._made.get(id(var))
        return found if found is not None else self.name_layer(var.name)

    def name_layer(self, name):
        """The layer whose name is the longest dotted prefix of `name` (gradient
        marks stripped), or None."""
        base = name.split(GRAD_MARK, 1)[0]
        for layer in self._names:
            if base.startswith(layer + ".") or base == layer:
                return layer
        return None

    def forward_of(self, op):
        """For a backward op: the train-path op that produced the variable whose
        gradient it reads (or, reading none, writes); None otherwise."""
        for var in _grads(op.input_vars()) or _grads(op.output_vars()):
            found = self._producer.get(var.name.split(GRAD_MARK, 1)[0])
            if found is not None:
                return found
        return None

    def _owner(self, op, section):
        if section == "backward":
            forward = self.forward_of(op)
            if forward is not None and self._layer.get(id(forward)) is not None:
                return self._layer[id(forward)]
            chosen = _grads(op.input_vars()) or _grads(op.output_vars())
        elif section == "update":
            chosen = [v for v in op.output_vars() if v.persistable]
        elif op.layer is not None:
            return op.layer
        else:
            outs = op.output_vars()
            chosen = [v for v in outs if not v.persistable] or outs
        found = {self.var_layer(v) for v in chosen}
        if len(found) > 1 and section != "update":
            found = {self.var_layer(v) for v in op.input_vars() if v.persistable} or found
        if section == "update":
            found.discard(None)
        return found.pop() if len(found) == 1 else None


def _grads(variables):
    return [v for v in variables if GRAD_MARK in v.name]
