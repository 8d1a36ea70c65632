"""net.profile(): time per op type and per layer, on the executor's own path."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import minigraph as mg
from minigraph import op_threads
from minigraph.examples.train_digits import build_net
from minigraph.kernels.cpu import blocks, choices
from minigraph.pictures import profile as profile_mod

STEPS = 3


@pytest.fixture()
def digits():
    return build_net(mg.CPUPlace(), seed=0)


@pytest.fixture(scope="module")
def feed():
    rng = np.random.default_rng(0)
    return {"image": rng.standard_normal((16, 1, 8, 8)).astype(np.float32),
            "label": rng.integers(0, 10, 16).astype(np.int64)}


def persistable_values(net):
    return {v.name: v.get().copy() for v in net.persistables()}


def test_a_train_profile_times_every_op_type_and_layer_of_the_step(digits, feed):
    net, _ = digits
    table = net.profile(feed, steps=STEPS)
    assert (table.mode, table.steps, table.place) == ("train", STEPS, "CPUPlace()")
    ops = net.plan("train", (net.loss,)).ops
    calls = {r.name: r.calls for r in table.by_type}
    assert calls == {**{t: n * STEPS for t, n in Counter(op.type for op in ops).items()},
                     "(executor)": 0}
    layers = {r.name for r in table.by_layer}
    fused = {"relu_0", "relu_1"}          # they run inside bn1's and bn2's batch_norm_relu
    assert layers == {rec.name for rec in net.layers} - fused | {"(executor)"}
    for rows in (table.by_type, table.by_layer):
        assert rows[-1].name == "(executor)"
        assert [r.ms for r in rows[:-1]] == sorted((r.ms for r in rows[:-1]), reverse=True)
        assert sum(r.share for r in rows) == pytest.approx(1.0)        # parts of a step
        assert sum(r.ms for r in rows) == pytest.approx(table.timed_step_ms)
        assert all(r.ms >= 0 and 0 <= r.share <= 1 for r in rows)
    assert len(table.by_op) == len(ops) and table.ops_share(ops) <= 1.0
    assert len(table.step_times_ms) == STEPS and table.step_ms == pytest.approx(
        np.mean(table.step_times_ms))                  # the untimed steps between the timed
    assert table.timed_step_ms > 0
    bn1 = table.layer_share("bn1")            # forward, gradient and update ops of bn1
    bn1_ops = [op for op in ops if op.type in ("batch_norm_relu", "batch_norm_relu_grad",
                                              "momentum")
               and any(v.name.startswith("bn1.") for v in op.output_vars())]
    assert len(bn1_ops) == 4 and bn1 == pytest.approx(table.ops_share(bn1_ops))
    assert table.layer_share("no such layer") is None


def test_the_table_reads_as_text(digits, feed):
    net, _ = digits
    text = str(net.profile(feed, steps=STEPS))
    lines = text.splitlines()
    assert lines[0].startswith(f"profile of {STEPS} train steps on CPUPlace(): a step takes ")
    assert "ms (mean; median" in lines[0] and "per step with the timers" in lines[1]
    for head in ("op type", "layer"):
        row = next(line for line in lines if line.startswith(head))
        assert row.split() == [*head.split(), "ms/step", "share", "calls", "ms/call"]
    conv = next(line for line in lines if line.startswith("conv2d_grad "))
    ms, share, calls, per_call = conv.split()[1:]
    assert float(share.rstrip("%")) >= 0 and calls == str(STEPS)
    assert float(per_call) == pytest.approx(float(ms), abs=2e-3)       # one call per step
    assert next(line for line in lines if line.startswith("(executor)")).split()[3:] == \
        ["-", "-"]


def test_profiling_a_training_net_leaves_it_as_it_was(digits, feed):
    net, h = digits
    net.train(feed=feed, fetch=[h["loss"]])      # momentum has state to keep
    before = persistable_values(net)
    net.profile(feed, steps=STEPS)
    after = persistable_values(net)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    # and the net trains on as before: the same next step as an untouched copy
    twin = build_net(mg.CPUPlace(), seed=0)
    twin[0].train(feed=feed, fetch=[twin[1]["loss"]])
    (a,) = net.train(feed=feed, fetch=[h["loss"]])
    (b,) = twin[0].train(feed=feed, fetch=[twin[1]["loss"]])
    assert a == b


def test_the_timers_are_only_in_place_while_profiling(digits, feed):
    net, h = digits
    net.profile(feed, steps=STEPS)
    compiled = net.plan("train", (net.loss,)).compiled(net.place)
    assert compiled.kernels and all(fn is not None for fn in compiled.kernels)
    assert not any(isinstance(fn, profile_mod._Timer) for fn in compiled.kernels)


def test_timed_and_untimed_steps_take_turns_after_the_warmup(digits, feed, monkeypatch):
    """The step total comes from steps without timers, so it is what a benchmark of
    net.train measures; the kernels' times come from the steps in between."""
    net, h = digits
    real, seen = net.train, []

    def train(**kwargs):
        compiled = net.plan("train", (net.loss,)).compiled(net.place)
        seen.append(any(isinstance(fn, profile_mod._Timer) for fn in compiled.kernels))
        return real(**kwargs)

    monkeypatch.setattr(net, "train", train)
    table = net.profile(feed, steps=STEPS, warmup=2)
    warm = len(seen) - 2 * STEPS         # 2, and on threads the steps measuring them
    assert seen == [False] * warm + [False, True] * STEPS and warm >= 2
    assert len(table.step_times_ms) == table.steps == STEPS


def test_the_warmup_runs_past_the_steps_that_measure_threads_per_op(digits, feed):
    net, h = digits
    with blocks.num_threads(2):
        plan = net.plan("train", (net.loss,))
        net.profile(feed, steps=1, warmup=1)
        assert op_threads.settled(plan, net.place)
        if choices.enabled():
            c = plan.compiled(net.place)
            assert [choice.counts is not None for choice in c.op_threads.values()] == [True]


def test_a_step_that_raises_puts_back_the_kernels_and_the_persistables(digits, feed,
                                                                       monkeypatch):
    net, h = digits
    before = persistable_values(net)
    real, calls = net.train, []

    def train_then_fail(**kwargs):
        out = real(**kwargs)
        calls.append(1)
        if len(calls) == 3:                       # the second timed step
            raise RuntimeError("lost the machine")
        return out

    monkeypatch.setattr(net, "train", train_then_fail)
    with pytest.raises(RuntimeError, match="lost the machine"):
        net.profile(feed, steps=STEPS, warmup=1)
    compiled = net.plan("train", (net.loss,)).compiled(net.place)
    assert not any(isinstance(fn, profile_mod._Timer) for fn in compiled.kernels)
    for name, value in persistable_values(net).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_an_infer_profile_times_the_infer_branch(digits, feed):
    net, h = digits
    table = net.profile({"image": feed["image"]}, steps=STEPS, mode="infer",
                        fetch=[h["logits"]])
    types = {r.name for r in table.by_type}
    assert types == {"conv2d", "elementwise_add", "batch_norm_relu", "pool2d", "mul",
                     "(executor)"}
    assert all(r.calls % STEPS == 0 for r in table.by_type)
    assert table.mode == "infer" and str(table).startswith(f"profile of {STEPS} infer steps")
    infer_ops = net.section("infer")
    assert table.op_share(infer_ops[0]) is not None and table.op_share(
        net.section("backward")[0]) is None


def test_an_optimized_inference_net_is_timed_op_by_op(digits, feed):
    """An inference plan on the CPU runs its ops' bound forms once a run has passed its
    checks; while profiling, each op runs its timed kernel instead (the forms would
    run past the timers: fused_fc's and fused_conv2d's took 0 ms), and afterwards the
    forms again."""
    net, h = digits
    fast = mg.passes.optimize_for_inference(net)
    feed_x = {"image": feed["image"]}
    for _ in range(3):
        fast.infer(feed=feed_x, fetch=[h["logits"].name])
    table = fast.profile(feed_x, steps=STEPS, mode="infer", fetch=[h["logits"].name])
    kernels = [r for r in table.by_type if r.name != "(executor)"]
    assert {r.name for r in kernels} >= {"fused_conv2d", "fused_fc"}
    assert all(r.calls > 0 and r.calls % STEPS == 0 and r.ms > 0 for r in kernels)
    compiled = fast.plan("infer", (fast.var(h["logits"].name),)).compiled(fast.place)
    fast.infer(feed=feed_x, fetch=[h["logits"].name])
    assert compiled.bound is not None and any(f is not None for f in compiled.bound.forms)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"mode": "eval"}, ValueError, "profile: mode must be 'train' or 'infer', got 'eval'"),
    ({"steps": 0}, ValueError, "profile: steps must be an int >= 1, got 0"),
    ({"steps": 2.5}, ValueError, "profile: steps must be an int >= 1, got 2.5"),
    ({"warmup": 0}, ValueError, "profile: warmup must be an int >= 1, got 0"),
    ({"fetch": "loss"}, TypeError, "profile: fetch must be a list of Variables or names"),
])
def test_bad_arguments_are_errors_naming_them_and_nothing_runs(digits, feed, kwargs, error,
                                                               message, monkeypatch):
    net, _ = digits
    monkeypatch.setattr(net, "train", lambda **_: pytest.fail("a step ran"))
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        net.profile(feed, **kwargs)


def test_a_net_without_a_loss_needs_a_fetch_to_profile_training(feed):
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "image", shape=(-1, 1, 8, 8))
    mg.layers.fc(net, x, 4, name="fc")
    with pytest.raises(ValueError, match="profile: mode='train' needs a net with a loss"):
        net.profile({"image": feed["image"]})
    with pytest.raises(TypeError, match="profile: net must be a Net"):
        profile_mod.profile("net", feed)
    with pytest.raises(KeyError, match="nope"):
        net.profile({"nope": feed["image"]}, mode="infer")
    table = net.profile({"image": feed["image"]}, steps=2, mode="infer", fetch=["fc.out"])
    assert [r.name for r in table.by_layer] == ["fc", "(executor)"]


def test_check_table_refuses_anything_but_this_nets_table(digits, feed):
    net, _ = digits
    table = net.profile(feed, steps=1, warmup=1)
    assert profile_mod.check_table(table, net, "render") is table
    with pytest.raises(TypeError, match="render: profile must be the table"):
        profile_mod.check_table(str(table), net, "render")
    with pytest.raises(ValueError, match="render: this profile table was measured on another"):
        profile_mod.check_table(table, build_net(mg.CPUPlace(), seed=0)[0], "render")


def test_a_gpu_profile_times_the_gpu_kernels(device_place, feed):
    """On the kernel emulator (and on a GPU where there is one, which the timers
    synchronise around each kernel)."""
    net, h = build_net(device_place, seed=0)
    before = persistable_values(net)
    table = net.profile(feed, steps=2, warmup=1)
    assert table.place == repr(device_place)
    assert {"conv2d", "batch_norm_relu_grad", "momentum"} <= {r.name for r in table.by_type}
    assert sum(r.share for r in table.by_layer) == pytest.approx(1.0)
    for name, value in persistable_values(net).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
