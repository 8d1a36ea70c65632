"""Checkpoints by part (minigraph.checkpoint_match): fine-tuning with a new optimizer,
parameters-only files, selections a file cannot satisfy, optimizer state named under
its optimizer, GradientMerge's k_steps, names a net refuses, and version 1 files
(load_parameters: test_load_parameters.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from checkpoint_cases import LABELS, build, feed, same, snapshot, trained

import minigraph as mg
from minigraph import io
from minigraph import layers as L

# ---- fine-tuning ------------------------------------------------------------------------

def test_fine_tuning_keeps_the_new_optimizer_and_the_loss_falls(tmp_path):
    """Train, save; build a new net with a new head, minimise it with a new Adam, load
    the parameters only: the rate and the moments are the new optimizer's (the old
    run's `learning_rate_0` and `n1.scale.moment1` used to replace them), the body
    is the saved one, and fine-tuning trains."""
    old, path = trained(tmp_path)
    assert old.optimizer.learning_rate == 0.01
    net, loss = build(head="head2", classes=3, opt=mg.optimizer.Adam(1e-3))
    fresh = snapshot(net)
    state = [n for n in fresh if n.endswith((".moment1", ".moment2", "_pow"))]
    missing, unexpected = io.load(net, path, strict=False)
    assert net.optimizer.learning_rate == 1e-3
    assert same(snapshot(net), fresh, state + [net.optimizer.lr_var.name, "head2.w", "head2.b"])
    assert missing == ["head2.w", "head2.b"] and unexpected == ["head.w", "head.b"]
    saved = snapshot(old)
    body = ["c1.w", "c1.b", "bn1.scale", "bn1.bias", "bn1.estimated_mean", "bn1.estimated_var",
            "bn1.num_batches", "fc1.w", "fc1.b"]
    assert same(snapshot(net), saved, body)
    assert "adam_0.fc1.w.moment1" in state and net.optimizer.lr_var.name == "adam_0.learning_rate"
    assert float(net.var("adam_0.fc1.w.beta1_pow").get()) == 1.0
    labels = LABELS.astype(np.int64) * 2           # the new head's task: classes 0 and 2
    first = float(net.train(feed=feed(labels), fetch=[loss])[0])
    for _ in range(30):
        last = float(net.train(feed=feed(labels), fetch=[loss])[0])
    assert last < 0.7 * first
    assert net.optimizer.learning_rate == 1e-3


def test_freezing_the_loaded_body_trains_only_the_new_head(tmp_path):
    _, path = trained(tmp_path)
    net, loss = build(head="head2", opt=mg.optimizer.Momentum(0.1, weight_decay=0.01))
    io.load(net, path, parts=["parameters", "estimates"], strict=False)
    for p in net.parameters():
        if not p.name.startswith("head2."):
            p.trainable = False
    before = snapshot(net)
    for _ in range(3):
        net.train(feed=feed(), fetch=[loss])
    after = snapshot(net)
    assert same(after, before, ["c1.w", "c1.b", "bn1.scale", "bn1.bias", "fc1.w", "fc1.b"])
    assert not np.array_equal(after["head2.w"], before["head2.w"])


def test_a_strict_load_of_the_same_net_resumes_exactly(tmp_path):
    a, path = trained(tmp_path, steps=3)
    b, _ = build(opt=mg.optimizer.Adam(0.5), seed=9)       # another rate: the file's wins
    assert sorted(io.load(b, path)) == sorted(v.name for v in b.persistables())
    assert b.optimizer.learning_rate == 0.01
    for _ in range(2):
        a.train(feed=feed())
        b.train(feed=feed())
    assert same(snapshot(a), snapshot(b), [v.name for v in a.persistables()])


def test_the_optimizer_state_is_restored_when_asked_for(tmp_path):
    a, path = trained(tmp_path, steps=3)
    b, _ = build(head="other", opt=mg.optimizer.Adam(0.5))
    missing, unexpected = io.load(b, path, strict=False, parts={"optimizer"})
    assert b.optimizer.learning_rate == 0.01
    assert "adam_0.other.w.moment1" in missing and "adam_0.head.w.moment1" in unexpected
    assert np.array_equal(b.var("adam_0.fc1.w.moment1").get(), a.var("adam_0.fc1.w.moment1").get())
    assert not np.array_equal(b.var("fc1.w").get(), a.var("fc1.w").get())   # not selected


# ---- parts ------------------------------------------------------------------------------

def test_a_parameters_only_file_holds_the_parameters_and_says_so(tmp_path):
    net, path = trained(tmp_path)
    small = io.save(net, tmp_path / "params.npz", parts={"parameters"})
    with np.load(small) as npz:
        names = set(npz.files) - {"__format__", "__manifest__"}
        manifest = json.loads(str(npz["__manifest__"]))
    params = {p.name for p in net.parameters()}
    assert names == params and manifest == {"parts": {"parameters": sorted(
        params, key=[v.name for v in net.persistables()].index)}, "optimizer": None}
    assert small.stat().st_size < 0.5 * path.stat().st_size
    with np.load(path) as npz:
        full = json.loads(str(npz["__manifest__"]))
    assert full["optimizer"] == {"type": "Adam", "name": "adam_0"}
    assert set(full["parts"]) == {"parameters", "estimates", "optimizer"}


def test_a_selection_the_file_cannot_satisfy_names_what_is_missing(tmp_path):
    net, _ = trained(tmp_path)
    small = io.save(net, tmp_path / "params.npz", parts={"parameters"})
    other, _ = build(opt=mg.optimizer.Adam(0.02), seed=3)
    before = snapshot(other)
    with pytest.raises(io.CheckpointError, match=r"holds no estimates or optimizer \(it holds "
                                                 r"parameters\), so it cannot set "
                                                 r"'bn1.estimated_mean'.*load it with "
                                                 r"parts=\['parameters'\]"):
        io.load(other, small)
    for strict in (True, False):
        with pytest.raises(io.CheckpointError, match="holds no optimizer .* cannot set "
                                                     "'adam_0.learning_rate'"):
            io.load(other, small, strict=strict, parts=["parameters", "optimizer"])
    assert same(snapshot(other), before, before)
    assert sorted(io.load(other, small, parts=["parameters"])) == sorted(
        p.name for p in other.parameters())
    assert io.load(other, small, strict=False) == (["bn1.estimated_mean", "bn1.estimated_var",
                                                    "bn1.num_batches"], [])


@pytest.mark.parametrize("parts, error, message", [
    ("parameters", TypeError, "parts must be None or a collection of part names"),
    (["weights"], ValueError, "unknown part 'weights'; the parts are 'parameters', "
                              "'estimates', 'optimizer'"),
    ([], ValueError, "parts is empty"),
    (3, TypeError, "parts must be None"),
])
def test_parts_are_checked(tmp_path, parts, error, message):
    net, path = trained(tmp_path, steps=1)
    with pytest.raises(error, match=message):
        io.load(net, path, parts=parts)
    with pytest.raises(error, match=message):
        io.save(net, tmp_path / "x.npz", parts=parts)
    assert not (tmp_path / "x.npz").exists()


# ---- optimizer state under its optimizer's name ----------------------------------------

def test_state_is_named_under_its_optimizer_and_the_names_are_reserved():
    net, _ = build()
    L.fc(net, net.data_vars["image"], 2, name="adam_0")     # a layer took the name first
    mg.optimizer.Adam(0.01).minimize(net, net.loss or build_loss(net))
    names = [v.name for v in net.persistables()]
    assert "adam_1.learning_rate" in names and "adam_1.fc1.w.moment2" in names
    assert not any(n.startswith("learning_rate") for n in names)
    with pytest.raises(ValueError, match="'adam_1.extra' is reserved: the names under 'adam_1.' "
                                         "are the state of the Adam optimizer 'adam_1'"):
        net.create_parameter("adam_1.extra", (2,), "float32", mg.initializer.Constant(0.0),
                             trainable=False)


def build_loss(net):
    label = net.data_vars["label"]
    return L.mean(net, L.softmax_with_cross_entropy(net, net.var("head.out"), label))


def test_another_optimizers_checkpoint_says_which_wrote_it(tmp_path):
    _, path = trained(tmp_path, opt=mg.optimizer.Momentum(0.1))
    net, _ = build(opt=mg.optimizer.Adam(0.01))
    with pytest.raises(io.CheckpointError, match="written by Momentum 'momentum_0'; this net's "
                                                 "optimizer is Adam 'adam_0'"):
        io.load(net, path)
    assert io.load(net, path, strict=False) == ([], [])      # parameters and estimates


def test_a_gradient_merge_checkpoint_of_another_k_is_refused(tmp_path):
    a, path = trained(tmp_path, steps=3,
                      opt=mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), k_steps=4))
    b, _ = build(opt=mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), k_steps=2))
    before = snapshot(b)
    with pytest.raises(io.CheckpointError, match="accumulated over k_steps=4, this net's "
                                                 "accumulates over k_steps=2"):
        io.load(b, path)
    with pytest.raises(io.CheckpointError, match="accumulated over k_steps=4"):
        io.load(b, path, strict=False, parts=io.PARTS)
    assert same(snapshot(b), before, before)
    assert int(a.var("gradient_merge_0.step").get()) == 3
    with np.load(path) as npz:
        desc = json.loads(str(npz["__manifest__"]))["optimizer"]
    assert desc == {"type": "GradientMerge", "name": "gradient_merge_0", "k_steps": 4,
                    "avg": True, "inner": {"type": "SGD", "name": "sgd_0"}}
    io.load(b, path, parts=["parameters", "estimates"])        # the weights still load
    assert np.array_equal(b.var("fc1.w").get(), a.var("fc1.w").get())
    c, _ = build(opt=mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), k_steps=4))
    io.load(c, path)
    assert int(c.var("gradient_merge_0.step").get()) == 3


# ---- names a net refuses -----------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda net, x: L.fc(net, x, 3, param_attr="fc1.w@GRAD"), "'@GRAD' marks the gradients"),
    (lambda net, x: L.fc(net, x, 3, name="a@GRAD"), "'@GRAD' marks the gradients"),
    (lambda net, x: L.data(net, "x@GRAD@1", shape=(-1, 3)), "'@GRAD' marks the gradients"),
    (lambda net, x: L.fc(net, x, 3, param_attr="__format__"), "names of the form '__name__'"),
    (lambda net, x: L.data(net, "__manifest__", shape=(-1, 3)), ".*could not be saved"),
])
def test_reserved_names_are_refused_when_created(make, message):
    """`fc1.w@GRAD` used to be accepted, and backward then wrote fc1.w's gradient into it."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4))
    names = {v.name for v in net.scope.vars.values()}
    with pytest.raises(ValueError, match="is reserved: " + message):
        make(net, x)
    assert {v.name for v in net.scope.vars.values()} == names


def test_a_parameter_named_like_a_gradient_no_longer_receives_one():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4))
    h = L.fc(net, x, 3, name="fc1")
    with pytest.raises(ValueError, match="reserved"):
        L.fc(net, h, 2, param_attr=mg.ParamAttr(name="fc1.w@GRAD"))


# ---- version 1 files (written before optimizer state was named under its optimizer) ----

FORMAT1 = __import__("pathlib").Path(__file__).parent / "data" / "format1"


def format1_nets():
    import importlib.util

    spec = importlib.util.spec_from_file_location("format1_nets", FORMAT1 / "nets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def legacy(net):
    """{name now: version 1 name} of every persistable of `net`."""
    renames = {new: old for opt in (net.optimizer, getattr(net.optimizer, "inner", None))
               if opt is not None for new, old in opt.legacy_names.items()}
    return {v.name: renames.get(v.name, v.name) for v in net.persistables()}


def same_but_rounding(got, want, name):
    """`got` equals `want`, a value the files hold from the machine that wrote them, to
    float32 rounding: another instruction set's kernels, or another pick of a kernel
    choice, round some sums differently (an AVX2 machine's against the AVX-512 one's
    that wrote them: a few units in the last place)."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("make, name", [("momentum_net", "momentum"), ("merge_net", "merge")])
def test_a_version_1_checkpoint_resumes_exactly(make, name, monkeypatch):
    """The files were written by minigraph with format 1 (tests/data/format1/nets.py):
    every array lands on its variable under today's name, bit for bit, and one more step
    gives what that minigraph's next step gave, to rounding (on the native kernels the
    files were written with: MINIGRAPH_NATIVE=0's numpy kernels round more differently)."""
    monkeypatch.setenv("MINIGRAPH_NATIVE", "1")
    nets = format1_nets()
    net = getattr(nets, make)()[0]
    old_names = legacy(net)
    assert old_names["fc1.w"] == "fc1.w" and any(
        o.startswith("learning_rate_0") for n, o in old_names.items() if n != o)
    assert sorted(io.load(net, FORMAT1 / f"{name}.npz")) == sorted(old_names)
    with np.load(FORMAT1 / f"{name}.npz") as npz:
        assert str(npz["__format__"]) == "minigraph-persistables/1"
        for new, old in old_names.items():
            assert net.var(new).get().tobytes() == npz[old].tobytes(), new
    net.train(feed=nets.feed(3))
    with np.load(FORMAT1 / f"{name}_next.npz") as npz:
        for new, old in old_names.items():
            if name == "merge" and old in ("c1.b.merged_grad", "c1.b.moment1",
                                           "c1.b.moment2"):
                continue            # of rounding noise (below)
            if name == "merge" and old == "c1.b":
                # c1's bias feeds a batch norm: its gradient is zero but for rounding,
                # which Adam scales to a step of up to its learning rate (0.01), either way
                assert np.abs(net.var(new).get() - npz[old]).max() < 0.03, new
                continue
            same_but_rounding(net.var(new).get(), npz[old], new)
    assert set(io.read_checkpoint(FORMAT1 / f"{name}.npz")) == set(old_names.values())


def test_a_version_1_checkpoint_fine_tunes_without_touching_the_new_optimizer():
    """The report's case on an old file: learning_rate_0 and the moments stay the new
    optimizer's; the old optimizer's names are neither loaded nor unexpected."""
    nets = format1_nets()
    net = mg.Net(seed=1)
    _, loss = nets.body(net)
    mg.optimizer.Adam(1e-3).minimize(net, loss)
    state = {n: v for n, v in snapshot(net).items() if n.startswith("adam_0.")}
    assert io.load(net, FORMAT1 / "merge.npz", strict=False) == ([], [])
    assert same(snapshot(net), state, state) and net.optimizer.learning_rate == 1e-3
    with np.load(FORMAT1 / "merge.npz") as npz:
        assert np.array_equal(net.var("fc1.w").get(), npz["fc1.w"])
    with pytest.raises(io.CheckpointError, match="unexpected 'fc1.w.merged_grad'"):
        io.load(net, FORMAT1 / "merge.npz")
    other = nets.momentum_net()[0]
    with pytest.raises(io.CheckpointError, match="missing 'momentum_0.fc1.w.velocity'"):
        io.load(other, FORMAT1 / "merge.npz", parts=["optimizer"])


def test_a_version_1_inference_model_loads(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("MINIGRAPH_NATIVE", "1")        # as the output was written

    nets = format1_nets()
    d = shutil.copytree(FORMAT1 / "model", tmp_path / "model")
    assert sorted(p.name for p in d.iterdir()) == ["model.json", "params.npz"]
    (got,) = mg.io.load_inference(d).infer(feed={"image": nets.feed(9)["image"]})
    same_but_rounding(got, np.load(FORMAT1 / "model_out.npy"), "the model's output")
    net, logits = nets.momentum_net()
    mg.io.save_inference(net, d, feeds=["image"], fetches=[logits])    # replaces version 1
    names = sorted(p.name for p in d.iterdir())
    assert "params.npz" not in names and len(names) == 2
