"""The ONNX mapping of scaled_dot_product_attention (ops/attention.py), the infer copy.

From opset 23 on, float32 attention is one Attention node (3-D inputs with
q_num_heads / kv_num_heads for the packed layout; is_causal=1 for a plain top-left
causal mask, else the combined mask as its attn_mask). Otherwise, and for float64
(Attention takes float16, bfloat16 and float32), it is spelled out:
    MatMul(q, Transpose(k)) * scale (+ a float mask), Where(allowed, ., -inf),
    Softmax(axis -1), a row that sees no key set to 0 (Where(IsNaN(.), 0, .)),
    MatMul(., v),
with Reshape / Transpose around it for the packed layout. The causal rule is built from
the runtime sizes: allowed = Not(j > i + offset), i = Range(Tq), j = Range(Tk),
offset 0 (upper_left) or Tk - Tq (lower_right); a bool mask is And-ed in.
Not an op module: ops/attention.py registers the exporter.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.io import onnx_export

ATTENTION_OPSET = 23


def export_attention(ctx, op):
    """The infer copy's nodes: Attention (opset 23+, float32) or the decomposition."""
    onnx_export.infer_only(op)
    dtype = ctx.dtype(op.inputs["q"])
    if ctx.opset >= ATTENTION_OPSET and dtype == np.float32:
        return _attention_node(ctx, op)
    return _decomposed(ctx, op)


def _scale(ctx, op):
    if op.attrs["scale"] is not None:
        return float(op.attrs["scale"])
    heads = op.attrs["packed_heads"]
    width = ctx.shape(op.inputs["q"])[-1]
    if width < 0:
        raise ValueError(f"scaled_dot_product_attention computing {op.outputs['out'].name!r}: "
                         "the head size of 'q' must be known (or the scale given)")
    return 1.0 / math.sqrt(width // heads if heads else width)


def _sizes(ctx, op, out, nodes):
    """ONNX names of Tq and Tk (int64, shape (1,)) read off q's and k's shapes."""
    axis = 1 if op.attrs["packed_heads"] else 2
    names = []
    for slot in ("q", "k"):
        shape, size = ctx.temp(out, f"{slot}_shape"), ctx.temp(out, f"t{slot[0]}")
        nodes += [ctx.node("Shape", [ctx.value(op.inputs[slot])], [shape]),
                  ctx.node("Slice", [shape, ctx.const(out, f"{slot}_from",
                                                      np.array([axis], np.int64)),
                                     ctx.const(out, f"{slot}_to", np.array([axis + 1],
                                                                           np.int64))], [size])]
        names.append(size)
    return names


def _causal(ctx, op, out, nodes):
    """The name of the bool (Tq, Tk) causal mask: Not(j > i + offset)."""
    tq, tk = _sizes(ctx, op, out, nodes)
    zero, one = (ctx.const(out, n, np.array(v, np.int64)) for n, v in (("zero", 0), ("one", 1)))
    names = {s: ctx.temp(out, s) for s in ("tq_scalar", "tk_scalar", "rows", "cols", "row_col",
                                           "offset", "limit", "beyond", "causal")}
    nodes += [ctx.node("Squeeze", [tq], [names["tq_scalar"]]),
              ctx.node("Squeeze", [tk], [names["tk_scalar"]]),
              ctx.node("Range", [zero, names["tq_scalar"], one], [names["rows"]]),
              ctx.node("Range", [zero, names["tk_scalar"], one], [names["cols"]]),
              ctx.node("Unsqueeze", [names["rows"], ctx.const(out, "axes", np.array([1],
                                                                                np.int64))],
                       [names["row_col"]])]
    if op.attrs["causal_variant"] == "lower_right":
        nodes += [ctx.node("Sub", [names["tk_scalar"], names["tq_scalar"]], [names["offset"]]),
                  ctx.node("Add", [names["row_col"], names["offset"]], [names["limit"]])]
        limit = names["limit"]
    else:
        limit = names["row_col"]
    nodes += [ctx.node("Greater", [names["cols"], limit], [names["beyond"]]),
              ctx.node("Not", [names["beyond"]], [names["causal"]])]
    return names["causal"]


def _masks(ctx, op, out, nodes):
    """(bool name of the pairs allowed or None, float mask name or None)."""
    mask = op.inputs["attn_mask"]
    allowed, additive = None, None
    if mask is not None:
        if ctx.dtype(mask) == np.bool_:
            allowed = ctx.value(mask)
        else:
            additive = ctx.value(mask)
    if op.attrs["is_causal"]:
        causal = _causal(ctx, op, out, nodes)
        if allowed is not None:
            both = ctx.temp(out, "allowed")
            nodes.append(ctx.node("And", [allowed, causal], [both]))
            allowed = both
        else:
            allowed = causal
    return allowed, additive


def _attention_node(ctx, op):
    out = op.outputs["out"]
    heads = op.attrs["packed_heads"]
    nodes = []
    kwargs = {"scale": _scale(ctx, op)}
    if heads:
        kwargs.update(q_num_heads=heads, kv_num_heads=heads)
    inputs = [ctx.value(op.inputs[s]) for s in ("q", "k", "v")]
    plain_causal = (op.attrs["is_causal"] and op.inputs["attn_mask"] is None
                    and op.attrs["causal_variant"] == "upper_left")
    if plain_causal:
        kwargs["is_causal"] = 1
    else:
        allowed, additive = _masks(ctx, op, out, nodes)
        if allowed is not None and additive is not None:
            masked = ctx.temp(out, "mask")
            nodes.append(ctx.node("Where", [allowed, additive, ctx.const(
                out, "minus_inf", np.array(-np.inf, np.float32))], [masked]))
            inputs.append(masked)
        elif allowed is not None or additive is not None:
            inputs.append(allowed if allowed is not None else additive)
    return nodes + [ctx.node("Attention", inputs, [ctx.output(out)], **kwargs)]


def _decomposed(ctx, op):
    out = op.outputs["out"]
    heads = op.attrs["packed_heads"]
    dt = ctx.dtype(op.inputs["q"])
    nodes = []
    q, k, v = (ctx.value(op.inputs[s]) for s in ("q", "k", "v"))
    if heads:
        split = ctx.const(out, "heads_shape", np.array([0, 0, heads, -1], np.int64))
        four = []
        for name, src in (("q4", q), ("k4", k), ("v4", v)):
            flat, moved = ctx.temp(out, f"{name}_split"), ctx.temp(out, name)
            nodes += [ctx.node("Reshape", [src, split], [flat]),
                      ctx.node("Transpose", [flat], [moved], perm=[0, 2, 1, 3])]
            four.append(moved)
        q, k, v = four
    kt, raw, scores = (ctx.temp(out, s) for s in ("k_t", "qk", "scores"))
    nodes += [ctx.node("Transpose", [k], [kt], perm=[0, 1, 3, 2]),
              ctx.node("MatMul", [q, kt], [raw]),
              ctx.node("Mul", [raw, ctx.const(out, "scale", np.array(_scale(ctx, op), dt))],
                       [scores])]
    allowed, additive = _masks(ctx, op, out, nodes)
    if additive is not None:
        added = ctx.temp(out, "scores_masked")
        nodes.append(ctx.node("Add", [scores, additive], [added]))
        scores = added
    if allowed is not None:
        kept = ctx.temp(out, "scores_allowed")
        nodes.append(ctx.node("Where", [allowed, scores, ctx.const(
            out, "minus_inf", np.array(-np.inf, dt))], [kept]))
        scores = kept
    weights = ctx.temp(out, "weights")
    nodes.append(ctx.node("Softmax", [scores], [weights], axis=-1))
    if allowed is not None or additive is not None:             # rows with no key: 0
        nan, fixed = ctx.temp(out, "empty_rows"), ctx.temp(out, "weights_or_zero")
        nodes += [ctx.node("IsNaN", [weights], [nan]),
                  ctx.node("Where", [nan, ctx.const(out, "zero_weight", np.array(0, dt)),
                                     weights], [fixed])]
        weights = fixed
    if not heads:
        return nodes + [ctx.node("MatMul", [weights, v], [ctx.output(out)])]
    o4, moved = ctx.temp(out, "out4"), ctx.temp(out, "out_moved")
    return nodes + [ctx.node("MatMul", [weights, v], [o4]),
                    ctx.node("Transpose", [o4], [moved], perm=[0, 2, 1, 3]),
                    ctx.node("Reshape", [moved, ctx.const(out, "packed_shape",
                                                          np.array([0, 0, -1], np.int64))],
                             [ctx.output(out)])]
