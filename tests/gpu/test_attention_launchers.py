"""kernels/cuda/attention.py, kv_cache.py and position_embedding.py on the emulator and
(marked gpu) a real GPU, against the float64 references and the CPU kernels: the
attention and its gradients in both layouts, with every kind of mask, causal top-left
and bottom-right, dropout masks bit for bit the CPU's, empty rows, several tiles; a KV
cache's slabs; a position table and its gradient; the head-size limit."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng
from references import attention_keep, scaled_dot_product_attention

from minigraph.kernels.cpu import attention as cpu_attention


def ref_grads(q, k, v, mask, dout, causal, variant, scale, keep, p):
    """dq, dk, dv and a float mask's gradient (summed to its shape) in float64 from the
    whole score matrix: the softmax's adjoint."""
    r = scaled_dot_product_attention(q, k, v, mask, causal, variant, scale, keep, p)
    w = r["weights"]
    z = np.ones_like(w) if keep is None else keep / (1 - p)
    scale = 1 / np.sqrt(q.shape[3]) if scale is None else scale
    dw = np.einsum("nhic,nhjc->nhij", dout, v) * z
    ds = w * (dw - (dw * w).sum(-1, keepdims=True))
    grads = {"dq": np.einsum("nhij,nhjc->nhic", ds, k) * scale,
             "dk": np.einsum("nhij,nhic->nhjc", ds, q) * scale,
             "dv": np.einsum("nhij,nhic->nhjc", w * z, dout)}
    if mask is not None and mask.dtype != np.bool_:
        g = ds
        while g.ndim > mask.ndim:
            g = g.sum(axis=0)
        grads["dmask"] = g.sum(axis=tuple(i for i, n in enumerate(mask.shape) if n == 1),
                               keepdims=True)
    return r, grads


CASES = [
    dict(shape=(2, 3, 5, 7, 4, 3)),
    dict(shape=(1, 2, 70, 40, 9, 5), causal=True),                   # several tiles of 64/16
    dict(shape=(1, 2, 6, 3, 4, 4), causal=True, variant="lower_right"),  # empty rows
    dict(shape=(2, 1, 5, 7, 3, 6), mask="bool"),
    dict(shape=(2, 2, 4, 6, 8, 8), mask="float", causal=True),
    dict(shape=(1, 3, 6, 6, 4, 4), p=0.3, causal=True),
    dict(shape=(2, 2, 5, 5, 6, 6), packed=True, causal=True, variant="lower_right", p=0.5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(
    f"{k}={v}" for k, v in c.items() if k != "shape") or "plain")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_and_its_gradients(device, case, dtype):
    from minigraph.kernels.cuda import attention

    n, h, tq, tk, d, dv = case["shape"]
    g = rng(3)
    q, k, v = (g.normal(size=s) for s in ((n, h, tq, d), (n, h, tk, d), (n, h, tk, dv)))
    dout = g.normal(size=(n, h, tq, dv))
    mask = None
    if case.get("mask") == "bool":
        mask = g.random((tq, tk)) > 0.4
        mask[1] = False
    elif case.get("mask") == "float":
        mask = g.normal(size=(1, h, 1, tk))
    causal, variant = case.get("causal", False), case.get("variant", "upper_left")
    p, seed, step = case.get("p", 0.0), 99, 6
    keep = attention_keep((n, h, tq, tk), p, seed, step) if p else None
    ref, grads = ref_grads(q, k, v, mask, dout, causal, variant, 0.45, keep, p)
    heads = h if case.get("packed") else 0
    pack = (lambda a: cpu_attention.packed_out(a, heads)) if heads else (lambda a: a)
    put = {name: device.put(pack(a).astype(dtype)) for name, a in
           (("q", q), ("k", k), ("v", v), ("dout", dout))}
    m = None if mask is None else device.put(mask if mask.dtype == np.bool_
                                             else mask.astype(dtype))
    dstep = device.put(np.array(step, np.int64))
    out, lse = attention.forward(put["q"], put["k"], put["v"], m, heads, causal, variant, 0.45,
                                 p, seed, dstep)
    assert int(device.get(dstep)) == step                        # the forward only reads it
    assert rel_err(device.get(out), pack(ref["out"])) < TOL[dtype]
    finite = np.isfinite(ref["lse"])
    got_lse = device.get(lse)
    assert (np.isfinite(got_lse) == finite).all()
    assert rel_err(got_lse[finite], ref["lse"][finite]) < TOL[dtype]
    wants = ["dq", "dk", "dv"] + (["dmask"] if "dmask" in grads else [])
    got = attention.backward(put["q"], put["k"], put["v"], m, out, lse, put["dout"], heads,
                             causal, variant, 0.45, p, seed, dstep, wants)
    for name in wants:
        want = grads[name] if name == "dmask" else pack(grads[name])
        assert rel_err(device.get(got[name]), want) < TOL[dtype] * 20, name


def test_dropout_step_is_read_then_advanced(device):
    from minigraph.kernels.cuda import attention

    step = device.put(np.array(41, np.int64))
    saved = attention.advance(step)
    assert int(device.get(saved)) == 41 and int(device.get(step)) == 42


def test_head_sizes_past_the_limit_are_refused(device):
    from minigraph.kernels.cuda import attention

    x = device.put(np.zeros((1, 1, 2, 130), np.float32))
    with pytest.raises(ValueError, match=r"head sizes up to 128, got d=130"):
        attention.forward(x, x, x, None, 0, False, "upper_left", None)


def test_kv_cache_slabs(device):
    from minigraph.kernels.cuda import kv_cache

    g = rng(5)
    slab = device.put(np.zeros((2, 6, 3), np.float32))
    first, second = g.normal(size=(2, 4, 3)).astype(np.float32), \
        g.normal(size=(2, 2, 3)).astype(np.float32)
    kv_cache.put(device.put(first), slab, 0)
    kv_cache.put(device.put(second), slab, 4)
    np.testing.assert_array_equal(device.get(kv_cache.take(slab, 6)),
                                  np.concatenate([first, second], axis=1))
    np.testing.assert_array_equal(device.get(kv_cache.take(slab, 3)), first[:, :3])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_position_table_and_its_gradient(device, dtype):
    from minigraph.kernels.cuda import position_embedding as pe

    g = rng(6)
    x, w, dout = (g.normal(size=s).astype(dtype) for s in ((3, 4, 5), (9, 5), (3, 4, 5)))
    got = device.get(pe.add_rows(device.put(x), device.put(w), 2))
    assert rel_err(got, x + w[2:6]) < TOL[dtype]
    dw = device.get(pe.rows_grad(device.put(dout), 9))
    want = np.zeros((9, 5))
    want[:4] = dout.astype(np.float64).sum(axis=0)
    assert rel_err(dw, want) < TOL[dtype]
