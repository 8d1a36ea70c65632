"""The ONNX counterpart of each minigraph op that can run in an infer graph.

MAPPINGS is a table {op type: fn(ctx, op) -> [NodeProto]}; minigraph.onnx_export
walks the pruned infer graph and calls the function of each op. A function
asks `ctx` for the ONNX names of the op's inputs (`ctx.value`, which makes a
persistable an initializer on first use), of its outputs (`ctx.output`), of
helper tensors (`ctx.temp`, `ctx.const`) and builds nodes with `ctx.node`.
It produces only the outputs that inference computes (batch_norm's `y`,
dropout's `out`, ...). Every mapping holds for opsets 13 to 20.

Imported only by minigraph.onnx_export.export, after onnx was found.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper


def _pair(v):
    return (int(v), int(v)) if np.ndim(v) == 0 else (int(v[0]), int(v[1]))


def _axis(axis, rank):
    return axis % rank if rank else 0


def _unary(onnx_type, **attrs):
    """The mapping of an op with input slot x and output slot out to one node."""
    def to_onnx(ctx, op):
        x = op.inputs["x"]
        return [ctx.node(onnx_type, [ctx.value(x)], [ctx.output(op.outputs["out"])], **attrs)]
    to_onnx.__doc__ = f"out = {onnx_type}(x)"
    return to_onnx


def _binary(onnx_type):
    """An op out = x (op) y with numpy broadcasting, ONNX's own rule."""
    def to_onnx(ctx, op):
        ins = [ctx.value(op.inputs["x"]), ctx.value(op.inputs["y"])]
        return [ctx.node(onnx_type, ins, [ctx.output(op.outputs["out"])])]
    to_onnx.__doc__ = f"out = {onnx_type}(x, y), numpy broadcasting"
    return to_onnx


def infer_only(op):
    """OpError-like ValueError unless a mode-dependent op runs in inference mode."""
    mode = op.schema.mode_attr
    if mode is not None and not op.attrs[mode]:
        raise ValueError(f"{op.type} with {mode}=False is a training op; export the infer "
                         "branch (net.ops('infer'))")


def conv2d(ctx, op):
    """Conv with explicit symmetric pads, strides, dilations and group."""
    w = op.inputs["filter"]
    (ph, pw), a = _pair(op.attrs["paddings"]), op.attrs
    return [ctx.node("Conv", [ctx.value(op.inputs["x"]), ctx.value(w)],
                     [ctx.output(op.outputs["out"])],
                     kernel_shape=list(ctx.shape(w)[2:]), pads=[ph, pw, ph, pw],
                     strides=list(_pair(a["strides"])), dilations=list(_pair(a["dilations"])),
                     group=int(a["groups"]))]


def batch_norm(ctx, op):
    """BatchNormalization on the estimates (inference); NHWC is transposed to NCHW
    and back around it."""
    infer_only(op)
    x, y = op.inputs["x"], op.outputs["y"]
    rank = len(ctx.shape(x))
    ins = [ctx.value(op.inputs[s]) for s in ("scale", "bias", "estimated_mean", "estimated_var")]
    eps = float(op.attrs["epsilon"])
    if op.attrs["data_layout"] == "NCHW" or rank == 2:
        return [ctx.node("BatchNormalization", [ctx.value(x), *ins], [ctx.output(y)],
                         epsilon=eps)]
    to_nchw = [0, rank - 1, *range(1, rank - 1)]
    to_nhwc = [0, *range(2, rank), 1]
    xt, yt = ctx.temp(y, "nchw"), ctx.temp(y, "bn_nchw")
    return [ctx.node("Transpose", [ctx.value(x)], [xt], perm=to_nchw),
            ctx.node("BatchNormalization", [xt, *ins], [yt], epsilon=eps),
            ctx.node("Transpose", [yt], [ctx.output(y)], perm=to_nhwc)]


def pool2d(ctx, op):
    """MaxPool / AveragePool (padding excluded from the divisor) with explicit
    pads; global pooling -> GlobalMaxPool / GlobalAveragePool."""
    a, x, out = op.attrs, ctx.value(op.inputs["x"]), ctx.output(op.outputs["out"])
    kind = "Max" if a["pool_type"] == "max" else "Average"
    if a["global_pooling"]:
        return [ctx.node(f"Global{kind}Pool", [x], [out])]
    ksize = _pair(a["ksize"])
    strides = ksize if a["strides"] is None else _pair(a["strides"])
    ph, pw = _pair(a["paddings"])
    extra = {} if kind == "Max" else {"count_include_pad": 0}
    return [ctx.node(f"{kind}Pool", [x], [out], kernel_shape=list(ksize),
                     strides=list(strides), pads=[ph, pw, ph, pw], **extra)]


def mul(ctx, op):
    """MatMul of x viewed as a matrix (Flatten, or a Reshape keeping the first
    x_num_col_dims dims) with y."""
    x, n = op.inputs["x"], int(op.attrs["x_num_col_dims"])
    out = op.outputs["out"]
    rank, xs = len(ctx.shape(x)), ctx.value(x)
    nodes = []
    if rank > n + 1:
        flat = ctx.temp(out, "flat")
        if n == 1:
            nodes.append(ctx.node("Flatten", [xs], [flat], axis=1))
        else:
            shape = ctx.const(out, "shape", np.array([0] * n + [-1], np.int64))
            nodes.append(ctx.node("Reshape", [xs, shape], [flat]))
        xs = flat
    return nodes + [ctx.node("MatMul", [xs, ctx.value(op.inputs["y"])], [ctx.output(out)])]


def elementwise_add(ctx, op):
    """Add, y lined up with x's dims from `axis`: a persistable y is stored with
    trailing 1s (a bias (C,) at axis 1 of NCHW as (C, 1, 1)); a computed y is
    Unsqueezed."""
    x, y, out = op.inputs["x"], op.inputs["y"], op.outputs["out"]
    x_rank, y_shape = len(ctx.shape(x)), tuple(ctx.shape(y))
    axis = int(op.attrs["axis"])
    start = x_rank - len(y_shape) if axis == -1 else axis
    trailing = x_rank - start - len(y_shape)
    nodes = []
    if trailing == 0:
        ys = ctx.value(y)
    elif y.persistable:
        ys = ctx.value(y, shape=y_shape + (1,) * trailing)
    else:
        ys = ctx.temp(out, "y")
        axes = ctx.const(out, "axes", np.arange(len(y_shape), len(y_shape) + trailing))
        nodes.append(ctx.node("Unsqueeze", [ctx.value(y), axes], [ys]))
    return nodes + [ctx.node("Add", [ctx.value(x), ys], [ctx.output(out)])]


def leaky_relu(ctx, op):
    """LeakyRelu with the op's alpha."""
    return _unary("LeakyRelu", alpha=float(op.attrs["alpha"]))(ctx, op)


def softmax(ctx, op):
    """Softmax along the op's axis (opset 13+: along that axis alone)."""
    return _unary("Softmax", axis=int(op.attrs["axis"]))(ctx, op)


def gelu(ctx, op):
    """0.5 x (1 + Erf(x / sqrt 2)): the exact form (opset 17 has no Gelu)."""
    x, out = op.inputs["x"], op.outputs["out"]
    dt = ctx.dtype(x)
    xs = ctx.value(x)
    scaled, erf, plus, half = (ctx.temp(out, s) for s in ("scaled", "erf", "one_plus", "half_x"))
    return [ctx.node("Div", [xs, ctx.const(out, "sqrt2", np.array(math.sqrt(2.0), dt))],
                     [scaled]),
            ctx.node("Erf", [scaled], [erf]),
            ctx.node("Add", [erf, ctx.const(out, "one", np.array(1.0, dt))], [plus]),
            ctx.node("Mul", [xs, ctx.const(out, "0.5", np.array(0.5, dt))], [half]),
            ctx.node("Mul", [half, plus], [ctx.output(out)])]


def concat(ctx, op):
    """Concat along `axis`."""
    ins = [ctx.value(v) for v in op.inputs["x"]]
    return [ctx.node("Concat", ins, [ctx.output(op.outputs["out"])],
                     axis=int(op.attrs["axis"]))]


def reshape(ctx, op):
    """Reshape to the `shape` attribute (an int64 constant; -1 is inferred, no 0s)."""
    out = op.outputs["out"]
    shape = ctx.const(out, "shape", np.array(op.attrs["shape"], np.int64))
    return [ctx.node("Reshape", [ctx.value(op.inputs["x"]), shape], [ctx.output(out)])]


def flatten(ctx, op):
    """Flatten when dims 1.. merge into one; else a Reshape that copies the dims
    before start_axis (0), merges start..stop (-1 or their known product) and
    keeps the known dims after stop_axis."""
    x, out = op.inputs["x"], op.outputs["out"]
    shape = tuple(ctx.shape(x))
    rank = len(shape)
    start, stop = _axis(op.attrs["start_axis"], rank), _axis(op.attrs["stop_axis"], rank)
    if start == 1 and stop == rank - 1:
        return [ctx.node("Flatten", [ctx.value(x)], [ctx.output(out)], axis=1)]
    merged = shape[start:stop + 1]
    target = [0] * start + [-1 if min(merged) < 0 else math.prod(merged)]
    target += [d if d >= 0 else -1 for d in shape[stop + 1:]]
    if target.count(-1) > 1:
        raise ValueError(f"flatten computing {out.name!r}: input {x.name!r} of shape {shape} "
                         "has unknown dims both inside and after the merged axes; ONNX "
                         "Reshape can infer only one")
    const = ctx.const(out, "shape", np.array(target, np.int64))
    return [ctx.node("Reshape", [ctx.value(x), const], [ctx.output(out)])]


def transpose(ctx, op):
    """Transpose by `perm`."""
    return [ctx.node("Transpose", [ctx.value(op.inputs["x"])], [ctx.output(op.outputs["out"])],
                     perm=[int(p) for p in op.attrs["perm"]])]


def dropout(ctx, op):
    """Identity: inference dropout passes x through (mask and step are not written)."""
    infer_only(op)
    return [ctx.node("Identity", [ctx.value(op.inputs["x"])], [ctx.output(op.outputs["out"])])]


def argmax(ctx, op):
    """ArgMax along `axis`, keepdims=0, the first maximum, int64."""
    return [ctx.node("ArgMax", [ctx.value(op.inputs["x"])], [ctx.output(op.outputs["out"])],
                     axis=int(op.attrs["axis"]), keepdims=0)]


def mean(ctx, op):
    """ReduceMean over every axis, keepdims=0: a scalar."""
    return [ctx.node("ReduceMean", [ctx.value(op.inputs["x"])],
                     [ctx.output(op.outputs["out"])], keepdims=0)]


def sum_(ctx, op):
    """Sum of the list x."""
    return [ctx.node("Sum", [ctx.value(v) for v in op.inputs["x"]],
                     [ctx.output(op.outputs["out"])])]


def accuracy(ctx, op):
    """ReduceMean(Cast(Equal(ArgMax(logits, axis 1), label), float32)): a scalar."""
    out = op.outputs["out"]
    pred, hit, hits = (ctx.temp(out, s) for s in ("argmax", "equal", "float"))
    return [ctx.node("ArgMax", [ctx.value(op.inputs["logits"])], [pred], axis=1, keepdims=0),
            ctx.node("Equal", [pred, ctx.value(op.inputs["label"])], [hit]),
            ctx.node("Cast", [hit], [hits], to=TensorProto.FLOAT),
            ctx.node("ReduceMean", [hits], [ctx.output(out)], keepdims=0)]


def softmax_with_cross_entropy(ctx, op):
    """softmax = Softmax(logits, axis 1); loss = -GatherElements(LogSoftmax(logits),
    label[:, None], axis 1)[:, 0]. Only the outputs used downstream are made."""
    logits, label = ctx.value(op.inputs["logits"]), op.inputs["label"]
    sm, loss = op.outputs["softmax"], op.outputs["loss"]
    nodes = []
    if ctx.wants(sm):
        nodes.append(ctx.node("Softmax", [logits], [ctx.output(sm)], axis=1))
    if ctx.wants(loss):
        logp, idx, picked, picked1 = (ctx.temp(loss, s) for s in
                                      ("log_softmax", "label_col", "picked", "picked_flat"))
        axis1 = ctx.const(loss, "axis1", np.array([1], np.int64))
        nodes += [ctx.node("LogSoftmax", [logits], [logp], axis=1),
                  ctx.node("Unsqueeze", [ctx.value(label), axis1], [idx]),
                  ctx.node("GatherElements", [logp, idx], [picked], axis=1),
                  ctx.node("Squeeze", [picked, axis1], [picked1]),
                  ctx.node("Neg", [picked1], [ctx.output(loss)])]
    return nodes


def fill_constant(ctx, op):
    """A Constant node holding the filled tensor."""
    a, out = op.attrs, op.outputs["out"]
    value = np.full(tuple(a["shape"]), a["value"]).astype(a["dtype"])
    tensor = helper.make_tensor(out.name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                value.shape, value.flatten().tolist())
    return [ctx.node("Constant", [], [ctx.output(out)], value=tensor)]


MAPPINGS = {
    "accuracy": accuracy,
    "add": _binary("Add"),
    "argmax": argmax,
    "batch_norm": batch_norm,
    "concat": concat,
    "conv2d": conv2d,
    "dropout": dropout,
    "elementwise_add": elementwise_add,
    "fill_constant": fill_constant,
    "flatten": flatten,
    "gelu": gelu,
    "leaky_relu": leaky_relu,
    "mean": mean,
    "mul": mul,
    "multiply": _binary("Mul"),
    "pool2d": pool2d,
    "relu": _unary("Relu"),
    "reshape": reshape,
    "sigmoid": _unary("Sigmoid"),
    "softmax": softmax,
    "softmax_with_cross_entropy": softmax_with_cross_entropy,
    "sum": sum_,
    "sync_batch_norm": batch_norm,
    "tanh": _unary("Tanh"),
    "transpose": transpose,
}
