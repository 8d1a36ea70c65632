"""scaled_dot_product_attention: torch's F.scaled_dot_product_attention against the float64
reference (the whole score matrix), on both CPU engines (the native kernel and the numpy
engine); gradients against finite differences; masks of every kind; causal with Tq != Tk
(top-left and bottom-right); dropout drawn from (seed, step), forked and reproducible;
memory that grows with T; bad input named when the layer is built."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from helpers import helper_test_op
from references import attention_keep, scaled_dot_product_attention

import minigraph as mg
from minigraph import layers as L
from minigraph.kernels.cpu import attention as cpu_attention
from minigraph.kernels.cpu import attention_native, blocks, native
from minigraph.schema import get_schema

TYPE = "scaled_dot_product_attention"
rng = np.random.default_rng(45)


def r(*shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(params=["native", "numpy"])
def engine(request, monkeypatch):
    """The CPU engine: the native kernel (skipped where it cannot be built) or the numpy
    engine (MINIGRAPH_NATIVE=0)."""
    if request.param == "numpy":
        monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    elif not attention_native.available():
        pytest.skip(f"native kernels not built: {native.reason('attention_native')}")
    return request.param


def unpack(a, heads):
    """(N, T, H*d) -> (N, H, T, d)."""
    if not heads:
        return a
    n, t, hd = a.shape
    return a.reshape(n, t, heads, hd // heads).transpose(0, 2, 1, 3)


def pack(a, heads):
    if not heads:
        return a
    n, h, t, d = a.shape
    return a.transpose(0, 2, 1, 3).reshape(n, t, h * d)


def attention_reference(q, k, v, attn_mask=None, step=None, is_causal=False,
                        causal_variant="upper_left", dropout_p=0.0, scale=None, packed_heads=0,
                        seed=0, is_infer=False):
    """The op's outputs from references.scaled_dot_product_attention (and
    references.attention_keep for the dropout)."""
    q4, k4, v4 = (unpack(a, packed_heads) for a in (q, k, v))
    dropping = dropout_p > 0 and not is_infer
    keep = attention_keep((q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2]), dropout_p,
                          seed, int(step)) if dropping else None
    ref = scaled_dot_product_attention(q4, k4, v4, attn_mask, is_causal, causal_variant, scale,
                                       keep, dropout_p)
    out = {"out": pack(ref["out"], packed_heads), "lse": ref["lse"]}
    if dropping:
        out.update(dropout_step=np.array(step), step_out=step + 1)
    return out


def check(inputs, attrs=None, grads=("q", "k", "v"), **kw):
    return helper_test_op(TYPE, inputs, attrs or {}, attention_reference, grad_wrt=grads,
                          outputs=("out",), **kw)


# ---- forward and gradients -----------------------------------------------------------

@pytest.mark.parametrize("n,h,tq,tk,d,dv", [(2, 3, 5, 7, 4, 3), (1, 1, 1, 1, 1, 1),
                                            (1, 2, 6, 3, 5, 2), (2, 1, 3, 3, 8, 8)])
def test_plain_attention_and_its_gradients(engine, n, h, tq, tk, d, dv):
    check({"q": r(n, h, tq, d), "k": r(n, h, tk, d), "v": r(n, h, tk, dv)})


@pytest.mark.parametrize("tq,tk", [(4, 4), (3, 6), (6, 3)])
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_causal_aligned_top_left_like_torch_or_bottom_right(engine, tq, tk, variant):
    """upper_left is torch's is_causal (query i sees keys j <= i even when Tq != Tk);
    lower_right puts the last query on the last key; rows that see no key are 0."""
    got = check({"q": r(1, 2, tq, 4), "k": r(1, 2, tk, 4), "v": r(1, 2, tk, 3)},
                {"is_causal": True, "causal_variant": variant, "scale": 0.8})
    if variant == "lower_right" and tq > tk:
        assert (got["out"][:, :, :tq - tk] == 0).all()
        assert np.isneginf(got["lse"][:, :, :tq - tk]).all()


@pytest.mark.parametrize("shape", [(5, 7), (1, 7), (7,), (2, 1, 5, 7), (1, 3, 1, 7),
                                   (2, 3, 5, 1)], ids=str)
def test_bool_masks_broadcast_like_numpy(engine, shape):
    mask = rng.random(shape) > 0.35
    check({"q": r(2, 3, 5, 4), "k": r(2, 3, 7, 4), "v": r(2, 3, 7, 2), "attn_mask": mask})


@pytest.mark.parametrize("shape", [(5, 7), (7,), (2, 3, 5, 7), (1, 1, 5, 1)], ids=str)
def test_float_masks_are_added_and_get_a_gradient(engine, shape):
    mask = r(*shape)
    check({"q": r(2, 3, 5, 4), "k": r(2, 3, 7, 4), "v": r(2, 3, 7, 2), "attn_mask": mask},
          grads=("q", "k", "v", "attn_mask"))


def test_a_mask_and_causal_combine_and_empty_rows_are_zero(engine):
    """torch 2.13 applies both; a row with no key left has out 0 (and gradient 0)."""
    mask = rng.random((6, 6)) > 0.3
    mask[2] = False
    fmask = np.zeros((6, 6))
    fmask[4] = -np.inf
    got = check({"q": r(1, 2, 6, 3), "k": r(1, 2, 6, 3), "v": r(1, 2, 6, 3),
                 "attn_mask": mask}, {"is_causal": True})
    assert (got["out"][:, :, 2] == 0).all() and np.isneginf(got["lse"][:, :, 2]).all()
    got = check({"q": r(1, 2, 6, 3), "k": r(1, 2, 6, 3), "v": r(1, 2, 6, 3),
                 "attn_mask": fmask}, {"is_causal": True})
    assert (got["out"][:, :, 4] == 0).all()


def test_packed_heads_layout(engine):
    """packed_heads=H: q, k, v and out are (N, T, H*d), a linear layer's layout."""
    check({"q": r(2, 5, 12), "k": r(2, 7, 12), "v": r(2, 7, 6)},
          {"packed_heads": 3, "is_causal": True, "causal_variant": "lower_right"})


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_many_blocks_and_ragged_sizes(engine, dtype):
    """Several blocks of queries and keys (64 each in the native kernel), sizes that fill
    none, a head size that is not a vector's multiple; float32 to 1e-5."""
    q, k, v = r(1, 2, 150, 33, dtype=dtype), r(1, 2, 130, 33, dtype=dtype), \
        r(1, 2, 130, 17, dtype=dtype)
    mask = r(1, 1, 150, 130, dtype=dtype)
    helper_test_op(TYPE, {"q": q, "k": k, "v": v, "attn_mask": mask},
                   {"is_causal": True, "causal_variant": "lower_right"}, attention_reference)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [16, 32, 33, 64])
def test_one_query_row_over_many_keys(engine, dtype, d):
    """A generated token's pass (one query row, the native kernel's unpacked row path)
    over several blocks of keys: head sizes of whole vectors and with a tail, against
    the float64 reference."""
    q, k, v = r(2, 1, 3 * d, dtype=dtype), r(2, 150, 3 * d, dtype=dtype), \
        r(2, 150, 3 * d, dtype=dtype)
    helper_test_op(TYPE, {"q": q, "k": k, "v": v},
                   {"packed_heads": 3, "is_causal": True, "causal_variant": "lower_right"},
                   attention_reference, grad_wrt=(), outputs=("out",))


def test_large_logits_stay_finite(engine):
    q = r(1, 1, 4, 3) * 300
    got = check({"q": q, "k": r(1, 1, 5, 3), "v": r(1, 1, 5, 3)}, grads=())
    assert np.isfinite(got["out"]).all()


def test_the_engines_agree_on_every_gradient(monkeypatch):
    """The native kernel against the numpy engine, float32, several blocks, masked and
    causal, with dropout: forward, lse and the four gradients."""
    if not attention_native.available():
        pytest.skip(native.reason("attention_native"))
    q, k, v = (r(2, 2, 140, 20, dtype=np.float32) for _ in range(3))
    mask, dout = r(1, 2, 1, 140, dtype=np.float32), r(2, 2, 140, 20, dtype=np.float32)
    args = (mask, 0, 0.3, (0.2, 77 + (5 << 32)))
    o_c, l_c = attention_native.forward(q, k, v, *args, 0)
    o_n, l_n = cpu_attention.forward_numpy(q, k, v, *args)
    np.testing.assert_allclose(o_c, o_n, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(l_c, l_n, rtol=1e-5)
    wants = {"dq", "dk", "dv", "dmask"}
    g_c = attention_native.backward(q, k, v, mask, o_c, l_c, dout, 0, 0.3, args[3], 0, wants)
    g_n = cpu_attention.backward_numpy(q, k, v, mask, o_c, l_c, dout, 0, 0.3, args[3], wants)
    for name in wants:
        scale = np.abs(g_n[name]).max()
        np.testing.assert_allclose(g_c[name], g_n[name], atol=2e-5 * scale, err_msg=name)


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    """Each output is summed by one thread in one order; only dQ's per-thread sums (one
    head, split over key blocks) are added up at the end."""
    if not attention_native.available():
        pytest.skip(native.reason("attention_native"))
    q, k, v, dout = (r(1, 1, 300, 16, dtype=np.float32) for _ in range(4))
    runs = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(blocks, "get_num_threads", lambda threads=threads: threads)
        o, lse = attention_native.forward(q, k, v, None, 0, 0.25, None, 0)
        runs.append((o, attention_native.backward(q, k, v, None, o, lse, dout, 0, 0.25, None,
                                                  0, {"dq", "dk", "dv"})))
    for o, grads in runs[1:]:
        np.testing.assert_array_equal(o, runs[0][0])
        np.testing.assert_array_equal(grads["dk"], runs[0][1]["dk"])
        np.testing.assert_array_equal(grads["dv"], runs[0][1]["dv"])
        np.testing.assert_allclose(grads["dq"], runs[0][1]["dq"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_packed_path_gives_the_views_paths_bits(dtype, monkeypatch):
    """forward_packed reads the op's packed arrays where they are (slices of a KV cache's
    slabs, one batch row or several): forward's bits, lse included, causal or not; None
    where it does not apply."""
    if not attention_native.available():
        pytest.skip(native.reason("attention_native"))
    heads, d = 4, 8
    for n, tq, tk in ((1, 1, 37), (2, 1, 70), (2, 5, 9), (1, 64, 64)):
        q = r(n, tq, heads * d, dtype=dtype)
        k, v = (r(n, 80, heads * d, dtype=dtype)[:, :tk] for _ in range(2))
        for offset in (None, 0, tk - tq):
            got = attention_native.forward_packed(q, k, v, heads, offset, 0.3)
            views = [cpu_attention.heads_view(a, heads) for a in (q, k, v)]
            want = attention_native.forward(*views, None, offset, 0.3, None, heads)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            assert attention_native.forward_packed(q, k, v, heads, offset, 0.3, False)[1] is None
    assert attention_native.forward_packed(q, k, v[..., :16], heads, None, 0.3) is None
    assert attention_native.forward_packed(q, k.astype(np.float16), v, heads, None, 0.3) is None
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert attention_native.forward_packed(q, k, v, heads, None, 0.3) is None


# ---- dropout ---------------------------------------------------------------------------

def test_dropout_is_the_reference_philox_mask_and_steps_the_counter(engine):
    inputs = {"q": r(2, 2, 5, 4), "k": r(2, 2, 6, 4), "v": r(2, 2, 6, 3),
              "step": np.array(7, np.int64)}
    got = check(inputs, {"dropout_p": 0.4, "seed": 123})
    assert int(got["dropout_step"]) == 7 and int(got["step_out"]) == 8


def test_dropout_with_masks_packed_and_causal(engine):
    check({"q": r(1, 4, 6), "k": r(1, 4, 6), "v": r(1, 4, 6), "attn_mask": r(4, 4),
           "step": np.array(2, np.int64)},
          {"dropout_p": 0.5, "seed": 9, "packed_heads": 2, "is_causal": True},
          grads=("q", "k", "v", "attn_mask"))


def test_infer_drops_nothing_and_leaves_the_step(engine):
    got = check({"q": r(1, 2, 4, 3), "k": r(1, 2, 4, 3), "v": r(1, 2, 4, 3),
                 "step": np.array(3, np.int64)}, {"dropout_p": 0.5, "is_infer": True})
    assert int(got["step_out"]) == 3


def dropout_net(seed, p=0.3):
    net = mg.Net(seed=seed)
    q, k, v = (L.data(net, s, (-1, 2, 6, 4)) for s in "qkv")
    out = L.scaled_dot_product_attention(net, q, k, v, dropout_p=p, name="att")
    return net, out


def test_dropout_forks_the_net_and_is_reproducible_from_the_seed():
    feed = {s: r(2, 2, 6, 4, dtype=np.float32) for s in "qkv"}
    net, out = dropout_net(seed=5)
    assert net.forked and [op.attrs["is_infer"] for op in
                           (net.ops("train")[0], net.ops("infer")[0])] == [False, True]
    first, second = (net.train(feed=feed, fetch=[out])[0] for _ in range(2))
    assert not np.array_equal(first, second)                 # the step moved on
    assert int(net.var("att.step").get()) == 2
    again, _ = dropout_net(seed=5)
    np.testing.assert_array_equal(again.train(feed=feed, fetch=[out.name])[0], first)
    other, _ = dropout_net(seed=6)
    assert not np.array_equal(other.train(feed=feed, fetch=[out.name])[0], first)
    plain = mg.Net(seed=5)
    qkv = [L.data(plain, s, (-1, 2, 6, 4)) for s in "qkv"]
    want = plain.infer(feed=feed, fetch=[L.scaled_dot_product_attention(plain, *qkv)])[0]
    np.testing.assert_allclose(net.infer(feed=feed, fetch=[out])[0], want, rtol=1e-6)
    assert int(net.var("att.step").get()) == 2               # infer never steps it


def test_the_gradient_redraws_the_forward_mask():
    """Training with dropout: the gradients of a loss equal those of the reference with the
    forward's keep mask (drawn from the step the forward used)."""
    net = mg.Net(seed=3)
    q, k, v = (L.data(net, s, (1, 2, 5, 3), "float64") for s in "qkv")
    params = [net.create_parameter(f"p{s}", (1, 2, 5, 3), "float64", mg.initializer.Constant(0))
              for s in "qkv"]
    out = L.scaled_dot_product_attention(net, *(L.add(net, a, b) for a, b in zip((q, k, v),
                                                                                params)),
                                         dropout_p=0.4, name="att")
    w = L.data(net, "w", (1, 2, 5, 3), "float64")
    mg.append_backward(net, L.reduce_sum(net, L.multiply(net, out, w)))
    feed = {"q": r(1, 2, 5, 3), "k": r(1, 2, 5, 3), "v": r(1, 2, 5, 3), "w": r(1, 2, 5, 3)}
    net.train(feed=feed)                                     # step 0; now step 1
    got = net.train(feed=feed, fetch=[out] + [net.grad(p) for p in params])
    keep = attention_keep((1, 2, 5, 5), 0.4, net.ops("train")[3].attrs["seed"], 1)
    ref = scaled_dot_product_attention(feed["q"], feed["k"], feed["v"], keep=keep,
                                       dropout_p=0.4)
    np.testing.assert_allclose(got[0], ref["out"], rtol=1e-12)
    weights, z = ref["weights"], keep / 0.6
    dw = np.einsum("nhic,nhjc->nhij", feed["w"], feed["v"]) * z
    ds = weights * (dw - (dw * weights).sum(-1, keepdims=True))
    scale = 1 / np.sqrt(3)
    np.testing.assert_allclose(got[1], np.einsum("nhij,nhjc->nhic", ds, feed["k"]) * scale,
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[2], np.einsum("nhij,nhic->nhjc", ds, feed["q"]) * scale,
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[3], np.einsum("nhij,nhic->nhjc", weights * z, feed["w"]),
                               rtol=1e-10, atol=1e-12)


# ---- memory ------------------------------------------------------------------------------

def test_the_numpy_engine_holds_blocks_not_the_score_matrix(monkeypatch):
    """Peak traced memory of forward + backward at T and 2T: about 2x (linear in T), never
    the 4x of a T x T score matrix (which at 2T would be 32 MiB alone)."""
    monkeypatch.setattr(cpu_attention, "BLOCK_SCORES", 1 << 14)
    peaks = []
    for t in (1024, 2048):
        q, k, v, dout = (r(1, 1, t, 8) for _ in range(4))
        tracemalloc.start()
        o, lse = cpu_attention.forward_numpy(q, k, v, None, 0, 0.3, None)
        cpu_attention.backward_numpy(q, k, v, None, o, lse, dout, 0, 0.3, None,
                                     {"dq", "dk", "dv"})
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 2.6 * peaks[0] and peaks[1] < 8 << 20


# ---- the schema and bad input ----------------------------------------------------------------

def test_schema_declares_the_mode_and_the_counter():
    s = get_schema(TYPE)
    assert s.mode_attr == "is_infer" and s.inplace == {"step_out": "step"}
    assert get_schema(TYPE + "_grad").no_export


def qkv_net(q_shape, k_shape, v_shape, dtype="float32"):
    net = mg.Net(seed=0)
    return net, [L.data(net, s, shape, dtype) for s, shape in
                 zip("qkv", (q_shape, k_shape, v_shape))]


@pytest.mark.parametrize("shapes,match", [
    (((2, 3, 5, 8), (2, 3, 7, 4), (2, 3, 7, 4)), r"input 'k' has head size 4 .* q and k must "
                                                 r"have the same head size"),
    (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 6, 8)), r"input 'v' has 6 positions .* every key needs"),
    (((2, 3, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)), r"input 'k' has heads \(axis 1\) 2"),
    (((2, 3, 5, 8), (4, 3, 7, 8), (4, 3, 7, 8)), r"input 'k' has batch size \(axis 0\) 4"),
])
def test_mismatched_inputs_are_named_when_the_layer_is_built(shapes, match):
    net, (q, k, v) = qkv_net(*shapes)
    with pytest.raises(mg.OpError, match=f"scaled_dot_product_attention: {match}"):
        L.scaled_dot_product_attention(net, q, k, v)
    assert not net.section("trunk") and not net.layers           # nothing half-built


@pytest.mark.parametrize("mask_shape,dtype,match", [
    ((5, 6), "bool", r"input 'attn_mask' with shape \(5, 6\) does not broadcast to .* its Tk "
                     r"axis has 6, the attention 7"),
    ((4, 7), "bool", r"its Tq axis has 4, the attention 5"),
    ((3, 3, 5, 7), "float32", r"its N axis has 3"),
    ((5, 7), "int64", r"input 'attn_mask' must be bool .* or a float mask of input 'q''s dtype "
                      r"float32, got dtype int64"),
    ((5, 7), "float64", r"got dtype float64"),
    ((1, 1, 1, 5, 7), "bool", r"must have rank 1 to 4"),
])
def test_a_bad_mask_is_named_when_the_layer_is_built(mask_shape, dtype, match):
    net, (q, k, v) = qkv_net((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8))
    mask = L.data(net, "mask", mask_shape, dtype)
    with pytest.raises(mg.OpError, match=match):
        L.scaled_dot_product_attention(net, q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kwargs,match", [
    ({"dropout_p": 1.0}, r"argument 'dropout_p' must be a finite number in \[0, 1\)"),
    ({"scale": 0.0}, r"argument 'scale' must be > 0"),
    ({"scale": -1.0}, r"argument 'scale' must be a finite number in \[0"),
    ({"is_causal": 1}, r"argument 'is_causal' must be True or False"),
])
def test_bad_arguments_are_named(kwargs, match):
    net, (q, k, v) = qkv_net((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8))
    with pytest.raises(ValueError, match=f"scaled_dot_product_attention: {match}"):
        L.scaled_dot_product_attention(net, q, k, v, **kwargs)


def test_a_rank_3_input_is_named():
    net, (q, k, v) = qkv_net((2, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8))
    with pytest.raises(ValueError, match=r"argument 'q' .* must be \(N, heads, T, d\) \(rank 4\)"):
        L.scaled_dot_product_attention(net, q, k, v)


def test_training_with_dropout_needs_the_step():
    scope = mg.Scope()
    q, k, v, out = (scope.new_var(s) for s in ("q", "k", "v", "out"))
    with pytest.raises(mg.OpError, match=r"input 'step' .* is required for dropout_p=0.5"):
        mg.Operator(TYPE, q=q, k=k, v=v, out=out, dropout_p=0.5)
