"""A training step is all or nothing (minigraph/journal.py, run by minigraph/executor.py),
and so are steps on several threads, re-entrant infer, and feeds that never share the
caller's arrays."""
import threading

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L
from minigraph.schema import Meta, OpSchema, Slot, kernel, register
from minigraph.validators import bool_attr


def _passthrough_infer(ins, attrs):
    return {"out": Meta(ins["x"].shape, ins["x"].dtype)}


register(OpSchema(type="test_fail_if", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  attrs=(bool_attr("armed", False),), infer=_passthrough_infer))
register(OpSchema(type="test_call_back", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  infer=_passthrough_infer))
ARMED = {"on": False}
CALLBACK = {"fn": None}


@kernel("test_fail_if", "cpu")
def _fail_if(op, ins, ctx):
    if ARMED["on"]:
        raise RuntimeError("test_fail_if: armed")
    return {"out": ins["x"]}


@kernel("test_call_back", "cpu")
def _call_back(op, ins, ctx):
    if CALLBACK["fn"] is not None:
        CALLBACK["fn"]()
    return {"out": ins["x"]}


def bn_net(optimizer=None, seed=0):
    net = mg.Net(seed=seed)
    img = L.data(net, "image", shape=(-1, 2, 4, 4))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.relu(net, L.batch_norm(net, L.conv2d(net, img, 3, 3, padding=1), name="bn"))
    logits = L.fc(net, h, 4, name="fc")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    (optimizer or mg.optimizer.Momentum(0.1, 0.9)).minimize(net, loss)
    return net, logits, loss


def feed(seed=0, n=6, bad_label=False):
    r = np.random.default_rng(seed)
    labels = r.integers(0, 4, n)
    if bad_label:
        labels[3] = 7
    return {"image": r.standard_normal((n, 2, 4, 4)).astype(np.float32), "label": labels}


def state(net):
    return {v.name: v.get().copy() for v in net.persistables()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_label_out_of_range_changes_no_persistable():
    net, _, loss = bn_net()
    net.train(feed=feed())
    before = state(net)
    arrays = {v.name: v.value for v in net.persistables()}
    with pytest.raises(mg.OpError, match="label"):
        net.train(feed=feed(1, bad_label=True))
    assert_same(state(net), before)          # estimates, counter, weights, velocities
    assert all(v.value is arrays[v.name] for v in net.persistables())   # the same arrays
    net.train(feed=feed(1))                  # and the net trains on
    assert int(net.var("bn.num_batches").get()) == 2


@pytest.mark.parametrize("optimizer", [lambda: mg.optimizer.SGD(0.1),
                                       lambda: mg.optimizer.AdamW(
                                           mg.optimizer.lr.CosineDecay(0.1, 10),
                                           grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.5))])
def test_an_op_that_raises_after_some_updates_rolls_every_one_back(optimizer):
    net, _, loss = bn_net(optimizer())
    updates = net.section("update")
    grad = updates[-1].inputs["grad"]
    net.insert_op("update", len(updates) - 1,
                  mg.Operator("test_fail_if", x=grad, out=grad, armed=True))
    ARMED["on"] = False
    net.train(feed=feed())
    before = state(net)
    ARMED["on"] = True
    try:
        with pytest.raises(RuntimeError, match="armed"):
            net.train(feed=feed(2))
    finally:
        ARMED["on"] = False
    assert_same(state(net), before)          # incl. moments, beta powers, schedule step


def test_an_evaluation_thread_beside_training_changes_nothing():
    sequential, _, _ = bn_net()
    for _ in range(40):
        sequential.train(feed=feed())
    net, logits, _ = bn_net()
    errors = []

    def evaluate():
        try:
            for _ in range(40):
                (p,) = net.infer(feed={"image": feed(5, n=3)["image"]}, fetch=[logits])
                assert p.shape == (3, 4)
        except Exception as e:            # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=evaluate)
    t.start()
    for _ in range(40):
        net.train(feed=feed())
    t.join()
    assert not errors
    assert_same(state(net), state(sequential))


def test_two_training_threads_equal_the_steps_in_sequence():
    sequential, _, _ = bn_net(mg.optimizer.SGD(0.05))
    for _ in range(60):
        sequential.train(feed=feed())
    net, _, loss = bn_net(mg.optimizer.SGD(0.05))
    errors = []

    def work():
        try:
            for _ in range(30):
                (value,) = net.train(feed=feed(), fetch=[loss])
                assert np.isfinite(value)
        except Exception as e:            # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert_same(state(net), state(sequential))    # the same 60 steps, one at a time


def test_infer_from_inside_a_step_does_not_corrupt_it():
    def build():
        net, logits, loss = bn_net()
        h = net.var("bn.y")
        net.insert_op("train", 1, mg.Operator("test_call_back", x=h, out=h))
        return net, logits, loss

    plain, _, ploss = build()
    net, logits, loss = build()
    seen = []
    CALLBACK["fn"] = lambda: seen.append(net.infer(feed={"image": feed(9, n=2)["image"]},
                                                   fetch=[logits])[0])
    try:
        got = [net.train(feed=feed(), fetch=[loss])[0] for _ in range(3)]
    finally:
        CALLBACK["fn"] = None
    want = [plain.train(feed=feed(), fetch=[ploss])[0] for _ in range(3)]
    np.testing.assert_array_equal(got, want)
    assert_same(state(net), state(plain))
    assert len(seen) == 3 and seen[0].shape == (2, 4)


def test_feeds_are_copied_and_never_written():
    net, logits, loss = bn_net()
    f = feed()
    kept = {k: v.copy() for k, v in f.items()}
    net.train(feed=f)
    assert net.var("image").value is not f["image"]
    f["image"][...] = 99                   # the caller's array is the caller's
    (p,) = net.infer(feed={"image": kept["image"]}, fetch=[logits])
    np.testing.assert_array_equal(f["label"], kept["label"])
    assert np.isfinite(p).all()


def test_rewrites_drop_cached_plans():
    net, logits, loss = bn_net()
    net.train(feed=feed())
    plan = net.plan("train", ())
    assert net.plan("train", ()) is plan
    op = mg.Operator("test_fail_if", x=loss, out=loss)
    net.append_op(op, "backward")
    assert net.plan("train", ()) is not plan and op in net.plan("train", ()).ops
    net.remove_op("backward", op)
    assert op not in net.plan("train", ()).ops
    with pytest.raises(ValueError, match="is not an op of section 'backward'"):
        net.remove_op("backward", op)
    with pytest.raises(ValueError, match="section must be one of"):
        net.append_op(op, "nowhere")


def test_a_failure_at_any_op_of_an_adam_step_changes_nothing():
    """Adam, momentum and sgd write into spare arrays (OpSchema.spares): the old
    arrays are what a failed step puts back, whichever op fails."""
    net, _, _ = bn_net(mg.optimizer.Adam(mg.optimizer.lr.StepDecay(0.1, 1)))
    net.train(feed=feed())
    ops = [("backward", i) for i in range(len(net.section("backward")))] + \
        [("update", i) for i in range(len(net.section("update")) + 1)]
    for section, index in ops:
        before = state(net)
        anchor = net.var("fc.out", "train")
        op = net.insert_op(section, index, mg.Operator("test_fail_if", x=anchor, out=anchor,
                                                          armed=True))
        ARMED["on"] = True
        try:
            with pytest.raises(RuntimeError, match="armed"):
                net.train(feed=feed(3))
        finally:
            ARMED["on"] = False
            net.remove_op(section, op)
        assert_same(state(net), before)
        net.train(feed=feed(4))                  # and a good step still trains


def test_an_update_writes_a_spare_and_recycles_only_arrays_no_one_holds():
    net, _, _ = bn_net(mg.optimizer.Adam(0.1))
    net.train(feed=feed())
    w = net.var("fc.w")
    held = w.value                               # a caller keeps this array
    kept = held.copy()
    net.train(feed=feed(1))
    assert w.value is not held                   # the new values went to another array
    np.testing.assert_array_equal(held, kept)     # and this one keeps the old ones
    for seed in (2, 3, 4):
        net.train(feed=feed(seed))
    np.testing.assert_array_equal(held, kept)     # never recycled while held
    seen = set()
    for seed in (5, 6, 7, 8):
        net.train(feed=feed(seed))
        seen.add(id(w.value))
    assert len(seen) == 2                         # two arrays take turns: no copies


# ---- a second interrupt, a fetch that fails, and the previous step's gradients ------------

def wide_net(layers=12):
    """A net with many persistables (weights, biases, velocities, estimates)."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 6))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    h = x
    for i in range(layers):
        h = L.relu(net, L.batch_norm(net, L.fc(net, h, 6, name=f"fc{i}"), name=f"bn{i}"))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, h, 3, name="head"), lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    return net, loss


def wide_feed(seed=0):
    r = np.random.default_rng(seed)
    return {"x": r.standard_normal((8, 6)).astype(np.float32), "label": r.integers(0, 3, 8)}


class _SignalOnCopy:
    """Stands in for numpy inside minigraph.journal: once armed, every copy the journal
    makes raises SIGINT first (a second Ctrl-C arriving while it rolls back)."""

    def __init__(self, real):
        self.real, self.armed, self.sent = real, False, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def copyto(self, *args, **kwargs):
        if self.armed and self.sent < 3:
            self.sent += 1
            import signal
            signal.raise_signal(signal.SIGINT)
        return self.real.copyto(*args, **kwargs)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in a terminal, whatever the
    test runner inherited (a job started in the background ignores SIGINT)."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_a_second_interrupt_during_rollback_cannot_split_it(monkeypatch, ctrl_c_raises):
    """Ctrl-C in the last update op, then Ctrl-C again (three times) while the step
    rolls back: train raises KeyboardInterrupt and every persistable is as before the
    step (the `except KeyboardInterrupt: save()` pattern saves a whole state)."""
    import signal

    from minigraph import journal

    net, _ = wide_net()
    net.train(feed=wide_feed())
    ops = net.section("update")
    grad = ops[-1].inputs["grad"]
    net.append_op(mg.Operator("test_call_back", x=grad, out=grad), "update")
    before = state(net)
    proxy = _SignalOnCopy(np)
    monkeypatch.setattr(journal, "np", proxy)

    def interrupt():
        proxy.armed = True
        raise KeyboardInterrupt

    CALLBACK["fn"] = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            net.train(feed=wide_feed(1))
    finally:
        CALLBACK["fn"] = None
    monkeypatch.setattr(journal, "np", np)
    assert len(before) > 60
    assert_same(state(net), before)
    assert proxy.sent == 3                      # the interrupts did arrive mid-rollback
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_signals_are_delivered_after_the_block(ctrl_c_raises):
    import signal

    from minigraph.journal import deferred_signals

    got = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        with deferred_signals():
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)
            assert got == []
        assert got == [signal.SIGUSR1]
        with pytest.raises(KeyboardInterrupt):
            with deferred_signals():
                signal.raise_signal(signal.SIGINT)
                done = True
        assert done
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_deferred_signals_outside_the_main_thread_do_nothing():
    from minigraph.journal import deferred_signals

    ran = []

    def work():
        with deferred_signals():
            ran.append(True)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert ran == [True]


def test_a_fetch_that_fails_rolls_the_step_back():
    """A fetch error used to come after the step had committed."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 6))
    L.data(net, "unused", shape=(-1, 6))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, x, 3, name="fc"), lbl))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    before = state(net)
    with pytest.raises(ValueError, match="fetch 'unused'"):
        net.train(feed=wide_feed(), fetch=[loss, "unused"])
    assert_same(state(net), before)


def test_a_failed_step_keeps_the_previous_steps_gradients():
    net, _, _ = bn_net()
    net.train(feed=feed())
    grads = {name: g.get() for name, g in net.grads.items()
             if net.scope.find_var(name) is not None and net.scope.find_var(name).persistable}
    assert grads
    with pytest.raises(mg.OpError, match="label"):
        net.train(feed=feed(1, bad_label=True))
    for name, value in grads.items():
        np.testing.assert_array_equal(net.grad(name).get(), value, err_msg=name)
