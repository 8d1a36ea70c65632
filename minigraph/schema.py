"""Op schemas and the registry: what an op is, before anything runs it.

An `OpSchema` declares an op's input and output slots, its typed attributes
(with defaults and checkers), in-place pairs, shape/dtype inference, its
grad maker, its ONNX exporter, the roles graph passes look it up by, and its
kernels, registered per (device, float dtypes). Op modules in
`minigraph.ops` register schemas and kernels here; the runtime finds ops only
through here. A kernel is `fn(op, ins, ctx) -> {out_slot: array}`; `ctx` is
a `KernelContext` (minigraph/kernel_context.py, re-exported here), the one object
through which the runner tells a kernel anything besides its op and its input arrays.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from minigraph.kernel_context import KernelContext  # noqa: F401  (kernels import it here)


class OpError(ValueError):
    """A bad op: the message starts with the op type and names the slot or attribute."""

class Meta(NamedTuple):
    """What shape inference knows of a value: a shape (-1 for unknown dims) and a dtype."""

    shape: tuple
    dtype: np.dtype


@dataclass(frozen=True)
class Slot:
    """One input or output of an op. A duplicable slot takes a list of Variables.
    shape_only: the kernels read only the input's shape and dtype, never its values
    (a training step may then drop the values early; see minigraph.executor): True,
    or a function of the op's attributes where that depends on them (average
    pooling's gradient reads only x's shape, max pooling's its values)."""

    name: str
    optional: bool = False
    duplicable: bool = False
    shape_only: bool | Callable = False

    def reads_values(self, attrs):
        """Whether an op with these attributes reads this input's values."""
        only = self.shape_only(attrs) if callable(self.shape_only) else self.shape_only
        return not only


@dataclass(frozen=True)
class Attr:
    """A typed attribute. `check(value)` returns a complaint string, or None when fine."""

    name: str
    types: tuple
    default: object = None
    check: Callable | None = None
    nullable: bool = False
    required: bool = False


@dataclass(frozen=True)
class OpDesc:
    """An op to be built later (what grad makers return): a type and its keyword args."""

    type: str
    kwargs: dict


@dataclass(frozen=True)
class Kernel:
    """One registered kernel: `fn(op, ins, ctx) -> {out_slot: array}` for the float
    dtypes `dtypes` (None: any); `bind`: its bound form or None (minigraph.bound_run)."""

    fn: Callable
    dtypes: tuple | None = None
    bind: Callable | None = None

    def takes(self, floats):
        """True when every dtype in `floats` is one this kernel is written for."""
        return self.dtypes is None or all(d in self.dtypes for d in floats)


# The roles graph passes and backward look ops up by (`OpSchema.roles`), and what an op
# declaring one promises. Several ops may share a role.
ROLES = {
    "accumulate": "out = the sum of the list x (backward adds gradients with it)",
    "fill": "out: a constant tensor of the attributes shape, dtype and value",
    "batch_norm": "batch_norm's slots and attributes (ops/batch_norm.py); folding reads "
                  "x, scale, bias, the estimates, epsilon, data_layout and is_infer",
    "batch_norm_relu": "a batch_norm role op whose y is max(batch norm, 0): batch_norm_relu "
                       "and its sync form (fusing builds them; folding leaves a relu)",
    "linear": "out is x times the weight `OpSchema.weight` names (conv2d, fc's mul)",
    "bias_add": "out = x + y, y a vector along x's axis `axis`",
    "add": "out = x + y, numpy broadcasting", "relu": "out = max(x, 0)",
    "gelu": "out = x Phi(x), the exact gelu", "layer_norm": "layer_norm's slots and attributes",
    "matrix_product": "out = x flattened to a matrix (x_num_col_dims) times y: fc's mul",
    "conv": "a 2-D convolution: x, filter -> out with strides, paddings, dilations, groups",
    "fused_conv": "conv (+ bias + residual + activation + pool) in one op: conv's slots "
                  "and attributes, with optional bias and residual inputs, `activation` "
                  "and `pool` (\"none\" or \"max2x2\": 2x2 windows at stride 2)",
    "dropout": "x -> out; with is_infer (inference) out holds x's values",
    "pool": "pool2d's slots and attributes (pool_type, ksize, strides, paddings, "
            "global_pooling, data_layout)",
    "fused_fc": "matrix_product (+ bias + residual + activation) in one op: its slots "
                "and x_num_col_dims, optional bias and residual inputs and `activation`; "
                "`normalize`: x is layer_norm'd first (norm_scale, norm_bias, norm_epsilon)",
    "fused_fc_group": "fused_fc products of one x (lists y, bias, out), normalize as fused_fc",
    "fused_separable_conv": "a depthwise fused_conv (x, dw_filter, dw_bias, dw_activation, "
                            "its conv attributes), then a 1x1 one (filter, bias, residual, "
                            "activation) in one op",
    "merged_update": "several parameters' updates in one op: param, grad and every other "
                     "list aligned by parameter (cut the lists to update fewer)",
    "clip_gradients": "scales the gradient list x in place (out[i] is x[i]) by what all of "
                      "them hold together; a subset is clipped by the same op with fewer",
}


@dataclass
class OpSchema:
    """Everything the runtime needs to know about one op type.

    infer(ins, attrs) -> {out_slot: Meta}: `ins` maps input slots to Meta
      (a list for duplicable slots, None when an optional one is unbound);
      it raises OpError for bad shapes or dtypes.
    grad(op, dout, make_grad) -> [OpDesc]: `dout` maps output slots to the
      Variable holding d(loss)/d(output) (None where nothing flows back);
      `make_grad(var)` gives the Variable to write d(loss)/d(var) into, or
      None when `var` needs no gradient.
      `grad_maker(...)` builds the usual one from a declaration.
    validate(op) raises OpError for rules that span slots and attributes.
    resolve_attrs(attrs) -> attrs turns checked attribute values into their
      stored form (an int into a pair, a None stride into the window size).
    kernels: device -> (Kernel, ...), registered with `kernel`; `kernel_for`
      picks the first whose dtypes take the inputs.
    export(ctx, op) -> [NodeProto]: the op's ONNX nodes (minigraph.io.onnx_export:
      `ctx` names values and builds nodes); `no_export` says why an op has no
      exporter (a gradient, an update, a training-only op).
    examples(ex) -> [(name, inputs, attrs, grad sets)]: small cases the device
      tests run on every place against the CPU (`ex` makes their arrays); set with
      `examples(op_type, fn)`.

    What graph rewrites may ask of an op (declared here, never matched by
    its type name outside ops/):
    mode_attr: the bool attribute that says "inference" (batch_norm's and
      dropout's `is_infer`); a Net forks at the first op that declares one.
    roles: the jobs other modules look this op up for (`ROLES`, `ops_with_role`,
      `op_for_role`).
    weight: for a "linear" op, (weight slot, the weight's output-channel axis,
      the output's channel axis; -1 for the last; or a function of the op's
      attributes giving it, where a layout attribute moves it); `weight_axes(op)`
      reads it for one op.
    sync_variant: the op type that computes the same over every rank's batch
      (convert_sync_batchnorm rewrites this op into it).
    merged_variant: the "merged_update" op making this update op's update for a list
      of parameters (passes.merge_updates merges such ops into it).
    presummed(op) -> output slots whose values are already sums over every
      rank and identical on each (sync_batch_norm_grad's dscale and dbias).
    presummed_average: the bool attribute that makes the op itself divide its
      presummed outputs by the world size (data parallelism's average folded into
      the kernel: sync_batch_norm_grad's `average_ranks`); data_parallel sets it
      instead of adding a c_avg_presummed op.
    collectives(op, comm) -> [(kind, what, shape, dtype)]: the collectives the
      op's kernels make on `comm`, in order (kind: "allreduce", ...; what: the
      label they pass), or None when that cannot be told before the op runs; a
      step announces them to the communicator, whose order check then verifies
      the whole step in one exchange (Communicator.begin_step).
    replication: "always" when the outputs are identical on every rank (an
      op that averages presummed values), "inputs" when they are whenever
      every input is (a sum), None otherwise.
    reuse: output slot -> input slots whose array the CPU kernel may write
      that output into (Paddle's inplace inferer; `KernelContext.donated`);
      otherwise kernels never write their inputs.
    work_room: the CPU kernel's speed grows with its work arrays; a training
      step that has measured its memory op by op gives it `KernelContext.room`.
    spares: the CPU kernel writes the new values of its in-place outputs into the
      arrays `KernelContext.spares` offers (leaving the inputs as they were) and
      returns those, so a training step needs no copy to undo it (minigraph.journal).
    """

    type: str
    inputs: tuple
    outputs: tuple
    attrs: tuple = ()
    inplace: dict = field(default_factory=dict)     # output slot -> input slot
    reuse: dict = field(default_factory=dict)       # output slot -> input slots (tuple)
    work_room: bool = False
    spares: bool = False
    infer: Callable | None = None
    grad: Callable | None = None
    validate: Callable | None = None                # validate(op): cross-slot rules at build
    resolve_attrs: Callable | None = None           # resolve_attrs(dict) -> dict: canonical
                                                    # forms, defaults that depend on other attrs
    kernels: dict = field(default_factory=dict)     # device -> (Kernel, ...)
    export: Callable | None = None
    no_export: str = ""
    examples: Callable | None = None                # examples(ex) -> [(name, ins, attrs, grads)]
    mode_attr: str | None = None
    roles: tuple = ()
    weight: tuple | None = None
    sync_variant: str | None = None
    merged_variant: str | None = None
    presummed: Callable | None = None
    presummed_average: str | None = None
    collectives: Callable | None = None
    replication: str | None = None
    doc: str = ""

    def slot(self, name):
        for s in self.inputs + self.outputs:
            if s.name == name:
                return s
        return None

    def attr(self, name):
        for a in self.attrs:
            if a.name == name:
                return a
        return None

    def has_attr(self, name):
        return self.attr(name) is not None

    def has_role(self, role):
        return role in self.roles

    def weight_axes(self, op):
        """(weight slot, its output-channel axis, out's channel axis) of a "linear" `op`."""
        slot, w_axis, out_axis = self.weight
        return slot, w_axis, out_axis(op.attrs) if callable(out_axis) else out_axis

    def kernel_for(self, device, ins):
        """The kernel function for `device` that takes the float dtypes of `ins`
        ({slot: array or list of arrays or None}); an OpError naming the op, the
        device, and the input and dtypes when none does."""
        found = self.kernels.get(device, ())
        if not found:
            raise OpError(f"{self.type}: no kernel for {device.upper()} places; it has "
                          f"{', '.join(d.upper() for d in self.kernels) or 'none'}")
        floats = {}
        for slot, a in ins.items():
            for i, x in enumerate(a if isinstance(a, list) else [a]):
                if x is not None and np.dtype(x.dtype).kind == "f":
                    floats[f"{slot}[{i}]" if isinstance(a, list) else slot] = np.dtype(x.dtype)
        for k in found:
            if k.takes(floats.values()):
                return k.fn
        taken = sorted({str(d) for k in found for d in k.dtypes}, key=lambda d: int(d[5:]))
        where, dt = next((w, d) for w, d in floats.items() if all(d not in k.dtypes
                                                                  for k in found))
        hint = " (run float16 on the CPU)" if device == "gpu" else ""
        raise OpError(f"{self.type}: input {where!r} has dtype {dt}; the {device.upper()} "
                      f"kernels take {' or '.join(taken)}{hint}")


_SCHEMAS: dict = {}


def register(schema):
    """Add `schema` to the registry; registering a type twice, an undeclared
    role or a mode_attr that is not a bool attribute is an error."""
    if schema.type in _SCHEMAS:
        raise ValueError(f"op {schema.type!r} is already registered")
    if schema.mode_attr is not None and bool not in getattr(schema.attr(schema.mode_attr),
                                                            "types", ()):
        raise ValueError(f"op {schema.type!r}: mode_attr {schema.mode_attr!r} must name one of "
                         "its bool attributes")
    unknown = [r for r in schema.roles if r not in ROLES]
    if unknown:
        raise ValueError(f"op {schema.type!r}: unknown role {unknown[0]!r}; roles: "
                         f"{', '.join(sorted(ROLES))}")
    _SCHEMAS[schema.type] = schema
    return schema


def kernel(op_type, device, fn=None, dtypes=None, bind=None):
    """Register `fn(op, ins, ctx) -> outs` as a kernel of `op_type` on `device` places
    ("cpu", "gpu") for the float `dtypes` (None: any), `bind` its bound form (CPU
    inference run again: minigraph.bound_run). Without `fn`, a decorator. Kernels of one
    device are tried in registration order (OpSchema.kernel_for); the runner picks one
    once per input signature, so a kernel holds only arithmetic. Returns fn."""
    if fn is None:
        return lambda f: kernel(op_type, device, f, dtypes, bind)
    schema = get_schema(op_type)
    entry = Kernel(fn, None if dtypes is None else tuple(np.dtype(d) for d in dtypes), bind)
    schema.kernels[device] = schema.kernels.get(device, ()) + (entry,)
    return fn


def examples(op_type, fn):
    """Declare (and return) `fn(ex) -> [(name, inputs, attrs, grad sets)]`: the cases of
    `op_type` the device tests run on every place against the CPU (test_gpu_ops.py)."""
    get_schema(op_type).examples = fn
    return fn


def get_schema(op_type):
    """The schema of `op_type`; an unknown type is an error listing the known ones."""
    try:
        return _SCHEMAS[op_type]
    except KeyError:
        raise OpError(f"unknown op type {op_type!r}; registered: "
                      f"{', '.join(sorted(_SCHEMAS))}") from None


def ops_with_role(role):
    """The op types that declare `role` (see ROLES), sorted."""
    if role not in ROLES:
        raise OpError(f"unknown role {role!r}; roles: {', '.join(sorted(ROLES))}")
    return sorted(t for t, s in _SCHEMAS.items() if role in s.roles)


def op_for_role(role):
    """The one op type that declares `role`; an OpError when none or several do."""
    found = ops_with_role(role)
    if len(found) != 1:
        raise OpError(f"role {role!r} needs exactly one op, found "
                      f"{', '.join(found) or 'none'}")
    return found[0]


def registered_ops():
    """Names of every registered op type, sorted."""
    return sorted(_SCHEMAS)


def inference_only(op_type, train_with):
    """An inference-only op's grad maker: an OpError saying to train with `train_with`."""
    def no_grad(op, dout, make_grad):
        raise OpError(f"{op_type}: an inference-only op, it has no gradient; train the net "
                      f"with {train_with} and fuse its inference copy "
                      "(mg.passes.optimize_for_inference)")
    return no_grad


def grad_maker(grad_type, keep=("x",), dout=None, wrt=("x",), attrs=True):
    """The usual grad maker, declared in one line (Paddle's DefaultGradOpMaker).

    The maker builds one `grad_type` op whose slots are: each name in `keep`
    bound to the forward op's input or output of that name; the incoming
    gradients, `dout` mapping forward output slots to grad input slots
    (default {"out": "dout"}); and `d<slot>` for each input slot in `wrt`,
    bound to make_grad(that input). attrs=True copies every attribute, a
    tuple copies those named, False none. It builds nothing when no incoming
    gradient is bound or no input in `wrt` needs a gradient.
    """
    dout = {"out": "dout"} if dout is None else dict(dout)

    def make(op, douts, make_grad):
        incoming = {g: douts.get(f) for f, g in dout.items()}
        if all(d is None for d in incoming.values()):
            return []
        grads = {f"d{slot}": make_grad(op.inputs[slot]) for slot in wrt}
        if all(g is None for g in grads.values()):
            return []
        kwargs = {s: op.inputs[s] if s in op.inputs else op.outputs[s] for s in keep}
        kwargs.update(incoming)
        kwargs.update(grads)
        if attrs:
            kwargs.update({k: v for k, v in op.attrs.items() if attrs is True or k in attrs})
        return [OpDesc(grad_type, kwargs)]

    make.grad_type = grad_type
    return make


def grad_schema(forward, inputs, outputs, infer=None, **fields):
    """`forward`'s grad op `<type>_grad`: these slots, the forward's attributes and checks."""
    fields.setdefault("no_export", "a gradient op (training only)")
    return OpSchema(type=forward.type + "_grad", inputs=tuple(inputs), outputs=tuple(outputs),
                    attrs=forward.attrs, resolve_attrs=forward.resolve_attrs, infer=infer,
                    **fields)


def meta_of(value):
    """Meta of a concrete array."""
    return Meta(tuple(value.shape), np.dtype(value.dtype))
