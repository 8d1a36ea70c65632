"""Work room (minigraph/work_room.py): the memory a training step's values hold, op
by op, and the room it leaves the kernels that declare OpSchema.work_room."""
import tracemalloc

import numpy as np
import pytest
from helpers import spying

import minigraph as mg
from minigraph import layers as L
from minigraph import work_room
from minigraph.kernels.cpu import choices, conv_native
from minigraph.kernels.cpu import conv2d as conv2d_kernels
from minigraph.kernels.cpu import conv_im2col as conv_cpu
from minigraph.plan import ONE
from minigraph.schema import get_schema
from minigraph.scope import Variable


def held(var, value):
    var.value = value
    return ("out", var, ONE)


def test_the_meter_counts_each_arrays_memory_once_until_its_last_holder_lets_go():
    a, b, c, d = (Variable(name) for name in "abcd")
    meter = work_room.Meter()
    x = np.zeros(1000, np.float32)                              # 4000 bytes
    meter.ran([held(a, x)], ())
    meter.ran([held(b, x.reshape(10, 100)[2:])], ())            # a view: nothing new
    meter.ran([held(c, np.zeros(10, np.float64))], (a,))        # 80 bytes; b still holds x
    meter.ran([held(d, x)], (b,))                               # written into x: nothing new
    meter.ran([], (d,))                                         # after it, x's last holder
    meter.ran([], ())                                           # has let go
    assert meter.held == [4000, 4000, 4080, 4080, 4080, 80]


def test_persistables_and_non_arrays_are_not_counted():
    p, q = Variable("p", persistable=True), Variable("q")
    meter = work_room.Meter()
    meter.ran([held(p, np.zeros(100)), held(q, None)], ())
    meter.ran([("outs", [held(Variable("r"), np.zeros(3))[1], q], 1)], ())
    assert meter.held == [0, 24]


def test_rooms_go_to_the_ops_that_declare_work_room():
    class Op:
        def __init__(self, op_type):
            self.schema = get_schema(op_type)

    meter = work_room.Meter()
    meter.held = [100, 700, 400]
    ops = [Op("conv2d"), Op("relu"), Op("conv2d_grad")]
    assert meter.rooms(ops) == (600, None, 300)


def test_room_above_the_lean_cap_buys_full_chunks():
    g = conv_cpu.geometry((32, 16, 32, 32), (16, 16, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    lean = conv_cpu.chunk_size(g, np.float32, lean=True)
    assert conv_cpu.chunk_size(g, np.float32, lean=True, room=None) == lean
    assert conv_cpu.chunk_size(g, np.float32, lean=True, room=1 << 10) == lean
    full = conv_cpu.chunk_size(g, np.float32, lean=False)
    assert lean < full
    assert conv_cpu.chunk_size(g, np.float32, lean=True, room=64 << 20) == full
    cols = g.c * g.taps * g.length * 4
    between = conv_cpu.chunk_size(g, np.float32, lean=True, room=4 * (cols + 2 ** 15) << 2)
    assert lean <= between <= full


def conv_net(seed=0):
    net = mg.Net(seed=seed)
    img = L.data(net, "image", shape=(-1, 3, 32, 32))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    h = img
    for _ in range(3):
        h = L.relu(net, L.batch_norm(net, L.conv2d(net, h, 8, 3, padding=1, bias=False)))
    h = L.pool2d(net, h, global_pooling=True, pool_type="avg")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, L.flatten(net, h), 4),
                                                    lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    return net, loss


def batch(seed):
    r = np.random.default_rng(seed)
    return {"image": r.standard_normal((32, 3, 32, 32)).astype(np.float32),
            "label": r.integers(0, 4, 32)}


def train(rooms, monkeypatch, steps=3):
    """Losses, parameters, the last step's traced peak and the conv kernels' chunks
    (lean, taken) of a few steps, with work rooms or without."""
    with monkeypatch.context() as m:
        if not rooms:
            m.setattr(work_room.Meter, "rooms", lambda self, ops: [None] * len(ops))
        chunks, real = [], conv_cpu.chunk_size

        def spy(g, dtype, lean, reserved=0, room=None):
            chunks.append((real(g, dtype, lean, reserved), real(g, dtype, lean, reserved, room)))
            return chunks[-1][1]

        m.setattr(conv_cpu, "chunk_size", spy)
        net, loss = conv_net()
        losses = []
        for step in range(steps):
            chunks.clear()
            if step == steps - 1:
                tracemalloc.start()
            (value,) = net.train(feed=batch(step), fetch=[loss])
            losses.append(float(value))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return losses, [p.get().copy() for p in net.parameters()], peak, list(chunks)


def test_a_step_with_work_room_takes_bigger_chunks_and_no_more_memory(monkeypatch):
    """After the check run, conv2d and conv2d_grad take the room the step leaves them:
    chunks of more images where fewer activations are alive, lean ones at the peak,
    the same results, and a peak no higher than with lean work everywhere (conv_cpu's
    engine: the native kernels keep no columns)."""
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    losses, params, peak, chunks = train(True, monkeypatch)
    lean_losses, lean_params, lean_peak, lean_chunks = train(False, monkeypatch)
    assert all(taken == lean for lean, taken in lean_chunks)
    assert any(taken > lean for lean, taken in chunks)
    assert any(taken == lean for lean, taken in chunks)    # at the peak
    np.testing.assert_allclose(losses, lean_losses, rtol=1e-5)
    for a, b in zip(params, lean_params):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert peak <= lean_peak + (64 << 10), (peak, lean_peak)


@pytest.fixture
def conv_rooms():
    """The work room of every conv2d kernel call, in order."""
    rooms = []

    def make_spy(plain):
        def spy(op, ins, ctx):
            rooms.append(ctx.room)
            return plain(op, ins, ctx)
        return spy

    with spying("conv2d", make_spy):
        yield rooms


def test_the_check_run_passes_no_room_and_a_new_shape_measures_again(conv_rooms):
    rooms = conv_rooms
    net, loss = conv_net()
    net.train(feed=batch(0), fetch=[loss])
    assert rooms == [None] * 3
    rooms.clear()
    net.train(feed=batch(1), fetch=[loss])
    assert None not in rooms and rooms[0] > rooms[-1] >= 0
    first = rooms[:]
    rooms.clear()
    small = {k: v[:8] for k, v in batch(2).items()}
    net.train(feed=small, fetch=[loss])
    assert rooms == [None] * 3                     # a new signature: checked and measured
    rooms.clear()
    net.train(feed=small, fetch=[loss])
    assert rooms[0] == pytest.approx(first[0] / 4, rel=0.05)


def wide_convs(n=128, c=16, hw=4):
    """(net, feed): three 3x3 convs of `c` channels on hw x hw images (many channels on
    small images: Winograd's scratch outgrows the output), trained with Momentum."""
    net = mg.Net(seed=0)
    img = L.data(net, "image", shape=(-1, c, hw, hw))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    h = img
    for _ in range(3):
        h = L.relu(net, L.conv2d(net, h, c, 3, padding=1, bias=False))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, L.flatten(net, h), 4), lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    r = np.random.default_rng(1)
    return net, {"image": r.standard_normal((n, c, hw, hw)).astype(np.float32),
                 "label": r.integers(0, 4, n)}


def winograd_scratch(g, threads=2):
    return conv_native._winograd_scratch(g, conv_native._threads(g, threads))


needs_native = pytest.mark.skipif(not conv_native.available(),
                                  reason="the native kernels are not built here")


@needs_native
def test_room_buys_winograd_where_its_scratch_outgrows_the_output():
    g = conv_cpu.geometry((32, 32, 4, 4), (32, 32, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    out = g.n * g.o * g.ho * g.wo
    scratch = winograd_scratch(g)
    assert scratch > 4 * out * conv_native.WINOGRAD_MAX_SCRATCH
    bound = conv2d_kernels.winograd_bound
    takes = conv_native.forward_winograd
    assert bound(takes, g, 2, None, out) == (None, "")
    assert bound(takes, g, 2, scratch - 1, out) == (None, "")
    limit, extra = bound(takes, g, 2, scratch, out)
    assert extra == "room" and takes(g, 2, limit)
    dx_room = 64 << 20
    limit, extra = bound(conv_native.input_grad_winograd, g, 2, dx_room, g.n * g.c * g.h * g.w)
    assert extra == "room" and conv_native.input_grad_winograd(g, 2, limit)
    assert bound(conv_native.input_grad_winograd, g, 2, None, out) == (None, "")
    small = conv_cpu.geometry((32, 16, 32, 32), (16, 16, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    for room in (None, 0, 64 << 20):     # within the default bound: room changes nothing
        assert bound(takes, small, 2, room, 32 * 16 * 32 * 32) == (
            conv_native.WINOGRAD_MAX_SCRATCH, "")


@needs_native
def test_convs_run_winograd_within_the_room_the_step_leaves_them(monkeypatch):
    """After the check run (no room), conv2d and conv2d_grad on many channels and small
    images run Winograd's kernel where the step leaves room for its scratch, under keys
    of their own, and never take more scratch than that room; the results equal a
    step without rooms."""
    calls, room = [], [None]

    def make_spy(plain):
        def spy(op, ins, ctx):
            room[0] = ctx.room
            return plain(op, ins, ctx)
        return spy

    real = conv_native.run_winograd

    def run_winograd(args, dims, threads, g, stats, w):
        calls.append((room[0], winograd_scratch(g, threads), 4 * g.n * g.o * g.ho * g.wo))
        return real(args, dims, threads, g, stats, w)

    keys, pick = [], choices.pick

    def spy_pick(kind, key, options, default):
        keys.append((kind, key, tuple(options)))
        return pick(kind, key, options, default)

    def steps(rooms):
        with monkeypatch.context() as m:
            if not rooms:
                m.setattr(work_room.Meter, "rooms", lambda self, ops: [None] * len(ops))
            m.setattr(conv_native, "run_winograd", run_winograd)
            m.setattr(choices, "pick", spy_pick)
            net, feed = wide_convs()
            losses = []
            forced = {"conv2d": "winograd", "conv2d_dx": "winograd"}
            with spying("conv2d", make_spy), spying("conv2d_grad", make_spy), \
                    choices.forcing(forced):
                for step in range(3):
                    calls.clear()
                    keys.clear()
                    losses.append(float(net.train(feed=feed, fetch=[loss_of(net)])[0]))
                    if step == 0:
                        assert calls == []          # the check run: no room, no Winograd
            return losses, [p.get().copy() for p in net.parameters()], list(calls), list(keys)

    losses, params, roomy, roomy_keys = steps(True)
    assert roomy, "no conv ran Winograd's kernel within its room"
    for given, scratch, out in roomy:
        assert scratch > out and given is not None and scratch <= given
    for kind in ("conv2d", "conv2d_dx"):
        assert any(k == kind and "|room|" in key and "winograd" in options
                   for k, key, options in roomy_keys), kind
    lean_losses, lean_params, lean, lean_keys = steps(False)
    assert lean == [] and not any("|room|" in key for _, key, _ in lean_keys)
    np.testing.assert_allclose(losses, lean_losses, rtol=1e-5)
    for a, b in zip(params, lean_params):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def loss_of(net):
    return next(op.outputs["out"] for op in net.ops("train") if op.type == "mean")
