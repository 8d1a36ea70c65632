"""ONNX export of a net's infer graph (`mg.onnx.export`).

    mg.onnx.export(net, "model.onnx", feeds=["image"], fetches=[logits])

The infer branch (`net.ops("infer")`) is pruned to what the fetches need and
each op becomes ONNX nodes by its schema's exporter (`OpSchema.export`,
declared in the op's module in ops/; the helpers at the end of this module
build the common ones). The graph's
inputs are the feeds, its outputs the fetches, both under their Variable
names; every -1 of a data declaration is a symbolic dim ("N" for the first
axis), so one file serves any batch size. The persistables the ops read are
initializers holding their current values. The model is checked with
`onnx.checker.check_model(full_check=True)` and written atomically.

Importing this module needs no onnx; calling `export` does
(`pip install 'minigraph[onnx]'`).
"""
from __future__ import annotations

import numpy as np

from minigraph.feeds import io_variables
from minigraph.io.files import atomic_write
from minigraph.plan import prune

OPSETS = range(13, 25)
DEFAULT_OPSET = 17


class ExportError(ValueError):
    """A net, feed, fetch or op that cannot be exported; the message says which."""


def export(net, path, feeds, fetches, opset=DEFAULT_OPSET):
    """Write the infer graph of `net` as an ONNX model to `path`; returns it as a Path.

    feeds: data Variables of `net` or their names, the model's inputs (in order).
    fetches: Variables of `net` (a train-branch Variable stands for its infer
    copy) or names, the model's outputs (in order). opset: the default-domain
    opset, 13 to 24 (17 by default). Every op the fetches need must have an
    exporter (OpSchema.export) and every data Variable they read must be a
    feed; otherwise ExportError naming the op type (and why it has none) or
    the Variable.
    ImportError when onnx is not installed.
    """
    onnx = _require_onnx()
    what = f"onnx.export {str(path)!r}"
    if isinstance(opset, bool) or not isinstance(opset, int) or opset not in OPSETS:
        raise ExportError(f"{what}: opset must be an int from {OPSETS[0]} to {OPSETS[-1]} "
                          f"(the mappings hold there), got {opset!r}")
    feed_vars, fetch_vars = io_variables(net, feeds, fetches, what, ExportError)
    ops = prune(net.ops("infer"), fetch_vars)
    if any(v.persistable and v.value is None for op in ops for v in op.input_vars()):
        net.initialize()
    ctx = Context(onnx, opset, feed_vars, fetch_vars, ops, what)
    nodes = []
    for op in ops:
        fn = op.schema.export
        if fn is None:
            out = ", ".join(repr(v.name) for v in op.output_vars()) or "nothing"
            why = f" ({op.schema.no_export})" if op.schema.no_export else ""
            raise ExportError(f"{what}: op {op.type!r} (computing {out}) has no ONNX "
                              f"exporter{why}")
        try:
            nodes += fn(ctx, op)
        except ExportError:
            raise
        except ValueError as e:
            raise ExportError(f"{what}: {e}") from None
        ctx.check_outputs(op)
    unmade = [v.name for v in fetch_vars if id(v) not in ctx.made]
    if unmade:
        raise ExportError(f"{what}: no op of the infer graph computes the fetch "
                          f"{', '.join(map(repr, unmade))} (a feed or a persistable is not an "
                          "output; a train-only Variable has no infer copy)")
    model = _model(onnx, ctx, nodes, feed_vars, fetch_vars)
    onnx.checker.check_model(model, full_check=True)
    data = model.SerializeToString()
    return atomic_write(path, lambda f: f.write(data))


def _require_onnx():
    try:
        import onnx
    except ImportError as e:
        raise ImportError("minigraph.onnx.export needs the onnx package: "
                          "pip install 'minigraph[onnx]'") from e
    return onnx


class Context:
    """What the ops' exporters build into: ONNX names of Variables, initializers,
    constants and helper tensors, in one namespace. `onnx` is the onnx module
    (TensorProto, helper), for exporters that need more than `node`."""

    def __init__(self, onnx, opset, feeds, fetches, ops, what):
        self.onnx, self.opset, self.what = onnx, opset, what
        self.feeds = {id(v) for v in feeds}
        self.fetches = {id(v) for v in fetches}
        self.read = {id(v) for op in ops for v in op.input_vars()}
        self.names = {}             # id(Variable) -> its ONNX name
        self.taken = set()
        self.made = set()           # id(Variable) of the values nodes produce
        self.params = {}            # (id(Variable), shape) -> initializer name
        self.initializers = []
        self.op = None
        for v in [*feeds, *fetches]:
            self._name(v)

    def _unique(self, base):
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def _name(self, var):
        if id(var) not in self.names:
            self.names[id(var)] = self._unique(var.name)
        return self.names[id(var)]

    def value(self, var, shape=None):
        """The ONNX name of `var` as an op input: a value made by an earlier node,
        a feed, or a persistable (an initializer holding var.get(), reshaped to
        `shape` when given)."""
        if id(var) in self.made:
            return self.names[id(var)]
        if var.is_data:
            if id(var) not in self.feeds:
                raise ExportError(f"{self.what}: the fetches need the data {var.name!r}, which "
                                  "is not among the feeds")
            return self.names[id(var)]
        if not var.persistable:
            raise ExportError(f"{self.what}: {var.name!r} is read but no op of the infer graph "
                              "computes it (and it is neither a feed nor a persistable)")
        array = np.asarray(var.get())
        shape = tuple(array.shape) if shape is None else tuple(shape)
        key = (id(var), shape)
        if key not in self.params:
            made_before = any(i == id(var) for i, _ in self.params)
            name = self._unique(var.name) if made_before else self._name(var)
            self.params[key] = name
            self.initializers.append(self.onnx.numpy_helper.from_array(
                np.ascontiguousarray(array.reshape(shape)), name))
        return self.params[key]

    def output(self, var):
        """The ONNX name under which a node produces `var`."""
        if id(var) in self.made:
            raise ExportError(f"{self.what}: {var.name!r} is computed twice (an in-place op "
                              "cannot be exported)")
        self.made.add(id(var))
        return self._name(var)

    def wants(self, var):
        """True when a later op reads `var` or it is a fetch."""
        return id(var) in self.read or id(var) in self.fetches

    def temp(self, var, what):
        """A fresh name for a helper tensor on the way to `var`."""
        return self._unique(f"{self._name(var)}/{what}")

    def const(self, var, what, array):
        """A constant initializer (int64 or of the float dtype given) named after `var`."""
        name = self.temp(var, what)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def epilogue(self, var, first_step, first, adds=(), activation=None):
        """The nodes of a fused op computing `var`: first(name) (nodes whose result is
        `name`, named after `first_step`), then an Add of each (step, Variable) of
        `adds`, then the activation: None, "relu" (a Relu), or (step, nodes(x, result)),
        nodes(x, result) giving the nodes from the value named x to the one named
        result. The last result is `var`."""
        if activation == "relu":
            activation = ("relu", lambda x, result: [self.node("Relu", [x], [result])])
        steps = [first_step] + [step for step, _ in adds] + ([activation[0]] if activation
                                                             else [])
        names = [self.temp(var, step) for step in steps[:-1]] + [self.output(var)]
        nodes = list(first(names[0]))
        for k, (_, value) in enumerate(adds):
            nodes.append(self.node("Add", [names[k], self.value(value)], [names[k + 1]]))
        if activation:
            nodes.extend(activation[1](names[-2], names[-1]))
        return nodes

    def node(self, onnx_type, inputs, outputs, **attrs):
        """A NodeProto named after its first output."""
        return self.onnx.helper.make_node(onnx_type, inputs, outputs,
                                          name=self._unique(f"{onnx_type}:{outputs[0]}"),
                                          **attrs)

    def shape(self, var):
        """The declared (build-time) shape of `var`; -1 marks an unknown dim."""
        shape = var.value.shape if var.persistable and var.value is not None else var.decl_shape
        if shape is None:
            raise ExportError(f"{self.what}: the shape of {var.name!r} is not known at build "
                              "time; its rank is needed for the ONNX mapping")
        return tuple(int(d) for d in shape)

    def dtype(self, var):
        """The numpy dtype of `var`."""
        return np.dtype(var.value.dtype if var.persistable and var.value is not None
                        else var.decl_dtype)

    def check_outputs(self, op):
        """ExportError when a later op or a fetch needs an output of `op` that its
        mapping did not produce (one only training computes)."""
        ins = {id(v) for v in op.input_vars()}
        for slot, var in op.outputs.items():
            for v in var if isinstance(var, list) else [var]:
                if v is not None and id(v) not in ins and self.wants(v) and id(v) not in self.made:
                    raise ExportError(f"{self.what}: output {slot!r} ({v.name!r}) of {op.type} "
                                      "is not computed in inference; it has no ONNX counterpart")


def _model(onnx, ctx, nodes, feeds, fetches):
    """The ModelProto: inputs with symbolic batch dims, outputs with the dims ONNX
    shape inference finds (else the declared ones, -1 as a symbolic dim)."""
    helper = onnx.helper
    inputs = [helper.make_tensor_value_info(ctx.names[id(v)], _elem(onnx, v.decl_dtype),
                                            _input_dims(v)) for v in feeds]
    outputs = [helper.make_tensor_value_info(ctx.names[id(v)], _elem(onnx, ctx.dtype(v)), None)
               for v in fetches]
    graph = helper.make_graph(nodes, "minigraph", inputs, outputs, initializer=ctx.initializers,
                              doc_string="the infer graph of a minigraph Net")
    opsets = [helper.make_opsetid("", ctx.opset)]
    from minigraph import __version__
    model = helper.make_model(graph, opset_imports=opsets, producer_name="minigraph",
                              producer_version=__version__,
                              ir_version=helper.find_min_ir_version_for(opsets))
    inferred = onnx.shape_inference.infer_shapes(model)
    found = {o.name: o for o in inferred.graph.output}
    graph = model.graph                 # make_model copied the graph
    del graph.output[:]
    for v in fetches:
        name = ctx.names[id(v)]
        graph.output.append(helper.make_tensor_value_info(
            name, _elem(onnx, ctx.dtype(v)), _output_dims(name, v.decl_shape, found.get(name))))
    graph.value_info.extend(i for i in inferred.graph.value_info if i.name not in found)
    return model


def _elem(onnx, dtype):
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _input_dims(var):
    return [d if d >= 0 else ("N" if i == 0 else f"{var.name}_d{i}")
            for i, d in enumerate(var.decl_shape)]


def _output_dims(name, declared, inferred):
    dims = None
    if inferred is not None and inferred.type.tensor_type.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                for d in inferred.type.tensor_type.shape.dim]
    if declared is None:
        return dims
    if dims is None or len(dims) != len(declared):
        dims = [None] * len(declared)
    return [d if d is not None else (k if k >= 0 else f"{name}_d{i}")
            for i, (d, k) in enumerate(zip(dims, declared))]


# ---- what exporters share (OpSchema.export: fn(ctx, op) -> [NodeProto]) -------------

def unary(onnx_type, **attrs):
    """The exporter of an op x -> out that is one ONNX node."""
    def export(ctx, op):
        return [ctx.node(onnx_type, [ctx.value(op.inputs["x"])],
                         [ctx.output(op.outputs["out"])], **attrs)]
    export.__doc__ = f"out = {onnx_type}(x)"
    return export


def binary(onnx_type):
    """The exporter of an op out = x (op) y with numpy broadcasting, ONNX's own rule."""
    def export(ctx, op):
        ins = [ctx.value(op.inputs["x"]), ctx.value(op.inputs["y"])]
        return [ctx.node(onnx_type, ins, [ctx.output(op.outputs["out"])])]
    export.__doc__ = f"out = {onnx_type}(x, y), numpy broadcasting"
    return export


def infer_only(op):
    """A ValueError unless a mode-dependent op runs in inference mode."""
    mode = op.schema.mode_attr
    if mode is not None and not op.attrs[mode]:
        raise ValueError(f"{op.type} with {mode}=False is a training op; export the infer "
                         "branch (net.ops('infer'))")


def pair(v):
    """An int or a pair as a tuple of two ints."""
    return (int(v), int(v)) if np.ndim(v) == 0 else (int(v[0]), int(v[1]))


def moments_normalize(ctx, x, axes, eps, out, var, dtype):
    """Nodes computing `out` = (x - mean) / sqrt(mean((x - mean)^2) + eps), the means
    over `axes` kept as size-1 dims (x and out: ONNX names; `var` the Variable the
    helper tensors are named after): what LayerNormalization and
    BatchNormalization's training mode compute, spelled out for any opset."""
    mean, centred, square, variance, shifted, std = (
        ctx.temp(var, s) for s in ("mean", "centred", "square", "variance", "plus_eps", "std"))
    return [reduce_mean(ctx, x, axes, mean, var),
            ctx.node("Sub", [x, mean], [centred]),
            ctx.node("Mul", [centred, centred], [square]),
            reduce_mean(ctx, square, axes, variance, var),
            ctx.node("Add", [variance, ctx.const(var, "epsilon", np.array(eps, dtype))],
                     [shifted]),
            ctx.node("Sqrt", [shifted], [std]),
            ctx.node("Div", [centred, std], [out])]


def reduce_mean(ctx, x, axes, out, var):
    """ReduceMean over `axes`, keepdims=1: axes an attribute before opset 18, an input
    from it on."""
    if ctx.opset < 18:
        return ctx.node("ReduceMean", [x], [out], axes=list(axes), keepdims=1)
    return ctx.node("ReduceMean", [x, ctx.const(var, "axes", np.array(axes, np.int64))], [out],
                    keepdims=1)
