"""Graph pass: fold inference batch norms into the conv2d or fc before them.

An inference batch norm (an op with the "batch_norm" role) computes
y = (x - mean) * s + bias with s = scale / sqrt(var + eps) per channel. When x
is the output of a "linear" op (conv2d, fc's mul: OpSchema.weight names its
weight and channel axes), with or without its "bias_add", and nothing else reads
x, the batch norm disappears into that layer's weight and bias:

    w' = w * s            (conv2d: per output channel; fc: per column)
    b' = (b - mean) * s + bias     (b = 0 without a bias add)

The new bias is added by the layer's bias add (or one takes the batch
norm's place). A batch_norm_relu (role "batch_norm_relu") folds the same way and
leaves a relu op computing its output from the folded layer's. A batch norm that
cannot be folded stays, and the report says why. The source net is not touched:
the pass works on a copy of its inference graph (minigraph.passes.infer_clone).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minigraph.operator import Operator
from minigraph.passes.infer_clone import clone_for_inference, drop_unused_persistables
from minigraph.schema import op_for_role

NAME = "fold_batch_norm"


@dataclass(frozen=True)
class FoldNote:
    """One batch norm of the net: folded into `into` (an op description), or kept
    because of `reason`."""

    batch_norm: str
    folded: bool
    into: str = ""
    reason: str = ""

    def __str__(self):
        if self.folded:
            return f"{self.batch_norm}: folded into {self.into}"
        return f"{self.batch_norm}: kept ({self.reason})"


def fold_batch_norm(net, fetches=None, verbose=False):
    """A new infer-only Net equal to `net.infer` for `fetches` with every foldable
    batch norm folded (see the module doc); `net` and its persistables are
    untouched. fetches: Variables of `net` or names, what the new net computes
    (its default fetches); by default the net's predictions, without its loss,
    labels and metrics (minigraph.passes.infer_clone.inference_outputs). The new
    net's `reports["fold_batch_norm"]` lists a FoldNote per batch norm;
    verbose=True also prints it. Fetch from the new net by name, or fetch nothing
    to get its default fetches."""
    return fold(net, fetches, verbose, NAME)


def fold(net, fetches, verbose, made_by):
    """fold_batch_norm for the pass `made_by` (named in the new net's errors)."""
    folded, _ = clone_for_inference(net, made_by, fetches)
    notes = []
    for bn in [op for op in folded.section("trunk") if op.schema.has_role("batch_norm")]:
        notes.append(_fold_one(folded, bn))
    drop_unused_persistables(folded)
    folded.mark_applied(NAME, notes)
    if verbose:
        for note in notes:
            print(f"fold_batch_norm: {note}")
    return folded


def _fold_one(net, bn):
    label = bn.outputs["batch_mean"].name.rsplit(".", 1)[0]
    ops = net.section("trunk")
    x = bn.inputs["x"]
    readers = [op for op in ops if x in op.input_vars()]
    producer = next((op for op in ops if x in op.output_vars()), None)
    bias_add = None
    if producer is not None and producer.schema.has_role("bias_add") and \
            producer.inputs["y"].persistable:
        bias_add, producer = producer, next(
            (op for op in ops if producer.inputs["x"] in op.output_vars()), None)
    why = _why_not(bn, x, readers, producer, bias_add, ops)
    if why:
        return FoldNote(label, False, reason=why)
    w_slot, channel_axis, _ = producer.schema.weight_axes(producer)
    w = producer.inputs[w_slot]
    channels = bn.inputs["estimated_mean"].shape[0]
    a = {s: np.full(channels, 1.0 if s == "scale" else 0.0) if bn.inputs[s] is None else
         bn.inputs[s].get().astype(np.float64)
         for s in ("scale", "bias", "estimated_mean", "estimated_var")}
    s = a["scale"] / np.sqrt(a["estimated_var"] + bn.attrs["epsilon"])
    w64 = w.get().astype(np.float64)
    shape = [1] * w64.ndim
    shape[channel_axis] = -1
    w.set(net.place.to_device((w64 * s.reshape(shape)).astype(w.dtype)))
    b_old = bias_add.inputs["y"].get().astype(np.float64) if bias_add else 0.0
    b_new = ((b_old - a["estimated_mean"]) * s + a["bias"]).astype(w.dtype)
    y = bn.outputs["y"]
    relu = bn.schema.has_role("batch_norm_relu")
    if relu:                            # the folded layer's output, then a relu into y
        out = net.scope.new_var(f"{label}.folded")
        out.declare(y.decl_shape, y.decl_dtype)
    else:
        out = y
    if bias_add is not None:
        b = bias_add.inputs["y"]
        b.set(net.place.to_device(b_new))
        net.replace_op("trunk", bias_add, Operator(
            bias_add.type, x=bias_add.inputs["x"], y=b, out=out, **bias_add.attrs))
        if relu:
            net.replace_op("trunk", bn, _folded_relu(bn, out, y))
        else:
            net.remove_op("trunk", bn)
    else:
        b = bn.inputs["bias"]
        if b is None:                   # affine=False: the folded bias gets a Variable
            b = net.scope.new_var(f"{label}.folded_bias", persistable=True, trainable=False)
        b.set(net.place.to_device(b_new))
        add = Operator(op_for_role("bias_add"), x=x, y=b, out=out,
                       axis=_out_channel_axis(producer, x))
        add.layer = producer.layer              # the layer's bias now
        net.replace_op("trunk", bn, add)
        if relu:
            ops = net.section("trunk")
            net.insert_op("trunk", ops.index(add) + 1, _folded_relu(bn, out, y))
    return FoldNote(label, True, into=f"the {producer.type} computing {x.name!r}" +
                    (" and its bias add" if bias_add else " (as a new bias add)") +
                    (", a relu after it" if relu else ""))


def _folded_relu(bn, x, out):
    """The relu a folded batch_norm_relu leaves after the folded layer: in the layer its
    output is named after (the relu layer the fusing pass took it from), else the batch
    norm's."""
    relu = Operator(op_for_role("relu"), x=x, out=out)
    relu.layer = out.name.rsplit(".", 1)[0] if "." in out.name else bn.layer
    return relu


def _out_channel_axis(producer, out):
    """The axis of `out` (the output of a "linear" op) that holds its channels."""
    axis = producer.schema.weight_axes(producer)[2]
    return axis % len(out.shape)


def _why_not(bn, x, readers, producer, bias_add, ops):
    """Why `bn` cannot be folded ('' when it can)."""
    if bn.inputs["estimated_mean"] is None:
        return "it keeps no running estimates (track_running_stats=False): it normalises " \
               "with batch statistics"
    if not (bn.attrs["is_infer"] or bn.attrs["use_global_est"]):
        return "it normalises with batch statistics"
    if len(readers) > 1:
        others = ", ".join(op.type for op in readers if op is not bn)
        return f"its input {x.name!r} is also read by {others}"
    if producer is None or not producer.schema.has_role("linear"):
        what = "a data input" if producer is None else producer.type
        return f"its input comes from {what}, not a conv2d or fc"
    if bias_add is not None:
        inner = bias_add.inputs["x"]
        if sum(inner in op.input_vars() for op in ops) > 1:
            return f"the {producer.type} output {inner.name!r} is read by more than the bias add"
        bias = bias_add.inputs["y"]
        if sum(bias in op.input_vars() for op in ops) > 1 or len(bias.shape or ()) != 1:
            return f"the bias {bias.name!r} is shared or not per channel"
        rank = len(x.shape)
        start = rank - 1 if bias_add.attrs["axis"] == -1 else bias_add.attrs["axis"]
        if start != _out_channel_axis(producer, x):
            return "the bias add does not add per output channel"
    w = producer.inputs[producer.schema.weight_axes(producer)[0]]
    if not w.persistable or sum(w in op.input_vars() for op in ops) > 1:
        return f"the weight {w.name!r} is not a parameter of this layer alone"
    rank, layout = len(x.shape), bn.attrs["data_layout"]
    channel = 1 if layout == "NCHW" else rank - 1
    if channel != _out_channel_axis(producer, x):
        return (f"a {layout} batch norm after {producer.type} (whose channels are on axis "
                f"{_out_channel_axis(producer, x)} of its rank-{rank} output)")
    return ""
