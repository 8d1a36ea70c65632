"""Checkpoint contents a load refuses, naming the entry and changing nothing: a
schedule's negative step, an impossible plateau state, a negative gradient-merge
counter, non-finite or impossible values; a plateau's infinite best, which is
possible, round trips; load and save check their arguments."""
from __future__ import annotations

import os

import numpy as np
import pytest
from checkpoint_cases import rewrite, snapshot

import minigraph as mg
from minigraph import io

# ---- contents that are impossible or not finite -------------------------------------

def schedule_net(schedule, gradient_merge=False, seed=0):
    """A one-layer net trained one step with a scheduled SGD (GradientMerge round it)."""
    net = mg.Net(seed=seed)
    x = mg.layers.data(net, "x", shape=(-1, 4))
    lbl = mg.layers.data(net, "label", shape=(-1,), dtype="int64")
    h = mg.layers.batch_norm(net, mg.layers.fc(net, x, 5, name="fc"), name="bn")
    loss = mg.layers.mean(net, mg.layers.softmax_with_cross_entropy(net, h, lbl))
    opt = mg.optimizer.SGD(schedule)
    if gradient_merge:
        opt = mg.optimizer.GradientMerge(opt, 2)
    opt.minimize(net, loss)
    rng = np.random.default_rng(seed)
    net.train(feed={"x": rng.standard_normal((6, 4)).astype(np.float32),
                    "label": rng.integers(0, 5, 6)})
    return net


def refused(tmp_path, net, name, value, *messages):
    """Save `net`, put `value` into entry `name`, load into a twin: a CheckpointError
    naming `name` (and `messages`), and the twin unchanged."""
    path = rewrite(io.save(net, tmp_path / "ck.npz"), tmp_path / "bad.npz",
                   lambda arrays: arrays.update({name: np.asarray(value, arrays[name].dtype)}))
    twin = net
    before = snapshot(twin)
    for strict in (True, False):
        with pytest.raises(io.CheckpointError) as err:
            io.load(twin, path, strict=strict, parts=io.PARTS)
        msg = str(err.value)
        assert repr(name) in msg and "nothing was loaded" in msg, msg
        for m in messages:
            assert m in msg, msg
    after = snapshot(twin)
    assert all(after[k].tobytes() == before[k].tobytes() for k in before)
    return msg


def test_a_negative_schedule_step_is_refused(tmp_path):
    """learning_rate_0.step = -100 with StepDecay(0.01, 2) meant a rate of about 1e48."""
    net = schedule_net(mg.optimizer.lr.StepDecay(0.01, 2))
    refused(tmp_path, net, "sgd_0.learning_rate.step", -100, ">= 0")


@pytest.mark.parametrize("schedule", [
    lambda: mg.optimizer.lr.CosineDecay(0.1, 10), lambda: mg.optimizer.lr.ExponentialDecay(0.1, 0.9),
    lambda: mg.optimizer.lr.MultiStepDecay(0.1, [2, 4]),
    lambda: mg.optimizer.lr.OneCycleLR(0.1, 20),
    lambda: mg.optimizer.lr.LinearWarmup(0.1, 3, 0.0, 0.1)])
def test_every_schedule_step_is_checked(tmp_path, schedule):
    refused(tmp_path, schedule_net(schedule()), "sgd_0.learning_rate.step", -1, ">= 0")


@pytest.mark.parametrize("state, message", [
    ([2, 0.5, 0, 0, 3], "0 or 1"), ([1, np.nan, 0, 0, 3], "finite"),
    ([1, 0.5, -1, 0, 3], "bad steps"), ([1, 0.5, 0.5, 0, 3], "bad steps"),
    ([1, 0.5, 0, -2, 3], "cooldown"), ([1, 0.5, 0, 0, -3], "steps taken"),
    ([1, 0.5, 0, 99, 3], "cooldown")])
def test_an_impossible_plateau_state_is_refused(tmp_path, state, message):
    plateau = mg.optimizer.lr.ReduceOnPlateau(0.1, patience=2, cooldown=1)
    net = schedule_net(plateau)
    plateau.step(0.5)
    refused(tmp_path, net, "sgd_0.learning_rate.plateau", state, message)


def test_a_negative_gradient_merge_counter_is_refused(tmp_path):
    net = schedule_net(0.1, gradient_merge=True)
    (name,) = [v.name for v in net.persistables() if v.name == "gradient_merge_0.step"]
    refused(tmp_path, net, name, -1, ">= 0")


def test_a_gradient_merge_nets_learning_rate_is_checked(tmp_path):
    net = schedule_net(0.1, gradient_merge=True)
    refused(tmp_path, net, "sgd_0.learning_rate", np.nan, "finite number >= 0")


@pytest.mark.parametrize("name, value, message", [
    ("bn.estimated_mean", [np.nan] * 5, "NaN"),
    ("fc.w", np.full((4, 5), np.inf), "inf"),
    ("bn.estimated_var", [1, 1, -0.5, 1, 1], ">= 0"),
    ("bn.num_batches", -1, ">= 0"),
])
def test_non_finite_or_impossible_contents_are_refused(tmp_path, name, value, message):
    """NaN estimates made every later step fail with a misleading error, a counter of
    -1 with momentum=None divided by zero, inf weights and negative variances loaded."""
    refused(tmp_path, schedule_net(0.1), name, value, message)


def test_the_counter_minus_one_with_cumulative_momentum(tmp_path):
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3))
    mg.layers.batch_norm(net, x, name="bn", momentum=None)
    refused(tmp_path, net, "bn.num_batches", -1, ">= 0")


# ---- arguments ---------------------------------------------------------------------------

def test_load_and_save_check_their_arguments(tmp_path):
    net = schedule_net(0.1)
    path = io.save(net, tmp_path / "ck.npz")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(TypeError, match="load: path must be"):
            io.load(net, fd)
        os.fstat(fd)                                 # still open: not taken as a descriptor
    finally:
        os.close(fd)
    with pytest.raises(TypeError, match="load: net must be a minigraph Net"):
        io.load("net", path)
    with pytest.raises(TypeError, match="save: net must be a minigraph Net"):
        io.save("net", tmp_path / "x.npz")
    with pytest.raises(TypeError, match="save: path must be"):
        io.save(net, 3)
    with pytest.raises(TypeError, match="strict must be True or False"):
        io.load(net, path, strict="no")
    assert not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize("mode, metric", [("min", -np.inf), ("max", np.inf)])
def test_a_plateau_state_with_an_infinite_best_round_trips(tmp_path, mode, metric):
    """An infinite metric makes the best infinite: a state step() reaches, which io.save
    wrote and io.load used to refuse as non-finite."""
    plateau = mg.optimizer.lr.ReduceOnPlateau(0.1, mode=mode, patience=0)
    net = schedule_net(plateau)
    plateau.step(metric)
    plateau.step(np.nan)                      # NaN never improves, and is never the best
    name = plateau.state_var.name             # sgd_0.learning_rate.plateau
    state = net.var(name).get()
    assert state[0] == 1 and state[1] == metric
    path = io.save(net, tmp_path / "ck.npz")
    twin_plateau = mg.optimizer.lr.ReduceOnPlateau(0.1, mode=mode, patience=0)
    twin = schedule_net(twin_plateau, seed=1)
    io.load(twin, path)
    got = twin.var(name).get()
    assert got.tobytes() == state.tobytes()
    assert twin_plateau.step(0.0) == plateau.step(0.0)      # and they go on alike
    with pytest.raises(ValueError, match="never NaN"):
        twin.var(name).set(np.array([1, np.nan, 0, 0, 1]))
