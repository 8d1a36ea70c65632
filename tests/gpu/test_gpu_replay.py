"""A compiled plan replayed as a CUDA graph (minigraph/replay.py, kernels/cuda/graphs.py)
on the fake driver, whose fake cuda-bindings record the work enqueued on a capturing
stream and replay it at cuGraphLaunch; kernels run on the emulator. Replayed steps
equal steps run op by op (new feeds each step, a new batch size captured anew); a
capture that fails (a host read inside the step) warns, names the reason and changes
no result; a parameter given a new array from outside is read, not the old one;
nothing runs on the legacy default stream inside a step; GradientMerge's two plans (and
so the GPT example's training step) are replayed, and a replayed step that fails puts
its sums back."""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest
from kernel_emulator import fake_pycuda
from op_harness import batches, small_net

import minigraph as mg
from minigraph import replay
from minigraph.kernels.cuda import activation

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


def trained(feeds, graphs=True, monkeypatch=None, optimizer=None):
    """(losses, persistables, the fake driver's counts) of small_net trained on `feeds`
    (with Momentum, or what optimizer() makes)."""
    if not graphs:
        monkeypatch.setenv("MINIGRAPH_CUDA_GRAPHS", "off")
    cuda = fake_pycuda.FakeCuda(devices=1)
    with cuda.install():
        place = mg.GPUPlace(0)
        opt = optimizer() if optimizer else mg.optimizer.Momentum(0.1, 0.9)
        net, _, loss = small_net(place, opt)
        losses = [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds]
        params = {p.name: place.to_host(p.value) for p in net.persistables()}
    monkeypatch.delenv("MINIGRAPH_CUDA_GRAPHS", raising=False)
    return losses, params, cuda.counts


def test_the_capture_allocator_lends_a_freed_block_of_at_most_twice_the_size():
    from minigraph.kernels.cuda import graphs

    taken = []

    def take(nbytes):
        taken.append(nbytes)
        return 4096 * len(taken)                # a block: its address

    a = graphs.CaptureAllocator(take)
    small, large = a(100), a(1000)
    del small, large                            # both back with the allocator
    reused = a(90)                              # the 100-byte block
    assert int(reused) == 4096 and taken == [100, 1000]
    fresh = a(400)                              # the 1000-byte one is too large for it
    assert taken == [100, 1000, 400] and int(fresh) == 3 * 4096
    again = a(600)
    assert int(again) == 2 * 4096 and taken == [100, 1000, 400]
    del again                                   # given back whole: 1000 bytes, not 600
    assert int(a(1000)) == 2 * 4096 and taken == [100, 1000, 400]
    assert len(a.blocks) == 3


def test_replayed_steps_equal_steps_run_op_by_op(monkeypatch):
    feeds = batches(7)
    got, got_params, counts = trained(feeds, True, monkeypatch)
    want, want_params, plain = trained(feeds, False, monkeypatch)
    assert got == want
    for name, value in want_params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
    assert counts["capture_begin"] == 1
    assert counts["graph_launch"] == 7 - 1 - replay.WARM_RUNS
    assert plain["graph_launch"] == 0
    assert counts["launch"] < plain["launch"]       # replayed kernels go through the graph


def test_gradient_merge_steps_are_replayed(monkeypatch):
    """Its sums are added and zeroed in place (add_inplace, fill_inplace): the steps that
    update and the steps that only add are two plans, each captured once."""
    def merged():
        return mg.optimizer.GradientMerge(mg.optimizer.AdamW(0.01, weight_decay=0.1), 2)

    feeds = batches(12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)      # no "runs op by op"
        got, got_state, counts = trained(feeds, True, monkeypatch, merged)
    want, want_state, _ = trained(feeds, False, monkeypatch, merged)
    assert got == want
    assert any(".merged_grad" in name for name in want_state)
    for name, value in want_state.items():
        np.testing.assert_array_equal(got_state[name], value, err_msg=name)
    assert counts["capture_begin"] == 2
    assert counts["graph_launch"] == 2 * (6 - 1 - replay.WARM_RUNS)


def test_a_replayed_gradient_merge_step_that_fails_changes_nothing():
    """The graph adds into the sums before the device's error flags are read: a step
    that fails there puts the sums and parameters back, on both plans."""
    cuda = fake_pycuda.FakeCuda(devices=1)
    with cuda.install():
        place = mg.GPUPlace(0)
        opt = mg.optimizer.GradientMerge(mg.optimizer.Momentum(0.1, 0.9), 2)
        net, _, loss = small_net(place, opt)
        feeds = batches(10)
        for f in feeds[:8]:
            net.train(feed=f, fetch=[loss])
        assert cuda.counts["capture_begin"] == 2
        for f in feeds[8:]:                       # one step that only adds, one that updates
            before = {v.name: place.to_host(v.value) for v in net.persistables()}
            bad = {**f, "label": f["label"].copy()}
            bad["label"][1] = 9
            launches = cuda.counts["graph_launch"]
            with pytest.raises(ValueError, match="outside"):
                net.train(feed=bad, fetch=[loss])
            assert cuda.counts["graph_launch"] == launches + 1
            for name, value in before.items():
                np.testing.assert_array_equal(place.to_host(net.var(name).value), value,
                                              err_msg=name)
            net.train(feed=f, fetch=[loss])


def test_the_gpt_examples_training_step_is_replayed(monkeypatch):
    """examples/train_gpt.py's recipe (GradientMerge(AdamW), clipping, dropout, a
    schedule) at a tiny size: both plans captured, each later step one graph launch and no
    kernel launched outside it, the losses those of steps run op by op."""
    from minigraph.examples import train_gpt as G

    cfg = G.Config(layers=1, heads=2, width=32, context=16)
    rng = np.random.default_rng(0)
    feeds = [{"tokens": rng.integers(0, 65, (2, 16)), "targets": rng.integers(0, 65, (2, 16))}
             for _ in range(10)]
    runs = []
    for graphs in (True, False):
        if not graphs:
            monkeypatch.setenv("MINIGRAPH_CUDA_GRAPHS", "off")
        cuda = fake_pycuda.FakeCuda(devices=1)
        with cuda.install(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            net, h = G.build_gpt(65, cfg, place=mg.GPUPlace(0))
            G.make_optimizer(cfg, 100).minimize(
                net, h["loss"], parameters=G.param_groups(net, cfg.weight_decay))
            losses = []
            for f in feeds:
                before = cuda.counts["launch"]
                losses.append(float(net.train(feed=f, fetch=[h["loss"]])[0]))
            runs.append((losses, cuda.counts["capture_begin"], cuda.counts["launch"] - before))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1:] == (2, 0)              # the last step: a graph launch only
    assert runs[1][1] == 0 and runs[1][2] > 0


def test_a_new_batch_size_is_captured_anew(monkeypatch):
    feeds = batches(5) + batches(5, n=6, seed=1)
    got, _, counts = trained(feeds, True, monkeypatch)
    want, _, _ = trained(feeds, False, monkeypatch)
    assert got == want
    assert counts["capture_begin"] == 2


def test_a_capture_that_fails_warns_and_changes_nothing(monkeypatch):
    real = activation.relu_gpu

    def reads_the_host(op, ins, ctx):
        ins["x"].get()                  # a host read inside the step: not capturable
        return real(op, ins, ctx)

    from minigraph.schema import get_schema

    kernels = get_schema("relu").kernels
    saved = kernels["gpu"]
    import dataclasses
    kernels["gpu"] = tuple(dataclasses.replace(k, fn=reads_the_host) for k in saved)
    try:
        feeds = batches(6)
        with pytest.warns(RuntimeWarning, match="capture failed .*not permitted when stream "
                                                "is capturing"):
            got, _, counts = trained(feeds, True, monkeypatch)
        want, _, _ = trained(feeds, False, monkeypatch)
    finally:
        kernels["gpu"] = saved
    assert got == want
    assert counts["graph_launch"] == 0


def test_a_parameter_set_from_outside_is_read(monkeypatch):
    cuda = fake_pycuda.FakeCuda(devices=1)
    feeds = batches(8)
    results = []
    for graphs in (True, False):
        if not graphs:
            monkeypatch.setenv("MINIGRAPH_CUDA_GRAPHS", "off")
        with cuda.install():
            place = mg.GPUPlace(0)
            net, _, loss = small_net(place, mg.optimizer.SGD(0.1))
            losses = [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds[:5]]
            w = net.parameters()[0]
            w.value = place.to_device(np.full(w.value.shape, 0.01, np.float32))
            losses += [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds[5:]]
        results.append(losses)
    assert results[0] == results[1]


def test_no_step_work_on_the_legacy_stream(monkeypatch):
    _, _, counts = trained(batches(5), True, monkeypatch)
    assert counts["legacy_stream"] == 0
