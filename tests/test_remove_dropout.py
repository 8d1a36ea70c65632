"""remove_dropout: an inference net's dropouts removed, their readers reading x."""
import importlib

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)


def mlp():
    """fc-relu-dropout, fc-relu-dropout (read by an fc, as a residual by an add, and in
    a list by a concat), fc; trained a few steps."""
    net = mg.Net(seed=0)
    x, y = L.data(net, "x", shape=(-1, 6)), L.data(net, "y", shape=(-1,), dtype="int64")
    h = L.dropout(net, L.relu(net, L.fc(net, x, 8, name="f1")), 0.5, name="d1")
    g = L.dropout(net, L.relu(net, L.fc(net, h, 8, name="f2")), 0.25, name="d2")
    both = L.concat(net, [L.add(net, g, L.fc(net, g, 8, name="f3")), g], axis=1)
    logits = L.fc(net, both, 4, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, y))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    for _ in range(3):
        net.train(feed={"x": rng.standard_normal((5, 6)).astype(np.float32),
                        "y": rng.integers(0, 4, 5)})
    return net, logits


def test_optimize_for_inference_removes_every_dropout_with_the_same_values():
    net, logits = mlp()
    fast = mg.passes.optimize_for_inference(net)
    types = [op.type for op in fast.section("trunk")]
    assert "dropout" not in types
    assert len(fast.reports["remove_dropout"]) == 2
    assert fast.applied == ("fold_batch_norm", "remove_dropout", "fuse_conv2d", "fuse_fc",
                            "fuse_separable_conv2d")
    x = rng.standard_normal((7, 6)).astype(np.float32)
    (want,) = net.infer(feed={"x": x}, fetch=[logits])
    for _ in range(3):                                   # checked, then bound runs
        (got,) = fast.infer(feed={"x": x}, fetch=[logits.name])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_readers_read_the_dropouts_input_lists_and_residuals_too():
    net, logits = mlp()
    folded = mg.passes.fold_batch_norm(net)
    before = {op.outputs["out"].name: op.inputs["x"].name
              for op in folded.section("trunk") if op.type == "dropout"}
    removed = mg.passes.remove_dropout(folded, verbose=True)
    assert sorted(removed) == sorted(before)
    read = {v.name for op in folded.section("trunk") for v in op.input_vars()}
    assert not read & set(before) and read >= set(before.values())
    add = next(op for op in folded.section("trunk") if op.type == "add")
    assert add.inputs["x"].name == before[removed[1]]   # the residual: the second's x
    assert add.layer is not None
    concat = next(op for op in folded.section("trunk") if op.type == "concat")
    assert concat.inputs["x"][1].name == before[removed[1]]


def test_a_dropout_fetched_by_default_stays():
    net, logits = mlp()
    folded = mg.passes.fold_batch_norm(net, fetches=[logits, "d1.out"])
    removed = mg.passes.remove_dropout(folded)
    assert len(removed) == 1
    assert [op.type for op in folded.section("trunk")].count("dropout") == 1
    x = rng.standard_normal((3, 6)).astype(np.float32)
    for got, want in zip(folded.infer(feed={"x": x}),
                         net.infer(feed={"x": x}, fetch=[logits, "d1.out"])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_reader_writing_the_output_in_place_keeps_the_dropout(monkeypatch):
    """A reader with a declared in-place pair on the dropout's out would write its x."""
    pass_module = importlib.import_module("minigraph.passes.remove_dropout")

    net, logits = mlp()
    folded = mg.passes.fold_batch_norm(net)
    monkeypatch.setattr(pass_module, "_writes_in_place", lambda op, v: op.type == "mul")
    assert mg.passes.remove_dropout(folded) == []
    assert [op.type for op in folded.section("trunk")].count("dropout") == 2


def test_refuses_a_training_net_and_runs_once():
    net, _ = mlp()
    with pytest.raises(ValueError, match="remove_dropout: needs an infer-only net"):
        mg.passes.remove_dropout(net)
    with pytest.raises(TypeError, match="remove_dropout"):
        mg.passes.remove_dropout("net")
    fast = mg.passes.optimize_for_inference(net)
    with pytest.raises(ValueError, match="remove_dropout: already applied"):
        mg.passes.remove_dropout(fast)
