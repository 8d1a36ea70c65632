"""examples/train_gpt.py and `minigraph demo --model gpt` on a tiny configuration: the
text and its split, the windows, the unigram baseline, the parameter groups, the recipe
(warm-up, cosine, clipping, accumulation), a short training that reports every epoch,
samples with the KV cache and writes the layer view; bad options exit 2."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import minigraph as mg
from minigraph import cli
from minigraph.examples import train_gpt as G

TINY = G.Config(layers=1, heads=2, width=16, context=16, batch_size=4, epochs=2,
                steps_per_epoch=3, eval_windows=8, sample_chars=8, warmup=1)


def test_the_text_ships_with_python_and_splits_without_overlap():
    text = G.load_text()
    vocab = G.Vocab(text)
    assert len(text) > 400_000 and 60 < len(vocab) < 200
    ids = vocab.encode(text[:500])
    assert vocab.decode(ids) == text[:500] and ids.dtype == np.int64
    train, held = G.split(vocab.encode(text))
    assert len(held) == len(text) - len(train) and abs(len(held) / len(text) - 0.1) < 1e-3
    windows = G.windows(np.arange(50), 8)
    assert len(windows) == 6
    np.testing.assert_array_equal(windows.arrays["targets"][0], np.arange(1, 9))
    np.testing.assert_array_equal(windows.arrays["tokens"][1], np.arange(8, 16))


def test_the_unigram_baseline_is_the_cross_entropy_of_the_frequencies():
    train, held = np.array([0, 0, 0, 1]), np.array([0, 1, 2])
    p = np.array([4, 2, 1]) / 7                          # counts + 1
    assert G.unigram_baseline(train, held, 3) == pytest.approx(-np.log(p).mean())


def test_the_groups_decay_only_the_linear_weights():
    net, h = G.build_gpt(20, TINY)
    decay, no_decay = G.param_groups(net, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {p.name for p in decay["params"]}
    assert "h0.fc.w" in names and "h0.attn.q.w" in names and "h0.attn.out.w" in names
    assert not names & {"wte.w", "wpe.w", "h0.ln1.scale", "h0.fc.b", "ln_f.bias"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(net.parameters())


def test_the_logits_are_tied_to_the_embedding_table():
    net, h = G.build_gpt(20, TINY)
    assert [p.name for p in net.parameters()].count("wte.w") == 1
    assert h["logits"].shape == (-1, -1, 20)


def test_the_schedule_warms_up_then_decays():
    cfg = dataclasses.replace(TINY, warmup=3, accumulate=2)
    opt = G.make_optimizer(cfg, 10)
    assert isinstance(opt, mg.optimizer.GradientMerge) and opt.k_steps == 2
    schedule = opt.inner.schedule
    rates = [schedule.value(t) for t in range(10)]
    assert rates[:3] == pytest.approx([cfg.learning_rate * k / 3 for k in (1, 2, 3)])
    assert rates[3] == pytest.approx(cfg.learning_rate) and rates[-1] < rates[4]
    assert opt.inner.grad_clip.max_norm == cfg.clip


def test_a_short_training_reports_samples_and_draws(tmp_path, capsys):
    history = G.train(TINY, tmp_path, progress=False)
    out = capsys.readouterr().out
    assert "unigram baseline" in out and out.count("held-out loss") == 2
    assert out.count("sample: ") == 2
    assert len(history["train_loss"]) == len(history["held_out_loss"]) == 2
    assert all(len(s) == len(G.PROMPT) + TINY.sample_chars for s in history["samples"])
    assert history["samples"][0].startswith(G.PROMPT)
    assert history["files"][0].name in ("gpt.svg", "gpt.dot") and history["files"][0].exists()
    assert np.isfinite(history["held_out_loss"]).all()


def test_the_demo_command_runs_the_gpt(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(G, "DEMO", dataclasses.replace(TINY, epochs=1))
    rc = cli.main(["demo", "--model", "gpt", "--epochs", "1", "--out", str(tmp_path),
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "the unigram baseline" in out and "held-out loss" in out
    assert (tmp_path / "gpt.svg").exists() or (tmp_path / "gpt.dot").exists()


def test_the_example_checks_its_arguments(capsys):
    assert G.main(["--context", "1"]) == 2
    assert "argument --context: must be an integer >= 2" in capsys.readouterr().err
