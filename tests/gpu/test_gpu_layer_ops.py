"""The GPU kernels of the layer and optimizer ops beyond their registry cases
(test_gpu_ops.py), through the real Executor, against the same ops on the CPU: on
the kernel emulator (runs here) and, marked gpu, a real GPU (the harness:
tests/gpu/op_harness.py). Dropout's masks and step counter bit for bit; device
error flags raised at fetch; the in-place optimizer updates step for step."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import call_kernel
from op_harness import assert_close, r, run_op

import minigraph as mg
from minigraph.schema import get_schema

F64 = np.float64
def test_dropout_masks_and_steps_are_the_cpus_over_several_steps(device_place):
    """The mask output is bit for bit the CPU's, and the step counter (in place)
    moves the same way, so the next masks differ the same way."""
    outs = {}
    for place in (mg.CPUPlace(), device_place):
        scope = mg.Scope()
        x, step = scope.new_var("x"), scope.new_var("step")
        out, mask = scope.new_var("out"), scope.new_var("mask")
        x.set(place.to_device(r(6, 11)))
        step.set(place.to_device(np.array(0, np.int64)))
        op = mg.Operator("dropout", x=x, step=step, out=out, mask=mask, step_out=step, p=0.4,
                         seed=99)
        ex = mg.Executor(place)
        outs[place.kind] = [[np.array(v, copy=True)          # the CPU's step is updated in place
                             for v in ex.run([op], scope, fetch=[mask, out, step])]
                            for _ in range(3)]
    for cpu, gpu in zip(outs["cpu"], outs["gpu"], strict=True):
        for a, b in zip(cpu, gpu, strict=True):
            np.testing.assert_array_equal(b, a)
    assert not np.array_equal(outs["cpu"][0][0], outs["cpu"][1][0])
    assert [int(run[2]) for run in outs["gpu"]] == [1, 2, 3]


def test_dropout_infer_is_a_copy_and_its_grad_passes_dout(device_place):
    scope = mg.Scope()
    x, step, out, dx = (scope.new_var(n) for n in ("x", "step", "out", "dx"))
    d = scope.new_var("d")
    x.set(device_place.to_device(r(3, 5)))
    d.set(device_place.to_device(r(3, 5, seed=1)))
    step.set(device_place.to_device(np.array(4, np.int64)))
    ops = [mg.Operator("dropout", x=x, step=step, out=out, step_out=step, p=0.5, is_infer=True),
           mg.Operator("dropout_grad", dout=d, dx=dx, p=0.5, is_infer=True)]
    got_out, got_step, got_dx = mg.Executor(device_place).run(ops, scope, fetch=[out, step, dx])
    np.testing.assert_array_equal(got_out, r(3, 5))
    np.testing.assert_array_equal(got_dx, r(3, 5, seed=1))
    assert int(got_step) == 4 and out.value is not x.value


@pytest.mark.parametrize("op_type,inputs,attrs,skipped", [
    ("add_grad", {"x": r(2, 1), "y": r(1, 3), "dout": r(2, 3)}, {}, "dx"),
    ("add_grad", {"x": r(2, 1), "y": r(1, 3), "dout": r(2, 3)}, {}, "dy"),
    ("multiply_grad", {"x": r(2, 1), "y": r(1, 3), "dout": r(2, 3)}, {}, "dx"),
    ("multiply_grad", {"x": r(2, 1), "y": r(1, 3), "dout": r(2, 3)}, {}, "dy"),
    ("sigmoid_grad", {"out": r(4), "dout": r(4)}, {}, "dx"),
    ("softmax_grad", {"out": r(2, 4), "dout": r(2, 4)}, {}, "dx"),
    ("transpose_grad", {"dout": r(2, 4)}, dict(perm=(1, 0)), "dx"),
    ("reshape_grad", {"x": r(2, 4), "dout": r(8)}, {}, "dx"),
])
def test_unbound_grad_outputs_are_not_computed(device_place, op_type, inputs, attrs, skipped):
    schema = get_schema(op_type)
    scope = mg.Scope()
    kwargs = {}
    for slot, value in inputs.items():
        kwargs[slot] = scope.new_var(slot)
        kwargs[slot].set(device_place.to_device(value))
    outs = {s.name: scope.new_var(s.name) for s in schema.outputs if s.name != skipped}
    op = mg.Operator(op_type, **kwargs, **outs, **attrs)
    ins = {slot: var.value for slot, var in kwargs.items()}
    assert set(call_kernel(op, ins, "gpu", place=device_place)) == set(outs)


def test_bad_accuracy_labels_raise_at_the_fetch(device_place):
    scope = mg.Scope()
    logits, label, out = scope.new_var("logits"), scope.new_var("label"), scope.new_var("out")
    logits.set(device_place.to_device(r(4, 3)))
    label.set(device_place.to_device(np.array([0, 3, 1, -2], np.int64)))
    ex = mg.Executor(device_place)
    op = mg.Operator("accuracy", logits=logits, label=label, out=out)
    ex.run([op], scope)                                  # nothing fetched: nothing read back
    with pytest.raises(ValueError, match=r"accuracy: input 'label' had 4 value\(s\) outside "
                                         r"\[0, K\)"):                  # both runs' rows
        ex.run([op], scope, fetch=[out])
    label.set(device_place.to_device(np.array([0, 2, 1, 0], np.int64)))
    (value,) = ex.run([op], scope, fetch=[out])          # reported once, then clear
    assert 0 <= float(value) <= 1


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_in_place_matches_the_cpu(device_place, max_norm):
    values = [r(3, 5) * 3, r(7, dtype=F64, seed=1), r(0, 2, seed=2)]
    results = {}
    for place in (mg.CPUPlace(), device_place):
        scope = mg.Scope()
        xs = [scope.new_var(f"x{i}") for i in range(len(values))]
        for v, a in zip(xs, values, strict=True):
            v.set(place.to_device(a))
        originals = [v.value for v in xs]
        op = mg.Operator("clip_by_global_norm", x=xs, out=xs, max_norm=max_norm)
        results[place.kind] = mg.Executor(place).run([op], scope, fetch=xs)
        if place.kind == "gpu":
            assert all(v.value is o for v, o in zip(xs, originals, strict=True))
    for i, (g, w) in enumerate(zip(results["gpu"], results["cpu"], strict=True)):
        assert_close(g, w, f"clip: x[{i}]")


def test_clip_into_other_variables_leaves_x_alone(device_place):
    scope = mg.Scope()
    xs = [scope.new_var(f"x{i}") for i in range(2)]
    outs = [scope.new_var(f"o{i}") for i in range(2)]
    values = [r(3, 4) * 10, r(5, seed=1) * 10]
    for v, a in zip(xs, values, strict=True):
        v.set(device_place.to_device(a))
    op = mg.Operator("clip_by_global_norm", x=xs, out=outs, max_norm=1.0)
    got = mg.Executor(device_place).run([op], scope, fetch=outs + xs)
    total = np.sqrt(sum(float((a.astype(F64) ** 2).sum()) for a in values))
    for i, a in enumerate(values):
        np.testing.assert_allclose(got[i], a * np.float32(1.0 / (total + 1e-6)), rtol=1e-6)
        np.testing.assert_array_equal(got[2 + i], a)


def test_reshape_any_dtype_on_the_device(device_place):
    for dtype in (np.float16, np.int32, np.uint8, np.bool_):
        x = (np.arange(12) % 5).astype(dtype)
        outs, _ = run_op(device_place, "transpose", {"x": x.reshape(3, 4)}, dict(perm=(1, 0)))
        np.testing.assert_array_equal(outs["out"], x.reshape(3, 4).T)
        outs, _ = run_op(device_place, "reshape", {"x": x}, dict(shape=(2, 6)))
        np.testing.assert_array_equal(outs["out"], x.reshape(2, 6))


# ---- a net of the new layers, trained on both places -------------------------------------


def new_layers_net(place, optimizer, seed=3):
    """fc -> gelu -> dropout -> (concat with a tanh branch) -> reshape/transpose round trip
    -> add a sigmoid-gated residual -> leaky_relu -> fc -> softmax_with_cross_entropy."""
    from minigraph import layers

    net = mg.Net(place=place, seed=seed)
    x = layers.data(net, "x", shape=(-1, 12))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.dropout(net, layers.gelu(net, layers.fc(net, x, size=8)), p=0.25)
    t = layers.tanh(net, layers.fc(net, x, size=4))
    h = layers.concat(net, [h, t], axis=1)                                   # (N, 12)
    h = layers.transpose(net, layers.reshape(net, h, (-1, 3, 4)), (0, 2, 1))  # (N, 4, 3)
    h = layers.flatten(net, layers.transpose(net, h, (0, 2, 1)))             # (N, 12)
    gate = layers.sigmoid(net, layers.fc(net, h, size=12))
    h = layers.leaky_relu(net, layers.add(net, layers.multiply(net, h, gate), x), alpha=0.1)
    logits = layers.fc(net, h, size=5)
    probs = layers.softmax(net, logits)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    acc = layers.accuracy(net, logits, label)
    optimizer.minimize(net, loss)
    return net, loss, probs, acc


def train_new_layers(place, make_optimizer, steps=4):
    net, loss, probs, acc = new_layers_net(place, make_optimizer())
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((6, 12)).astype(np.float32),
              "label": rng.integers(0, 5, 6).astype(np.int64)} for _ in range(steps + 1)]
    losses = [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds[:steps]]
    p, a = net.infer(feed=feeds[-1], fetch=[probs, acc])
    persist = {v.name: np.array(v.get(), copy=True) for v in net.persistables()}
    return losses, p, a, persist


@pytest.mark.parametrize("make_optimizer", [
    lambda: mg.optimizer.Adam(learning_rate=mg.optimizer.lr.CosineDecay(0.01, total_steps=3,
                                                                        warmup_steps=1),
                              grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.5)),
    lambda: mg.optimizer.AdamW(learning_rate=0.01, weight_decay=0.1),
    lambda: mg.optimizer.Momentum(learning_rate=mg.optimizer.lr.StepDecay(0.05, 2, 0.5),
                                  weight_decay=0.01, nesterov=True),
    lambda: mg.optimizer.SGD(learning_rate=0.1, weight_decay=0.01,
                             grad_clip=mg.optimizer.ClipGradByGlobalNorm(1.0)),
], ids=["adam-cosine-clip", "adamw", "momentum-step-decay", "sgd-clip"])
def test_new_layers_net_trains_like_on_the_cpu(device_place, make_optimizer):
    want_losses, want_p, want_acc, want_state = train_new_layers(mg.CPUPlace(), make_optimizer)
    got_losses, got_p, got_acc, got_state = train_new_layers(device_place, make_optimizer)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_close(got_p, want_p, "infer probabilities")
    assert got_acc == want_acc
    assert set(got_state) == set(want_state)
    for name, want in want_state.items():
        if want.dtype.kind == "f":
            np.testing.assert_allclose(got_state[name], want, rtol=1e-4, atol=1e-6,
                                       err_msg=name)
        else:                                        # step counters: dropout's, the schedule's
            np.testing.assert_array_equal(got_state[name], want, err_msg=name)


def test_a_step_of_the_new_layers_reads_nothing_back(monkeypatch):
    """With Adam, clipping and a schedule, a training step copies only its two feeds
    to the device and reads back only the device error flags (one small read each,
    which every training step makes): the schedule, the clipping coefficient, the
    beta powers and dropout's counter stay on the device."""
    import shutil

    import kernel_emulator

    from minigraph import device

    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernel emulator")
    with kernel_emulator.emulated_gpu() as emu:
        opt = mg.optimizer.Adam(learning_rate=mg.optimizer.lr.CosineDecay(0.01, total_steps=5),
                                grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.5))
        net, loss, _, _ = new_layers_net(emu, opt)
        rng = np.random.default_rng(1)
        feed = {"x": rng.standard_normal((6, 12)).astype(np.float32),
                "label": rng.integers(0, 5, 6).astype(np.int64)}
        net.train(feed=feed, fetch=[loss])
        moved = {"in": 0, "out": 0}
        real_get, real_set = kernel_emulator.EmuArray.get, kernel_emulator.EmuArray.set

        def counting_get(self):
            moved["out"] += 1
            return real_get(self)

        def counting_set(self, values):
            moved["in"] += 1
            return real_set(self, values)

        monkeypatch.setattr(kernel_emulator.EmuArray, "get", counting_get)
        monkeypatch.setattr(kernel_emulator.EmuArray, "set", counting_set)
        net.train(feed=feed)
        flags = device.current().flags
        assert "accuracy" in flags
        assert moved == {"in": 2, "out": len(flags)}


def test_average_pooling_trains_on_a_stand_in_like_on_the_cpu(device_place):
    """A training step gives average pooling's gradient a stand-in for x (the values
    dropped after the forward; Slot.shape_only): on the device, as on the CPU, the
    gradient comes from the shapes and the step ends where the CPU's does."""
    from minigraph import layers

    def train(place):
        net = mg.Net(place=place, seed=5)
        x = layers.data(net, "x", shape=(-1, 3, 6, 6))
        label = layers.data(net, "label", shape=(-1,), dtype="int64")
        h = layers.silu(net, layers.conv2d(net, x, 4, 3, padding=1))
        h = layers.pool2d(net, h, pool_size=3, pool_stride=2, pool_padding=1, pool_type="avg")
        logits = layers.fc(net, layers.flatten(net, h), size=5)
        loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
        mg.optimizer.SGD(learning_rate=0.1).minimize(net, loss)
        rng = np.random.default_rng(0)
        losses = [float(net.train(feed={"x": rng.standard_normal((4, 3, 6, 6)).astype(np.float32),
                                        "label": rng.integers(0, 5, 4)}, fetch=[loss])[0])
                  for _ in range(3)]
        return losses, {v.name: np.array(v.get(), copy=True) for v in net.persistables()}

    want_losses, want_state = train(mg.CPUPlace())
    got_losses, got_state = train(device_place)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for name, want in want_state.items():
        np.testing.assert_allclose(got_state[name], want, rtol=1e-4, atol=1e-6, err_msg=name)
