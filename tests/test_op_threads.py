"""minigraph.op_threads: a CPU training plan measures each op on all threads and on one
in its first steps, then runs each op on its choice; the threads come back after
every step, failed ones too, and the values are those of a step on all threads."""
import threading

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L
from minigraph import op_threads
from minigraph.kernels.cpu import blas_threads, blocks, choices
from minigraph.schema import Meta, OpSchema, Slot, kernel, register
from minigraph.validators import bool_attr

pytestmark = pytest.mark.skipif(not choices.enabled(), reason="native kernels off: no tuning")

register(OpSchema(type="test_threads_spy", inputs=(Slot("x"),), outputs=(Slot("out"),),
                  attrs=(bool_attr("fail", False),),
                  infer=lambda ins, attrs: {"out": Meta(ins["x"].shape, ins["x"].dtype)}))
SEEN = []           # (engine threads, BLAS threads) each time the spy ran
FAIL = {"on": False}


@kernel("test_threads_spy", "cpu")
def _spy(op, ins, ctx):
    SEEN.append((blocks.get_num_threads(), blas_now()))
    if FAIL["on"] and op.attrs["fail"]:
        raise RuntimeError("test_threads_spy: failing")
    return {"out": ins["x"]}


def blas_now():
    """numpy's OpenBLAS's thread count (the engine's where numpy's BLAS is not OpenBLAS;
    libraries loaded later, scipy's, run no kernel's products)."""
    import threadpoolctl

    return max((i["num_threads"] for i in threadpoolctl.threadpool_info()
                if i.get("internal_api") == "openblas" and "numpy" in i["filepath"]),
               default=blocks.get_num_threads())


@pytest.fixture
def two_threads(monkeypatch):
    """Two threads; the spy (which reads OpenBLAS's count through threadpoolctl, some
    milliseconds, varying) is tried on one thread however long it takes."""
    monkeypatch.setattr(op_threads, "LONG_OP", float("inf"))
    monkeypatch.setattr(op_threads, "SLOWER", float("inf"))
    before = blocks.get_num_threads()
    mg.set_num_threads(2)
    SEEN.clear()
    yield
    mg.set_num_threads(before)


FEED = {"x": np.random.default_rng(0).standard_normal((32, 20)).astype(np.float32),
        "label": np.random.default_rng(1).integers(0, 5, 32)}


def spied_net(fail=False, seed=0):
    """x -> fc -> batch norm -> relu -> fc -> loss, Momentum; a spy op on the first fc's
    output gradient in the backward section."""
    net = mg.Net(seed=seed)
    x = L.data(net, "x", shape=(-1, 20))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.relu(net, L.batch_norm(net, L.fc(net, x, 64, name="f1")))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, h, 5, name="f2"), label))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    grad = net.grad(net.var("f2.w"))
    net.append_op(mg.Operator("test_threads_spy", x=grad, out=grad, fail=fail), "backward")
    return net, loss


def compiled(net, loss):
    return net.plan("train", (loss,)).compiled(net.place)


def choice(c, threads=2):
    """The plan's choice for the signature in use and `threads`, or None."""
    return c.op_threads.get((c.in_use, threads))


def spy_index(c):
    return next(i for i, s in enumerate(c.steps) if s.op.type == "test_threads_spy")


def test_the_first_steps_measure_each_op_on_both_counts_then_choose(two_threads):
    net, loss = spied_net()
    net.train(feed=FEED, fetch=[loss])                               # the check run measures nothing
    c = compiled(net, loss)
    assert c.op_threads == {} and SEEN == [(2, 2)]
    for _ in range(2 * op_threads.ROUNDS):
        net.train(feed=FEED, fetch=[loss])
        assert blocks.get_num_threads() == 2 and blas_now() == 2   # back after each step
    assert SEEN[1:] == [(2, 2), (1, 1)] * op_threads.ROUNDS          # all, one, all, one...
    chosen = choice(c)
    assert list(c.op_threads) == [(c.in_use, 2)]
    assert chosen.threads == 2 and chosen.times is None
    assert len(chosen.counts) == len(c.steps) and set(chosen.counts) <= {None, 1}
    SEEN.clear()
    chosen.counts = tuple(1 if i == spy_index(c) else None for i in range(len(c.steps)))
    net.train(feed=FEED, fetch=[loss])
    assert SEEN == [(1, 1)] and blocks.get_num_threads() == 2 and blas_now() == 2


def measure(choice, times):
    """Run `choice`'s measuring steps with op i taking times[i] = (on all, on one) ms
    (plus a drift of 1 us a step); returns the counts each op ran on, per step."""
    seen = []
    for step in range(2 * op_threads.ROUNDS):
        counts = [choice.count_for(i) for i in range(len(times))]
        for i, (everyone, one) in enumerate(times):
            choice.ran(i, counts[i], ((everyone if counts[i] is None else one) + step * 1e-3)
                       * 1e-3)
        choice.step_done()
        seen.append(counts)
    return seen


def test_choosing_takes_the_faster_count_and_a_close_call_keeps_the_op_befores():
    choice = op_threads.Choice(4, 5)
    seen = measure(choice, [(0.10, 0.05), (0.10, 0.098), (0.05, 0.09), (0.10, 0.102),
                            (0.01, 0.01)])
    assert seen == [[None] * 5, [1] * 5] * op_threads.ROUNDS
    assert choice.counts == (1, 1, None, None, None)


def test_long_ops_and_ops_far_slower_on_one_thread_are_not_tried_there_again():
    choice = op_threads.Choice(64, 3)
    seen = measure(choice, [(2.0, 1.0), (0.2, 5.0), (0.2, 0.1)])
    assert seen[1] == [None, 1, 1]                  # 2 ms on all: never on one
    assert all(counts == [None, None, 1] for counts in seen[3::2])   # 25x slower: once
    assert choice.counts == (None, None, 1)


def test_a_failed_step_gives_every_thread_back_and_is_not_counted(two_threads):
    net, loss = spied_net(fail=True)
    for _ in range(2):
        net.train(feed=FEED, fetch=[loss])
    c = compiled(net, loss)
    steps = choice(c).steps
    FAIL["on"] = True
    try:
        with pytest.raises(RuntimeError, match="failing"):
            net.train(feed=FEED, fetch=[loss])             # a measuring step on one thread
    finally:
        FAIL["on"] = False
    assert SEEN[-1] == (1, 1)
    assert blocks.get_num_threads() == 2 and blas_now() == 2
    assert choice(c).steps == steps


def test_each_signature_and_thread_count_has_its_choice(two_threads):
    net, loss = spied_net()
    for _ in range(1 + 2 * op_threads.ROUNDS):
        net.train(feed=FEED, fetch=[loss])
    c = compiled(net, loss)
    chosen, full = choice(c), c.in_use
    assert chosen.counts is not None
    mg.set_num_threads(1)
    net.train(feed=FEED, fetch=[loss])
    assert list(c.op_threads.values()) == [chosen] and SEEN[-1] == (1, 1)   # nothing on 1
    mg.set_num_threads(3)
    net.train(feed=FEED, fetch=[loss])
    assert choice(c, 3).counts is None and SEEN[-1][0] == 3            # measuring for 3
    mg.set_num_threads(2)
    short = {name: value[:8] for name, value in FEED.items()}           # a last short batch
    net.train(feed=short, fetch=[loss])                                 # its check run
    net.train(feed=short, fetch=[loss])
    assert c.in_use != full and choice(c).counts is None and choice(c).steps == 1
    net.train(feed=FEED, fetch=[loss])
    assert c.in_use == full and choice(c) is chosen                     # kept
    assert len(c.op_threads) == 3 <= op_threads.KEPT


def test_steps_while_the_cores_are_contended_run_on_one_thread_and_measure_nothing(
        two_threads, monkeypatch):
    """Another process wants the cores (the native pool saw it): every op of a step runs
    on one thread, before a choice and after it, and those steps are not measured."""
    net, loss = spied_net()
    net.train(feed=FEED, fetch=[loss])                                 # the check run
    busy = {"on": True}
    monkeypatch.setattr(op_threads, "contended", lambda: busy["on"])
    for _ in range(3):
        net.train(feed=FEED, fetch=[loss])
    c = compiled(net, loss)
    assert SEEN[1:] == [(1, 1)] * 3 and choice(c).steps == 0           # nothing measured
    assert blocks.get_num_threads() == 2 and blas_now() == 2           # back after each
    busy["on"] = False
    for _ in range(2 * op_threads.ROUNDS):
        net.train(feed=FEED, fetch=[loss])
    assert choice(c).counts is not None
    chosen = choice(c)
    chosen.counts = (None,) * len(c.steps)                             # all, when calm
    SEEN.clear()
    busy["on"] = True
    net.train(feed=FEED, fetch=[loss])
    busy["on"] = False
    net.train(feed=FEED, fetch=[loss])
    assert SEEN == [(1, 1), (2, 2)]


def test_tuning_off_runs_every_op_on_every_thread(two_threads, monkeypatch):
    monkeypatch.setenv("MINIGRAPH_TUNE", "0")
    net, loss = spied_net()
    for _ in range(4):
        net.train(feed=FEED, fetch=[loss])
    assert compiled(net, loss).op_threads == {} and set(SEEN) == {(2, 2)}


def test_the_values_are_those_of_steps_on_every_thread(two_threads, monkeypatch):
    chosen, loss_a = spied_net(seed=3)
    losses = [float(chosen.train(feed=FEED, fetch=[loss_a])[0]) for _ in range(12)]
    monkeypatch.setenv("MINIGRAPH_TUNE", "0")
    plain, loss_b = spied_net(seed=3)
    want = [float(plain.train(feed=FEED, fetch=[loss_b])[0]) for _ in range(12)]
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    for v in plain.persistables():
        np.testing.assert_allclose(chosen.var(v.name).get(), v.get(), rtol=1e-5, atol=1e-6,
                                   err_msg=v.name)


def test_the_cap_is_this_threads_own(two_threads):
    seen = []
    blocks.cap_threads(1)
    try:
        other = threading.Thread(target=lambda: seen.append(blocks.get_num_threads()))
        other.start()
        other.join()
        assert blocks.get_num_threads() == 1 and seen == [2]
    finally:
        blocks.cap_threads(None)
    assert blocks.get_num_threads() == 2


def test_set_threads_sets_openblas(two_threads):
    if not blas_threads.install():
        pytest.skip(f"OpenBLAS is not on the pool: {blas_threads.reason()}")
    blas_threads.set_threads(1)
    try:
        assert blas_now() == 1
    finally:
        blas_threads.set_threads(2)
    assert blas_now() == 2
