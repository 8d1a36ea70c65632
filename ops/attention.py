"""scaled_dot_product_attention: softmax(q k^T * scale + mask) v, PyTorch's
F.scaled_dot_product_attention, computed block by block (online softmax) so that no
more than a block of the score matrix is ever held.

Inputs q (N, H, Tq, d), k (N, H, Tk, d), v (N, H, Tk, dv) of one float dtype; with
the attribute packed_heads = H >= 1 they are (N, Tq, H*d), (N, Tk, H*d), (N, Tk, H*dv)
instead (the heads side by side in the last axis, the layout of a linear layer's
output; out is then (N, Tq, H*dv)). Optional attn_mask: bool (True: the pair takes
part) or a float added to the scores, of q's dtype, broadcastable (numpy's rules) to
(N, H, Tq, Tk). is_causal keeps the pairs j <= i + offset: offset 0 for
causal_variant "upper_left" (torch's is_causal, top-left aligned when Tq != Tk),
Tk - Tq for "lower_right" (the last query is the last key: a KV cache's new tokens);
with a mask too, a pair must pass both (torch 2.13 combines them). scale: None for
1 / sqrt(d). A query row with no key left has out 0 and gradient 0 (torch's).
Outputs: out, lse (N, H, Tq) = the row's log-sum-exp of its scores (-inf for an
empty row; saved for the gradient), dropout_step (int64 scalar, the step the mask
was drawn with; -1 when none was) and step_out (the step input, += 1 in place).

Dropout (train, dropout_p > 0): the weights are dropped after the softmax and the
kept ones scaled by 1 / (1 - p), as torch's dropout on attn_weight: pair (n, h, i, j)
is kept when u >= p, u = (word >> 8) / 2**24 of word (f % 4) of
Philox4x32-10(counter f // 4, stream 3, key (seed, step)), f = ((n*H + h)*Tq + i)*Tk + j,
so the mask depends on (seed, step, pair) only: the CPU and the GPU draw the same one,
and the gradient draws it again instead of storing it. Infer (is_infer=True): no
dropout; step is neither needed nor written. The op is mode-dependent: it forks the net.

scaled_dot_product_attention_grad(q, k, v, attn_mask, out, lse, dropout_step, dout)
-> dq, dk, dv, dattn_mask (a float mask's gradient, summed to its shape): the
probabilities are recomputed block by block from lse (FlashAttention-2), with
D_i = sum(dout_i * out_i): dv = P'^T dout, dP = (dout v^T) * Z, dS = P * (dP - D),
dq = scale dS k, dk = scale dS^T q (P' = P * Z, Z the kept pairs' 1 / (1 - p)).
In ONNX: MatMul / Softmax / MatMul with the masks as Where or Add (any opset), or
the Attention op (opset 23+, float32). Kernels: kernels/cpu/attention.py
(attention_native.c), kernels/cuda/attention.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import attention as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import attention as cuda
from minigraph.ops import attention_onnx
from minigraph.schema import (
    Meta,
    OpDesc,
    OpError,
    OpSchema,
    Slot,
    examples,
    grad_schema,
    kernel,
    register,
)
from minigraph.validators import (
    bool_attr,
    check_float,
    check_same_dtype,
    dims_equal,
    fail,
    float_attr,
    int_attr,
    non_negative,
    one_of,
    str_attr,
)

TYPE = "scaled_dot_product_attention"
VARIANTS = ("upper_left", "lower_right")


def probability(v):
    return None if 0.0 <= v < 1.0 else "must be in [0, 1) (the probability of dropping)"


def seed_range(v):
    return None if 0 <= v < 2**32 else "must be in [0, 2**32)"


def positive_or_none(v):
    return None if v is None or v > 0 else "must be > 0 (or None for 1 / sqrt(d))"


def logical(op_type, slot, meta, heads):
    """(N, H, T, d) of q, k, v or out in the op's layout (-1 for unknown sizes); an
    OpError naming the slot for a wrong rank or a last axis the heads do not divide."""
    shape = tuple(meta.shape)
    if heads == 0:
        if len(shape) != 4:
            fail(op_type, slot, f"must be (N, heads, T, d) (rank 4), got shape {shape}")
        return shape
    if len(shape) != 3:
        fail(op_type, slot, f"must be (N, T, heads*d) (rank 3) with attribute "
                            f"'packed_heads'={heads}, got shape {shape}")
    if shape[2] >= 0 and shape[2] % heads:
        fail(op_type, slot, f"has {shape[2]} values per position, not a multiple of "
                            f"attribute 'packed_heads' ({heads})")
    return (shape[0], heads, shape[1], shape[2] // heads if shape[2] >= 0 else -1)


def check_qkv(op_type, ins, attrs):
    """(N, H, Tq, Tk, d, dv) of q, k and v, checked: float, one dtype, the same batch and
    heads, k's d = q's d, v's positions = k's."""
    heads = attrs["packed_heads"]
    q, k, v = ins["q"], ins["k"], ins["v"]
    check_float(op_type, "q", q)
    check_same_dtype(op_type, "k", k, "q", q)
    check_same_dtype(op_type, "v", v, "q", q)
    (n, h, tq, d), (nk, hk, tk, dk), (nv, hv, tv, dv) = (
        logical(op_type, s, ins[s], heads) for s in ("q", "k", "v"))
    for slot, a, b, what in (("k", nk, n, "batch size (axis 0)"),
                             ("v", nv, n, "batch size (axis 0)"),
                             ("k", hk, h, "heads (axis 1)"), ("v", hv, h, "heads (axis 1)")):
        if not dims_equal(a, b):
            fail(op_type, slot, f"has {what} {a}, but input 'q' has {b} (shape "
                                f"{tuple(q.shape)})")
    if not dims_equal(dk, d):
        fail(op_type, "k", f"has head size {dk} (shape {tuple(k.shape)}), but input 'q' has "
                           f"{d} (shape {tuple(q.shape)}): q and k must have the same head size")
    if not dims_equal(tv, tk):
        fail(op_type, "v", f"has {tv} positions (shape {tuple(v.shape)}), but input 'k' has "
                           f"{tk} (shape {tuple(k.shape)}): every key needs its value")
    known = [x for x in (n, nk, nv) if x >= 0]
    return (known[0] if known else -1), h, tq, tk, d, dv


def check_mask(op_type, mask, q, target):
    """attn_mask: bool or q's dtype, of rank 1 to 4, broadcastable to `target`
    (N, H, Tq, Tk)."""
    if mask is None:
        return
    if mask.dtype != np.bool_ and mask.dtype != q.dtype:
        fail(op_type, "attn_mask", f"must be bool (True: the pair takes part) or a float mask "
                                   f"of input 'q''s dtype {q.dtype}, got dtype {mask.dtype}")
    shape = tuple(mask.shape)
    if not 1 <= len(shape) <= 4:
        fail(op_type, "attn_mask", f"must have rank 1 to 4 (broadcast to (N, heads, Tq, Tk)), "
                                   f"got shape {shape}")
    for size, want, axis in zip(shape[::-1], target[::-1], ("Tk", "Tq", "heads", "N")):
        if size != 1 and not dims_equal(size, want):
            fail(op_type, "attn_mask", f"with shape {shape} does not broadcast to (N, heads, "
                                       f"Tq, Tk) = {tuple(target)}: its {axis} axis has "
                                       f"{size}, the attention {want}")


def check_step(op_type, step):
    if step is not None and (tuple(step.shape) != () or step.dtype != np.int64):
        fail(op_type, "step", f"must be an int64 scalar (shape ()), got {step.dtype} of "
                              f"shape {tuple(step.shape)}")


def out_shape(ins, attrs, n, h, tq, dv):
    if attrs["packed_heads"]:
        return (n, tq, -1 if dv < 0 else h * dv)
    return (n, h, tq, dv)


def infer_attention(ins, attrs):
    n, h, tq, tk, d, dv = check_qkv(TYPE, ins, attrs)
    q = ins["q"]
    check_mask(TYPE, ins.get("attn_mask"), q, (n, h, tq, tk))
    check_step(TYPE, ins.get("step"))
    return {"out": Meta(out_shape(ins, attrs, n, h, tq, dv), q.dtype),
            "lse": Meta((n, h, tq), q.dtype), "dropout_step": Meta((), np.dtype(np.int64))}


def infer_attention_grad(ins, attrs):
    op_type = TYPE + "_grad"
    n, h, tq, tk, d, dv = check_qkv(op_type, ins, attrs)
    q = ins["q"]
    check_mask(op_type, ins.get("attn_mask"), q, (n, h, tq, tk))
    want = out_shape(ins, attrs, n, h, tq, dv)
    for slot, shape in (("out", want), ("dout", want), ("lse", (n, h, tq))):
        if len(ins[slot].shape) != len(shape) or not all(
                dims_equal(a, b) for a, b in zip(ins[slot].shape, shape)):
            fail(op_type, slot, f"must have shape {shape}, got {tuple(ins[slot].shape)}")
    mask = ins.get("attn_mask")
    return {"dq": Meta(q.shape, q.dtype), "dk": Meta(ins["k"].shape, q.dtype),
            "dv": Meta(ins["v"].shape, q.dtype),
            "dattn_mask": Meta(mask.shape, mask.dtype) if mask is not None else None}


def validate_attention(op):
    """Training with dropout needs the step counter; the gradient needs lse."""
    a = op.attrs
    if a["dropout_p"] > 0 and not a["is_infer"]:
        if op.inputs["step"] is None:
            raise OpError(f"{TYPE}: input 'step' (an int64 counter) is required for "
                          f"dropout_p={a['dropout_p']} in training (is_infer=False)")
        if op.outputs["step_out"] is None:
            raise OpError(f"{TYPE}: output 'step_out' must be bound to input 'step' for "
                          "dropout in training")


def grad_attention(op, dout, make_grad):
    """One scaled_dot_product_attention_grad op; nothing when no gradient flows to out or
    none of q, k, v and a float mask needs one."""
    d = dout.get("out")
    if d is None:
        return []
    mask = op.inputs["attn_mask"]
    grads = {"dq": make_grad(op.inputs["q"]), "dk": make_grad(op.inputs["k"]),
             "dv": make_grad(op.inputs["v"]),
             "dattn_mask": make_grad(mask) if mask is not None and mask.dtype is not None
             and np.dtype(mask.dtype).kind == "f" else None}
    if all(g is None for g in grads.values()):
        return []
    if op.outputs["lse"] is None:
        raise OpError(f"{TYPE}: output 'lse' must be bound for the gradient (the grad op "
                      "recomputes the probabilities from it)")
    dropped = op.attrs["dropout_p"] > 0 and not op.attrs["is_infer"]
    if dropped and op.outputs["dropout_step"] is None:
        raise OpError(f"{TYPE}: output 'dropout_step' must be bound for the gradient with "
                      "dropout (the grad op draws the mask again from it)")
    return [OpDesc(TYPE + "_grad", dict(
        q=op.inputs["q"], k=op.inputs["k"], v=op.inputs["v"], attn_mask=mask,
        out=op.outputs["out"], lse=op.outputs["lse"],
        dropout_step=op.outputs["dropout_step"] if dropped else None, dout=d,
        **{k: v for k, v in grads.items() if v is not None}, **op.attrs))]


ATTRS = (bool_attr("is_causal", False), str_attr("causal_variant", "upper_left",
                                                  one_of(*VARIANTS)),
         float_attr("dropout_p", 0.0, probability),
         float_attr("scale", None, positive_or_none, nullable=True),
         int_attr("packed_heads", 0, non_negative), bool_attr("is_infer", False),
         int_attr("seed", 0, seed_range))

SCHEMA = register(OpSchema(
    type=TYPE,
    inputs=(Slot("q"), Slot("k"), Slot("v"), Slot("attn_mask", optional=True),
            Slot("step", optional=True)),
    outputs=(Slot("out"), Slot("lse", optional=True), Slot("dropout_step", optional=True),
             Slot("step_out", optional=True)),
    attrs=ATTRS, inplace={"step_out": "step"}, mode_attr="is_infer",
    infer=infer_attention, validate=validate_attention, grad=grad_attention,
    export=attention_onnx.export_attention, doc=__doc__))
register(grad_schema(SCHEMA, inputs=(Slot("q"), Slot("k"), Slot("v"),
                                     Slot("attn_mask", optional=True), Slot("out"),
                                     Slot("lse"), Slot("dropout_step", optional=True),
                                     Slot("dout")),
                     outputs=(Slot("dq", optional=True), Slot("dk", optional=True),
                              Slot("dv", optional=True), Slot("dattn_mask", optional=True)),
                     infer=infer_attention_grad))
kernel(TYPE, "cpu", cpu.attention_cpu, bind=cpu.bind_attention)
kernel(TYPE + "_grad", "cpu", cpu.attention_grad_cpu)
kernel(TYPE, "gpu", cuda.attention_gpu, dtypes=GPU_FLOATS)
kernel(TYPE + "_grad", "gpu", cuda.attention_grad_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def attention_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs, attrs,
    grad sets). Dropout masks are the CPU's bit for bit."""
    qkv = (("q", "k", "v"), ("q",), ("k",), ("v",))
    step = np.array(4, np.int64)
    causal = np.tril(np.ones((5, 7), bool), 2)
    return [
        ("plain-f32", {"q": ex.r(2, 3, 5, 8), "k": ex.r(2, 3, 7, 8, seed=1),
                       "v": ex.r(2, 3, 7, 4, seed=2)}, {}, qkv),
        ("causal-f64", {"q": ex.r(1, 2, 9, 6, dtype=np.float64),
                        "k": ex.r(1, 2, 9, 6, dtype=np.float64, seed=1),
                        "v": ex.r(1, 2, 9, 6, dtype=np.float64, seed=2)},
         dict(is_causal=True, scale=0.7), qkv),
        ("lower-right-f32", {"q": ex.r(2, 2, 3, 4), "k": ex.r(2, 2, 6, 4, seed=1),
                             "v": ex.r(2, 2, 6, 4, seed=2)},
         dict(is_causal=True, causal_variant="lower_right"), qkv),
        ("bool-mask-f64", {"q": ex.r(2, 1, 5, 3, dtype=np.float64),
                           "k": ex.r(2, 1, 7, 3, dtype=np.float64, seed=1),
                           "v": ex.r(2, 1, 7, 5, dtype=np.float64, seed=2),
                           "attn_mask": causal}, {}, qkv),
        ("float-mask-f32", {"q": ex.r(1, 2, 4, 8), "k": ex.r(1, 2, 6, 8, seed=1),
                            "v": ex.r(1, 2, 6, 8, seed=2), "attn_mask": ex.r(2, 1, 6, seed=3)},
         dict(is_causal=True), (("q", "k", "v", "attn_mask"), ("attn_mask",))),
        ("packed-dropout-f32", {"q": ex.r(2, 6, 12), "k": ex.r(2, 6, 12, seed=1),
                                "v": ex.r(2, 6, 12, seed=2), "step": step},
         dict(packed_heads=3, dropout_p=0.3, seed=17, is_causal=True), qkv),
        ("dropout-f64", {"q": ex.r(1, 2, 5, 4, dtype=np.float64),
                         "k": ex.r(1, 2, 5, 4, dtype=np.float64, seed=1),
                         "v": ex.r(1, 2, 5, 4, dtype=np.float64, seed=2), "step": step},
         dict(dropout_p=0.5, seed=2**32 - 1), qkv),
    ]


examples(TYPE, attention_examples)
