"""A small GPT on a GPU place against the CPU: on the fake PyCUDA driver (the real
launchers and .cu kernels, run by the emulator) and, marked gpu, on a real GPU: training
steps (attention with dropout, position table, tied logits, AdamW, clipping) give the
CPU's losses, and generation with the KV cache gives the CPU's tokens and equals a run
without it."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from kernel_emulator import fake_pycuda

import minigraph as mg
from minigraph import layers as L
from minigraph.generation import generate

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


@pytest.fixture(params=["fake", pytest.param("gpu", marks=pytest.mark.gpu)])
def gpu(request):
    """GPUPlace(0) on the fake driver, or on a real GPU (skipped without one)."""
    if request.param == "gpu":
        yield request.getfixturevalue("gpu_place")
        return
    cuda = fake_pycuda.FakeCuda(devices=1)
    with cuda.install():
        yield mg.GPUPlace(0)


def tiny_gpt(place, cache=None, dropout=0.0):
    net = mg.Net(place=place, seed=11)
    tok = L.data(net, "tok", (-1, -1), "int64")
    tgt = L.data(net, "tgt", (-1, -1), "int64")
    h = L.embedding(net, tok, 9, 8, name="wte")
    h = L.position_embedding(net, h, 12, kv_cache=cache, name="wpe")
    a = L.multi_head_attention(net, L.layer_norm(net, h, begin_norm_axis=2), 2, causal=True,
                               dropout=dropout, kv_cache=cache, name="b0")
    h = L.add(net, h, a)
    h = L.add(net, h, L.linear(net, L.gelu(net, L.linear(net, h, 16, name="fc")), 8,
                               name="proj"))
    logits = L.matmul(net, h, net.var("wte.w"), transpose_y=True)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.reshape(net, logits, (-1, 9)),
                                                    L.reshape(net, tgt, (-1,))))
    return net, tok, logits, loss


def test_training_gives_the_cpus_losses(gpu):
    seqs = np.random.default_rng(0).integers(0, 9, (3, 4, 7))
    runs = []
    for place in (mg.CPUPlace(), gpu):
        net, tok, logits, loss = tiny_gpt(place, dropout=0.2)
        mg.optimizer.AdamW(0.01, grad_clip=mg.optimizer.ClipGradByGlobalNorm(1.0)).minimize(
            net, loss)
        runs.append([float(net.train(feed={"tok": s[:, :-1], "tgt": s[:, 1:]},
                                     fetch=[loss])[0]) for s in seqs])
    np.testing.assert_allclose(runs[1], runs[0], rtol=2e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_cached_generation_gives_the_cpus_tokens(gpu, fused):
    """Also with the infer branch fused (fuse_fc: fused_fc with a residual and gelu, and
    the q, k and v products as a fused_fc_group with the layer_norm before them folded
    in), on both places."""
    prompt = np.random.default_rng(1).integers(0, 9, (2, 3))
    outs = []
    for place in (mg.CPUPlace(), gpu):
        cache = L.KVCache(12)
        net, tok, logits, _ = tiny_gpt(place, cache)
        if fused:
            notes = mg.passes.fuse_fc(net)
            assert {note.into for note in notes} == {"fused_fc", "fused_fc_group"}
            assert ("layer_norm", "fused_fc_group") in [note.ops for note in notes]
        outs.append(generate(net, tok, logits, prompt, 8, temperature=0, kv_cache=cache))
        outs.append(generate(net, tok, logits, prompt, 8, temperature=0, kv_cache=cache,
                             use_cache=False))
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])
