"""The inference model directory's writes: a save that fails between its files
leaves the previous model, a save removes the old params and a dead save's
leftovers (or completes when it cannot), a load overtaken by a save reads the new
model."""
from __future__ import annotations

import os

import pytest
from inference_models import batch, params_path, save_trained, trained

import minigraph as mg


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_trained(tmp_path_factory.mktemp("m"))


def outputs(d, x=None):
    (y,) = mg.io.load_inference(d).infer(feed={"image": batch() if x is None else x})
    return y


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_save_failing_between_its_files_leaves_the_previous_model(saved, tmp_path,
                                                                    monkeypatch, error):
    """params.npz used to be replaced before model.json: a save that failed (a full disk,
    a kill) in between left the previous, good model unloadable."""
    from minigraph.io import inference_model

    net, h, _ = saved
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])
    want = outputs(d)
    other, oh = trained(steps=2, seed=7)
    new = outputs(mg.io.save_inference(other, tmp_path / "n", feeds=["image"],
                                       fetches=[oh["logits"]]))
    real = inference_model.atomic_write
    for fail_at in (1, 2):
        calls = []

        def failing(path, write, fail_at=fail_at, calls=calls):
            calls.append(path)
            if len(calls) == fail_at:
                write(open(os.devnull, "wb"))       # a part of the work was done
                raise error
            return real(path, write)

        monkeypatch.setattr(inference_model, "atomic_write", failing)
        with pytest.raises(type(error)):
            mg.io.save_inference(other, d, feeds=["image"], fetches=[oh["logits"]])
        monkeypatch.undo()
        assert outputs(d).tobytes() == want.tobytes(), f"failed at write {fail_at}"
    mg.io.save_inference(other, d, feeds=["image"], fetches=[oh["logits"]])
    assert outputs(d).tobytes() == new.tobytes()


def test_a_save_replaces_the_old_params_and_a_dead_saves_leftovers(saved, tmp_path):
    net, h, _ = saved
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])
    old = params_path(d)
    other, oh = trained(steps=2, seed=7)
    fresh = d / "params-0123456789abcdef.npz"       # a save running now wrote it
    stale = d / "params-fedcba9876543210.npz"       # a save killed long ago left it
    for leftover in (fresh, stale):
        leftover.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    mg.io.save_inference(other, d, feeds=["image"], fetches=[oh["logits"]])
    names = sorted(p.name for p in d.iterdir())
    assert old.name not in names and stale.name not in names
    assert names == sorted(["model.json", params_path(d).name, fresh.name])


def test_a_save_whose_old_params_cannot_be_removed_still_completes(saved, tmp_path,
                                                                  monkeypatch):
    net, h, _ = saved
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])
    other, oh = trained(steps=2, seed=7)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "refused", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    mg.io.save_inference(other, d, feeds=["image"], fetches=[oh["logits"]])
    monkeypatch.undo()
    (want,) = other.infer(feed={"image": batch()}, fetch=[oh["logits"]])
    assert outputs(d).tobytes() == want.tobytes()


def test_a_load_overtaken_by_a_save_reads_the_new_model(saved, tmp_path, monkeypatch):
    from minigraph.io import inference_model

    net, h, _ = saved
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])
    other, oh = trained(steps=2, seed=7)
    real = inference_model.read_model
    reads = []

    def then_a_save(dirname, what):
        model = real(dirname, what)
        if what.startswith("load_inference"):
            reads.append(model)
            if len(reads) == 1:     # between reading model.json and opening its params
                mg.io.save_inference(other, d, feeds=["image"], fetches=[oh["logits"]])
        return model

    monkeypatch.setattr(inference_model, "read_model", then_a_save)
    got = outputs(d)
    monkeypatch.undo()
    (want,) = other.infer(feed={"image": batch()}, fetch=[oh["logits"]])
    assert len(reads) == 2 and got.tobytes() == want.tobytes()
