"""Host cost of the GPU dispatch path, on the fake PyCUDA driver (no GPU needed):
what makes it cheap must keep every contract.

- device arrays made from a model's attributes (the backend's array maker) are
  indistinguishable from PyCUDA-constructed ones and never share memory while
  alive; freed ones go back to the pool;
- launch plans (conv2d, matmul, batch norm, collective buckets, channel sums)
  are made once per geometry and still reject what the launchers rejected;
- temporaries that live only inside one launcher call (conv2d's columns, split
  partials) come from the per-thread scratch, not from arrays of their own;
- outputs of two steps are distinct arrays: nothing an op returns is handed out
  again while a Variable or a fetched value may hold it.
"""
from __future__ import annotations

import shutil

import kernel_emulator
import numpy as np
import pytest
from helpers import call_kernel
from kernel_emulator import fake_pycuda
from kernel_emulator.fake_memory import FakeArray
from op_harness import batches, small_net

import minigraph as mg
from minigraph import device
from minigraph.kernels.cuda import (
    batch_norm,
    batch_norm_grad,
    collective,
    conv2d,
    elementwise,
    loader,
    matmul,
)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


@pytest.fixture
def fake():
    cuda = fake_pycuda.FakeCuda(devices=1)
    with cuda.install():
        yield cuda


@pytest.fixture
def gpu(fake):
    place = mg.GPUPlace(0)
    with place.activate():
        yield place


def put(place, a):
    return place.to_device(np.asarray(a))


# ---- device arrays ---------------------------------------------------------------------

def test_made_arrays_match_constructed_ones_and_never_share_memory(fake, gpu):
    import pycuda.gpuarray as gpuarray

    state = device.current()
    model = gpuarray.empty((4, 3), np.dtype(np.float32), allocator=state.allocate)
    made = [loader.empty((4, 3), np.float32) for _ in range(3)]
    made.append(loader.empty((4, 3), np.dtype("float32")))       # the same maker, spelled anew
    model.flags                                                  # noqa: B018 - memoised
    for a in made:
        assert type(a) is type(model) and a.flags.c_contiguous
        assert {k: v for k, v in vars(a).items() if k not in ("gpudata", "_flags")} == \
            {k: v for k, v in vars(model).items() if k not in ("gpudata", "_flags")}
        assert vars(a).keys() == vars(model).keys()
    addresses = [int(a.gpudata) for a in [model, *made]]
    assert len(set(addresses)) == len(addresses)                 # all alive: all distinct
    assert len({id(a.gpudata) for a in made}) == len(made)
    np.testing.assert_array_equal(put(gpu, np.arange(12.0, dtype=np.float32).reshape(4, 3))
                                  .get(), np.arange(12.0).reshape(4, 3))
    before = fake.counts["mem_alloc"]
    del made
    again = [loader.empty((4, 3), np.float32) for _ in range(4)]
    assert fake.counts["mem_alloc"] == before                    # freed blocks came back
    assert loader.empty([4, 3], np.float32).shape == (4, 3)      # a list shape still works
    empty = loader.empty((0, 3), np.float64)
    assert empty.gpudata is None and empty.shape == (0, 3) and loader.ptr(empty) == 0
    assert len({int(a.gpudata) for a in again}) == 4


def test_a_group_is_one_allocation_freed_when_its_last_array_goes(fake, gpu):
    shapes = ((5,), (5,), (2, 3))
    state = device.current()
    calls = []
    real = state.allocate
    state.allocate = lambda n: calls.append(n) or real(n)         # a spy the makers call
    loader.empty_group(shapes, np.float32)                        # the maker exists now
    calls.clear()
    a, b, c = loader.empty_group(shapes, np.float32)
    held = sum(map(len, state.pool.held.values()))
    assert len(calls) == 1 and calls[0] == 3 * 256               # one block: 256-byte starts
    assert [x.shape for x in (a, b, c)] == [(5,), (5,), (2, 3)]
    assert all(x.dtype == np.float32 for x in (a, b, c))
    starts = [loader.ptr(x) for x in (a, b, c)]
    assert starts == [starts[0], starts[0] + 256, starts[0] + 512]
    for i, x in enumerate((a, b, c)):                             # views read and write
        x.set(np.full(x.shape, i, np.float32))
    for i, x in enumerate((a, b, c)):
        np.testing.assert_array_equal(x.get(), np.full(x.shape, i))
    np.testing.assert_array_equal(gpu.to_host(elementwise.copy(b)), np.full(5, 1.0))
    del a, c, x                                                   # b keeps the block
    assert sum(map(len, state.pool.held.values())) == held
    del b
    assert sum(map(len, state.pool.held.values())) == held + 1


def test_a_group_without_backend_support_is_made_array_by_array():
    with kernel_emulator.emulated_gpu():
        a, b = loader.empty_group(((3,), (3,)), np.float64)
        assert a.gpudata != b.gpudata and a.shape == b.shape == (3,)


def bn_net(place):
    from minigraph import layers

    net = mg.Net(place=place, seed=3)
    image = layers.data(net, "image", shape=(-1, 2, 6, 6))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, image, num_filters=4, filter_size=3, padding=1)
    h = layers.pool2d(net, layers.relu(net, layers.batch_norm(net, h)), 2)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(
        net, layers.fc(net, h, size=5), label))
    mg.optimizer.Momentum(learning_rate=0.1).minimize(net, loss)
    return net, loss


def test_a_batch_norm_net_trains_on_the_fake_driver_as_on_the_cpu(fake):
    """Every planned launcher, scratch buffer and grouped allocation of a conv + batch
    norm net, with the kernels run (emulated) and every pointer checked by the fake
    driver, against the CPU."""
    runs = []
    for place in (mg.GPUPlace(0), mg.CPUPlace()):
        net, loss = bn_net(place)
        losses = [float(net.train(feed=f, fetch=[loss])[0]) for f in batches(4)]
        state = {v.name: net.var(v.name).get() for v in net.persistables()}
        runs.append((losses, state))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-4)
    assert runs[0][1].keys() == runs[1][1].keys() >= {"batch_norm_0.estimated_var",
                                                      "batch_norm_0.num_batches"}
    for name, value in runs[0][1].items():
        np.testing.assert_allclose(value, runs[1][1][name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_model_of_an_array_maker_holds_no_device_memory(fake, gpu):
    """The maker keeps the model's attributes, flags memo included, and the fake's
    flags hold their array as PyCUDA's do: the model must have let its memory go."""
    state = device.current()
    allocs = fake.counts["mem_alloc"]
    a = loader.empty((7, 3), np.float64)
    assert a.flags.array is not a                       # the model's flags, shared
    assert fake.counts["mem_alloc"] == allocs + 1       # the model's block went on to `a`
    del a
    assert len(state.pool.held[7 * 3 * 8]) == 1


def test_arrays_outside_activate_push_the_context(fake):
    place = mg.GPUPlace(0)
    with place.activate():
        loader.empty((5,), np.float32)                           # the maker exists now
    pushes = fake.counts["push"]
    a = loader.empty((5,), np.float32)
    assert fake.counts["push"] == pushes + 1 and a.gpudata.ctx is place.context


def test_outputs_of_two_steps_are_distinct_arrays(fake):
    place = mg.GPUPlace(0)
    net, _, loss = small_net(place, mg.optimizer.Momentum(learning_rate=0.05))
    feeds = batches(3)
    net.train(feed=feeds[0], fetch=[loss])
    kept = {}
    for step, feed in enumerate(feeds[1:]):
        net.train(feed=feed, fetch=[loss])
        for name, var in net.scopes["train"].vars.items():
            if var.value is not None and hasattr(var.value, "gpudata"):
                kept[name, step] = var.value
    grads = [name for name, step in kept if step == 0 and name.endswith("@GRAD")]
    assert len(grads) >= 4                         # the parameters' gradients, kept by a step
    for name in grads:
        first, second = kept[name, 0], kept[name, 1]
        assert second is not first and int(second.gpudata) != int(first.gpudata), name
    live = [a for a in kept.values() if a.gpudata is not None]
    by_address = {}
    for a in live:
        by_address.setdefault(int(a.gpudata), set()).add(id(a))
    assert all(len(ids) == 1 for ids in by_address.values())    # no memory held twice


# ---- plans and scratch -------------------------------------------------------------------

def conv_inputs(place, rng, n=4):
    x = put(place, rng.standard_normal((n, 3, 6, 6)).astype(np.float32))
    w = put(place, rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    return x, w


def test_conv2d_plans_once_and_keeps_its_columns_in_scratch(fake, gpu, monkeypatch):
    calls = []
    real = conv2d.geometry
    monkeypatch.setattr(conv2d, "geometry", lambda *a, **k: calls.append(a) or real(*a, **k))
    rng = np.random.default_rng(0)
    x, w = conv_inputs(gpu, rng)
    first = conv2d.conv2d(x, w, paddings=1)
    made, allocs = FakeArray.made, fake.counts["mem_alloc"]
    second = conv2d.conv2d(x, w, paddings=1)
    assert FakeArray.made - made == 1                      # out: no columns array
    dout = put(gpu, rng.standard_normal(second.shape).astype(np.float32))
    conv2d.conv2d_grad(x, w, dout, paddings=1)
    grads, allocs = FakeArray.made, fake.counts["mem_alloc"]
    conv2d.conv2d_grad(x, w, dout, paddings=1)
    assert FakeArray.made - grads == 2                     # dx and dfilter: no columns array
    assert fake.counts["mem_alloc"] == allocs              # their blocks came back to the pool
    assert len(calls) == 2                                 # one plan forward, one backward
    assert second is not first and int(second.gpudata) != int(first.gpudata)
    np.testing.assert_array_equal(first.get(), second.get())
    state = device.current()
    assert len(state.scratch) == 1                         # one buffer for this thread


def test_scratch_is_handed_out_again_and_grows_only_when_needed(fake, gpu):
    a = loader.scratch(100, np.float32)
    assert loader.scratch(50, np.float64) == a              # 400 bytes fit: the same buffer
    bigger = loader.scratch(10**6, np.float32)
    assert loader.scratch(10, np.float32) == bigger
    (buffer,) = device.current().scratch.values()
    assert buffer.nbytes >= 4 * 10**6


def test_plans_still_reject_what_the_launchers_rejected():
    with kernel_emulator.emulated_gpu():
        x = kernel_emulator.to_device(np.ones((2, 3, 5, 5), np.float32))
        w = kernel_emulator.to_device(np.ones((4, 3, 3, 3), np.float32))
        conv2d.conv2d(x, w)                                         # plans this geometry
        strided = kernel_emulator.to_device(np.ones((2, 3, 5, 5), np.float32))
        strided.flags.c_contiguous = False
        with pytest.raises(ValueError, match=r"conv2d: x: a float32\(2, 3, 5, 5\) .* not C-"):
            conv2d.conv2d(strided, w)
        with pytest.raises(ValueError, match=r"conv2d_grad: dout must be float32 of shape"):
            conv2d.conv2d_grad(x, w, kernel_emulator.to_device(np.ones((2, 4, 4, 4),
                                                                       np.float32)))
        w64 = kernel_emulator.to_device(np.ones((4, 3, 3, 3)))
        with pytest.raises(ValueError, match=r"conv2d: filter must be float32"):
            conv2d.conv2d(x, w64)
        a = kernel_emulator.to_device(np.ones((6, 5), np.float32))
        b = kernel_emulator.to_device(np.ones((5, 2), np.float32))
        matmul.mul(a, b)
        with pytest.raises(ValueError, match=r"mul: y must be \(5, M\)"):
            matmul.mul(a, kernel_emulator.to_device(np.ones((4, 2), np.float32)))
        bad = kernel_emulator.to_device(np.ones((5, 2), np.float32))
        bad.flags.c_contiguous = False
        with pytest.raises(ValueError, match=r"mul_grad: y: a float32\(5, 2\) .* not C-"):
            matmul.mul_grad(a, bad, kernel_emulator.to_device(np.ones((6, 2), np.float32)))
        c = kernel_emulator.to_device(np.ones(3, np.float32))
        counter = kernel_emulator.to_device(np.array(0, np.int64))
        batch_norm.forward_train(x, c, c, c, c, counter, 0.9, 1e-5)
        with pytest.raises(ValueError, match=r"batch_norm: 'bias' must be float32 of shape"):
            batch_norm.forward_train(x, c, kernel_emulator.to_device(np.ones(4, np.float32)),
                                     c, c, counter, 0.9, 1e-5)
        with pytest.raises(ValueError, match=r"batch_norm: counter must be an int64 scalar"):
            batch_norm.forward_train(x, c, c, c, c, c, 0.9, 1e-5)
        with pytest.raises(ValueError, match=r"batch_norm_grad: dy must match x"):
            batch_norm_grad.backward(x, w, c, c, c, 1e-5)
        parts = [kernel_emulator.to_device(np.ones(s, np.float32)) for s in ((2, 3), (4,))]
        flat = collective.pack(parts)
        with pytest.raises(ValueError, match=r"pack: array 1 is float64, expected float32"):
            collective.pack([parts[0], kernel_emulator.to_device(np.ones(4))])
        with pytest.raises(ValueError, match=r"unpack_scaled: flat holds 10 values, the shapes"):
            collective.unpack_scaled(flat, [(2, 3), (5,)])


def test_buckets_pack_and_unpack_more_arrays_than_one_launch_takes():
    rng = np.random.default_rng(3)
    shapes = [(3, 2), (0,), (5,), (1, 1, 4)] * 3 + [(7,)]         # 13 arrays, 3 empty
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    with kernel_emulator.emulated_gpu():
        arrays = [kernel_emulator.to_device(v) for v in values]
        for _ in range(2):                                           # planned, then reused
            flat = collective.pack(arrays)
            np.testing.assert_array_equal(flat.get(),
                                          np.concatenate([v.ravel() for v in values]))
            outs = collective.unpack_scaled(flat, shapes, 0.5)
            for o, v in zip(outs, values, strict=True):
                np.testing.assert_allclose(o.get(), v * 0.5, rtol=1e-7)


def test_channel_sum_partials_come_from_scratch(fake, gpu):
    rng = np.random.default_rng(1)
    d = rng.standard_normal((64, 5, 33)).astype(np.float32)
    dev = put(gpu, d)
    elementwise.channel_sum(dev, 64, 5, 33)
    made = FakeArray.made
    out = elementwise.channel_sum(dev, 64, 5, 33)
    assert FakeArray.made - made == 1                              # the output only
    np.testing.assert_allclose(out.get(), d.sum(axis=(0, 2)), rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1, 1)])
def test_the_gpu_binding_still_names_a_batch_of_one_value_per_channel(shape):
    """The binding no longer computes n before launching: the launcher's ValueError
    (raised before anything is written) becomes batch_norm's own OpError."""
    from minigraph.schema import OpError

    with kernel_emulator.emulated_gpu() as place:
        scope = mg.Scope()
        slots = {n: scope.new_var(n) for n in ("x", "scale", "bias", "estimated_mean",
                                                 "estimated_var", "y", "batch_mean",
                                                 "batch_var")}
        op = mg.Operator("batch_norm", **slots, saved_mean=slots["estimated_mean"],
                         saved_var=slots["estimated_var"])
        ones = place.to_device(np.ones(3, np.float32))
        ins = {"x": place.to_device(np.ones(shape, np.float32)), "scale": ones, "bias": ones,
               "estimated_mean": ones, "estimated_var": ones}
        with pytest.raises(OpError, match=r"batch_norm: training needs more than one value "
                                          r"per channel, got n=1"):
            call_kernel(op, ins, "gpu", place=place)
        ins["scale"] = place.to_device(np.ones(4, np.float32))      # other errors pass through
        ins["x"] = place.to_device(np.ones((2, 3), np.float32))
        with pytest.raises(ValueError, match=r"batch_norm: 'scale' must be float32 of shape"):
            call_kernel(op, ins, "gpu", place=place)


def test_allreduce_scaled_packs_reduces_and_unpacks_once():
    rng = np.random.default_rng(4)
    shapes = [(3, 2), (0,), (5,)] * 4                                # 12 arrays, 2 launches
    values = [rng.standard_normal(s) for s in shapes]
    with kernel_emulator.emulated_gpu():
        arrays = [kernel_emulator.to_device(v) for v in values]
        seen = []

        def twice(flat):                                             # a two-rank sum
            seen.append(flat.get())
            return collective.scaled(flat, 2.0)

        outs = collective.allreduce_scaled(arrays, twice, 0.25)
        np.testing.assert_array_equal(seen[0], np.concatenate([v.ravel() for v in values]))
        assert all(o is not a for o, a in zip(outs, arrays, strict=True))
        for o, v in zip(outs, values, strict=True):
            np.testing.assert_allclose(o.get(), v * 0.5, rtol=1e-15)
        same = collective.allreduce_scaled(arrays, twice, 0.25, in_place=True)
        assert all(o is a for o, a in zip(same, arrays, strict=True))
        for a, v in zip(arrays, values, strict=True):
            np.testing.assert_allclose(a.get(), v * 0.5, rtol=1e-15)
        with pytest.raises(ValueError, match=r"allreduce_scaled: the allreduce returned float64"):
            collective.allreduce_scaled(arrays, lambda flat: collective.pack(arrays[:1]), 1.0)


def test_fill_remembers_bits_without_mixing_up_values():
    from minigraph.kernels.cuda import fill

    with kernel_emulator.emulated_gpu():
        a = kernel_emulator.to_device(np.ones(5, np.float32))
        for value in (0.0, -0.0, 0, False, 1.5, 2, True, 1.5, -0.0):
            got = fill.fill_constant(a, value).get()
            want = np.full(5, value, np.float32)
            assert got.tobytes() == want.tobytes(), value              # -0.0 keeps its sign
        ints = kernel_emulator.to_device(np.zeros(3, np.int32))
        np.testing.assert_array_equal(fill.fill_constant(ints, 2.7).get(), np.full(3, 2))
        np.testing.assert_array_equal(fill.fill_constant(ints, np.float64(-3.2)).get(),
                                      np.full(3, -3))


def test_mean_and_pooling_plan_once_and_make_only_their_outputs(fake, gpu, monkeypatch):
    from minigraph.kernels.cuda import mean, pool2d

    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    dx = put(gpu, x)
    mean.mean(dx)
    pool2d.pool2d(dx, "max", 2)
    calls = []
    real = pool2d.geometry
    monkeypatch.setattr(pool2d, "geometry", lambda *a, **k: calls.append(a) or real(*a, **k))
    made = FakeArray.made
    m = mean.mean(dx)
    p = pool2d.pool2d(dx, "max", 2)
    g = pool2d.pool2d_grad(dx, p, "max", 2)
    assert FakeArray.made - made == 3 and not calls         # outputs only; no new geometry
    np.testing.assert_allclose(m.get(), x.mean(), rtol=1e-5)
    np.testing.assert_array_equal(p.get(), x.reshape(2, 3, 4, 2, 4, 2).max(axis=(3, 5)))
    assert g.shape == x.shape
    pool2d.pool2d(dx, "max", [2, 2])                        # an unhashable ksize still works
    assert len(calls) == 1
