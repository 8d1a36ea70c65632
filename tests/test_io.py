"""Saving and loading persistables: round trips, mismatches, atomic writes, formats,
strict=False (contents a load refuses: test_io_contents.py)."""
from __future__ import annotations

import os
import stat
import warnings

import numpy as np
import pytest
from checkpoint_cases import rewrite, snapshot
from helpers import save_fails_mid_write

import minigraph as mg
from minigraph import io
from minigraph.examples.train_digits import build_net


def trained_net(seed, steps=3):
    """The digits net after a few Momentum steps on random data (every kind of
    persistable has a non-initial value: weights, estimates, counters, velocities)."""
    net, h = build_net(mg.CPUPlace(), seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        net.train(feed={"image": rng.random((16, 1, 8, 8), dtype=np.float32),
                        "label": rng.integers(0, 10, 16)}, fetch=[h["loss"]])
    return net, h


def test_round_trip_restores_every_persistable_bitwise(tmp_path):
    a, h = trained_net(seed=0)
    path = io.save(a, tmp_path / "ck.npz")
    kinds = {v.name for v in a.persistables()}
    assert {"conv1.w", "bn1.estimated_var", "bn1.num_batches", "momentum_0.fc1.w.velocity",
            "momentum_0.learning_rate"} <= kinds
    for seed in (0, 1):
        b, hb = build_net(mg.CPUPlace(), seed=seed)     # never run: nothing initialised yet
        assert sorted(io.load(b, path)) == sorted(kinds)
        for var in a.persistables():
            got = b.var(var.name)
            assert got.get().dtype == var.get().dtype and got.get().shape == var.get().shape
            assert got.get().tobytes() == var.get().tobytes(), var.name
        x = np.random.default_rng(5).random((7, 1, 8, 8), dtype=np.float32)
        (pa,) = a.infer(feed={"image": x}, fetch=[h["logits"]])
        (pb,) = b.infer(feed={"image": x}, fetch=[hb["logits"]])
        assert pa.tobytes() == pb.tobytes()         # the first run kept the loaded values


def test_save_initialises_a_fresh_net_and_uses_ordinary_permissions(tmp_path):
    net, _ = build_net(mg.CPUPlace(), seed=3)
    path = io.save(net, tmp_path / "fresh.npz")
    with np.load(path) as npz:
        assert str(npz["__format__"]) == "minigraph-persistables/2"
        assert int(npz["bn1.num_batches"]) == 0
        assert npz["bn1.num_batches"].shape == () and npz["bn1.num_batches"].dtype == np.int64
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["fresh.npz"]


def test_mismatches_are_reported_together_and_nothing_is_assigned(tmp_path):
    a, _ = trained_net(seed=0)
    good = io.save(a, tmp_path / "good.npz")

    def damage(arrays):
        del arrays["fc2.b"]
        arrays["ghost.w"] = np.zeros(3, np.float32)
        arrays["fc1.w"] = arrays["fc1.w"][:10]
        arrays["bn1.scale"] = arrays["bn1.scale"].astype(np.float64)

    bad = rewrite(good, tmp_path / "bad.npz", damage)
    b, _ = trained_net(seed=1, steps=1)
    before = snapshot(b)
    with pytest.raises(io.CheckpointError) as err:
        io.load(b, bad)
    msg = str(err.value)
    assert "4 problem(s)" in msg and "nothing was loaded" in msg
    assert "missing 'fc2.b'" in msg
    assert "unexpected 'ghost.w'" in msg
    assert "wrong shape for 'fc1.w'" in msg and "(256, 64)" in msg and "(10, 64)" in msg
    assert "wrong dtype for 'bn1.scale'" in msg and "float64" in msg
    after = snapshot(b)
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    a, _ = trained_net(seed=0, steps=1)
    path = io.save(a, tmp_path / "ck.npz")
    old = path.read_bytes()
    trained_net_b, _ = trained_net(seed=1, steps=1)

    save_fails_mid_write(monkeypatch, OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        io.save(trained_net_b, path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]
    monkeypatch.undo()

    def no_rename(src, dst):
        raise PermissionError("rename refused")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(PermissionError):
        io.save(trained_net_b, path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]


def test_a_missing_counter_means_already_trained_with_a_warning(tmp_path):
    a, _ = trained_net(seed=0)
    old = rewrite(io.save(a, tmp_path / "ck.npz"), tmp_path / "old.npz",
                  lambda arrays: [arrays.pop(k) for k in ("bn1.num_batches",
                                                           "bn2.num_batches")])
    b, h = build_net(mg.CPUPlace(), seed=1)
    with pytest.warns(UserWarning, match="bn1.num_batches, bn2.num_batches"):
        io.load(b, old)
    counter = b.var("bn1.num_batches").get()
    assert counter.shape == () and counter.dtype == np.int64 and int(counter) == 1
    # the next batch blends into the loaded estimate instead of replacing it
    loaded = b.var("bn1.estimated_mean").get().copy()
    rng = np.random.default_rng(9)
    _, batch_mean = b.train(feed={"image": rng.random((16, 1, 8, 8), dtype=np.float32),
                                  "label": rng.integers(0, 10, 16)},
                            fetch=[h["loss"], "bn1.batch_mean"])
    np.testing.assert_allclose(b.var("bn1.estimated_mean").get(),
                               0.9 * loaded + 0.1 * batch_mean, rtol=1e-5, atol=1e-6)
    assert int(b.var("bn1.num_batches").get()) == 2


def test_a_complete_checkpoint_loads_without_warnings(tmp_path):
    a, _ = trained_net(seed=0, steps=1)
    path = io.save(a, tmp_path / "ck.npz")
    b, _ = build_net(mg.CPUPlace(), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        io.load(b, path)
    assert int(b.var("bn2.num_batches").get()) == 1


def test_loading_sets_the_optimizer_learning_rate(tmp_path):
    a, _ = trained_net(seed=0, steps=1)
    a.optimizer.set_learning_rate(0.0125)
    path = io.save(a, tmp_path / "ck.npz")
    b, _ = build_net(mg.CPUPlace(), seed=0)
    io.load(b, path)
    assert b.optimizer.learning_rate == pytest.approx(0.0125, rel=1e-7)
    assert float(b.var("momentum_0.learning_rate").get()) == pytest.approx(0.0125, rel=1e-7)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("__format__"), "no '__format__' entry"),
    (lambda a: a.update(__format__=np.array("minigraph-persistables/3")),
     "version '3'.*newer minigraph"),
    (lambda a: a.update(__format__=np.array("minigraph-persistables/0")), "version '0'"),
    (lambda a: a.pop("__manifest__"), "'__manifest__' is missing"),
    (lambda a: a.update(__format__=np.array("something-else/1")), "unknown format"),
])
def test_bad_formats_are_clear_errors(tmp_path, change, message):
    a, _ = trained_net(seed=0, steps=1)
    path = rewrite(io.save(a, tmp_path / "ck.npz"), tmp_path / "bad.npz", change)
    b, _ = build_net(mg.CPUPlace(), seed=0)
    with pytest.raises(io.CheckpointError, match=message):
        io.load(b, path)


def test_files_that_are_not_checkpoints(tmp_path):
    net, _ = build_net(mg.CPUPlace(), seed=0)
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    with pytest.raises(io.CheckpointError, match="damaged minigraph checkpoint"):
        io.load(net, tmp_path / "junk.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(io.CheckpointError, match="single array"):
        io.load(net, tmp_path / "one.npy")
    with pytest.raises(FileNotFoundError):
        io.load(net, tmp_path / "absent.npz")


# ---- learning rates in checkpoints ---------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -0.5])
def test_a_bad_learning_rate_in_a_checkpoint_is_refused(tmp_path, bad):
    a, _ = trained_net(seed=0, steps=1)
    lr = a.optimizer.lr_var
    path = rewrite(io.save(a, tmp_path / "ck.npz"), tmp_path / "bad.npz",
                   lambda arrays: arrays.update({lr.name: np.array(bad, arrays[lr.name].dtype)}))
    b, _ = trained_net(seed=1, steps=1)
    before, rate = snapshot(b), b.optimizer.learning_rate
    for strict in (True, False):
        with pytest.raises(io.CheckpointError) as err:
            io.load(b, path, strict=strict, parts=io.PARTS)
        msg = str(err.value)
        assert f"learning rate {lr.name!r} holds" in msg and "finite number >= 0" in msg
        assert "nothing was loaded" in msg
    after = snapshot(b)
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)
    assert b.optimizer.learning_rate == rate


def test_a_zero_learning_rate_loads(tmp_path):
    a, _ = trained_net(seed=0, steps=1)
    lr = a.optimizer.lr_var
    path = rewrite(io.save(a, tmp_path / "ck.npz"), tmp_path / "zero.npz",
                   lambda arrays: arrays.update({lr.name: np.zeros((), arrays[lr.name].dtype)}))
    b, _ = build_net(mg.CPUPlace(), seed=0)
    io.load(b, path)
    assert b.optimizer.learning_rate == 0.0


# ---- strict=False ---------------------------------------------------------------------

def conv_bn_fc(train, seed=0):
    """image -> conv2d c1 -> batch_norm bn1 -> relu -> fc fc1; with train=True
    also a loss minimised by Momentum. (net, logits, loss or None)."""
    net = mg.Net(seed=seed)
    image = mg.layers.data(net, "image", shape=(-1, 1, 6, 6))
    h = mg.layers.conv2d(net, image, num_filters=4, filter_size=3, padding=1, name="c1")
    h = mg.layers.relu(net, mg.layers.batch_norm(net, h, name="bn1"))
    logits = mg.layers.fc(net, h, size=5, name="fc1")
    loss = None
    if train:
        label = mg.layers.data(net, "label", shape=(-1,), dtype="int64")
        loss = mg.layers.mean(net, mg.layers.softmax_with_cross_entropy(net, logits, label))
        mg.optimizer.Momentum(learning_rate=0.1, momentum=0.9).minimize(net, loss)
    return net, logits, loss


def test_an_inference_twin_loads_the_training_checkpoint_with_strict_false(tmp_path):
    net, logits, loss = conv_bn_fc(train=True)
    rng = np.random.default_rng(0)
    for _ in range(4):
        net.train(feed={"image": rng.standard_normal((8, 1, 6, 6)).astype(np.float32),
                        "label": rng.integers(0, 5, 8)}, fetch=[loss])
    path = io.save(net, tmp_path / "train.npz")
    twin, twin_logits, _ = conv_bn_fc(train=False, seed=7)
    twin_names = {v.name for v in twin.persistables()}
    with pytest.raises(io.CheckpointError, match="unexpected 'momentum_0.c1.w.velocity'"):
        io.load(twin, path)                     # strict: the optimizer state does not fit
    extra = [v.name for v in net.persistables() if v.name not in twin_names]
    assert {"momentum_0.c1.w.velocity", net.optimizer.lr_var.name} <= set(extra)
    assert io.load(twin, path, strict=False) == ([], [])    # optimizer state is not selected
    missing, unexpected = io.load(twin, path, strict=False, parts=io.PARTS)
    assert missing == [] and sorted(unexpected) == sorted(extra)
    assert int(twin.var("bn1.num_batches").get()) == 4
    x = rng.standard_normal((5, 1, 6, 6)).astype(np.float32)
    (want,) = net.infer(feed={"image": x}, fetch=[logits])
    (got,) = twin.infer(feed={"image": x}, fetch=[twin_logits])
    assert got.tobytes() == want.tobytes()


def test_strict_false_lists_what_is_missing_and_leaves_it(tmp_path):
    twin, _, _ = conv_bn_fc(train=False)
    path = rewrite(io.save(twin, tmp_path / "ck.npz"), tmp_path / "part.npz",
                   lambda arrays: [arrays.pop(k) for k in ("fc1.w", "fc1.b")])
    other, _, _ = conv_bn_fc(train=False, seed=3)
    kept = other.var("fc1.w").get().copy()
    assert io.load(other, path, strict=False) == (["fc1.w", "fc1.b"], [])
    assert np.array_equal(other.var("fc1.w").get(), kept)
    assert np.array_equal(other.var("c1.w").get(), twin.var("c1.w").get())


def test_strict_false_still_refuses_a_shape_or_dtype_mismatch(tmp_path):
    twin, _, _ = conv_bn_fc(train=False)
    good = io.save(twin, tmp_path / "ck.npz")
    other, _, _ = conv_bn_fc(train=False, seed=3)
    before = snapshot(other)
    for change, message in (
            (lambda a: a.update({"fc1.w": a["fc1.w"][:10]}), "wrong shape for 'fc1.w'"),
            (lambda a: a.update({"bn1.scale": a["bn1.scale"].astype(np.float64)}),
             "wrong dtype for 'bn1.scale'")):
        bad = rewrite(good, tmp_path / "bad.npz", change)
        with pytest.raises(io.CheckpointError, match=message):
            io.load(other, bad, strict=False)
    after = snapshot(other)
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)


def test_strict_false_defaults_a_missing_counter_only_for_a_loaded_layer(tmp_path):
    twin, _, _ = conv_bn_fc(train=False)
    path = rewrite(io.save(twin, tmp_path / "ck.npz"), tmp_path / "old.npz",
                   lambda arrays: arrays.pop("bn1.num_batches"))
    other, _, _ = conv_bn_fc(train=False, seed=3)
    with pytest.warns(UserWarning, match="bn1.num_batches"):
        assert io.load(other, path, strict=False) == ([], [])
    assert int(other.var("bn1.num_batches").get()) == 1
    no_bn = rewrite(path, tmp_path / "no_bn.npz",
                    lambda arrays: [arrays.pop(k) for k in list(arrays) if k.startswith("bn1.")])
    third, _, _ = conv_bn_fc(train=False, seed=4)
    missing, _ = io.load(third, no_bn, strict=False)
    assert "bn1.num_batches" in missing and int(third.var("bn1.num_batches").get()) == 0
