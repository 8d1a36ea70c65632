"""The GPU bindings of the layer and optimizer ops of issue 9, through the real
Executor, against the same ops on the CPU: on the kernel emulator (runs here)
and, marked gpu, a real GPU (the harness: tests/gpu/op_harness.py).
Forward and every grad, float32 and float64, odd sizes, broadcasting both
ways; dropout's masks and step counter bit for bit; device error flags raised
at fetch; the in-place optimizer updates step for step."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import call_kernel
from op_harness import assert_close, labels, r, run_op

import minigraph as mg
from minigraph.schema import get_schema

F64 = np.float64
XY = (("x", "y"), ("x",), ("y",))
LR32 = np.array(0.05, np.float32)
CASES = {
    "add-both-ways-f32": ("add", {"x": r(4, 1, 5), "y": r(3, 1)}, {}, XY),
    "add-bias-f64": ("add", {"x": r(2, 3, 4, 5, dtype=F64), "y": r(3, 1, 1, dtype=F64)}, {}, XY),
    "add-same-f32": ("add", {"x": r(3, 7), "y": r(3, 7, seed=1)}, {}, XY),
    "add-scalar-f64": ("add", {"x": r(5, dtype=F64), "y": np.array(1.5)}, {}, XY),
    "add-kept-inner-f32": ("add", {"x": r(2, 1, 6), "y": r(2, 4, 6, seed=2)}, {}, XY),
    "multiply-both-ways-f64": ("multiply", {"x": r(1, 3, 5, dtype=F64), "y": r(4, 1, 5, dtype=F64)},
                               {}, XY),
    "multiply-rows-f32": ("multiply", {"x": r(9, 33), "y": r(9, 1, seed=3)}, {}, XY),
    "multiply-same-f32": ("multiply", {"x": r(2, 5), "y": r(2, 5, seed=4)}, {}, XY),
    "concat-axis1-f32": ("concat", {"x": [r(2, 3, 4), r(2, 5, 4, seed=1), r(2, 1, 4, seed=2)]},
                         dict(axis=1), (("x",),)),
    "concat-neg-f64": ("concat", {"x": [r(3, 2, dtype=F64), r(3, 7, dtype=F64, seed=1)]},
                       dict(axis=-1), (("x",),)),
    "concat-axis0-int64": ("concat", {"x": [np.arange(6).reshape(2, 3),
                                            np.arange(3).reshape(1, 3)]}, {}, ()),
    "reshape-f32": ("reshape", {"x": r(2, 3, 4)}, dict(shape=(4, -1)), (("x",),)),
    "reshape-f64": ("reshape", {"x": r(5, 6, dtype=F64)}, dict(shape=(3, 10)), (("x",),)),
    "reshape-int64": ("reshape", {"x": np.arange(12)}, dict(shape=(3, 4)), ()),
    "flatten-f32": ("flatten", {"x": r(2, 3, 4, 5)}, {}, (("x",),)),
    "flatten-mid-f64": ("flatten", {"x": r(2, 3, 4, 5, dtype=F64)},
                        dict(start_axis=1, stop_axis=2), (("x",),)),
    "transpose-f32": ("transpose", {"x": r(2, 3, 5)}, dict(perm=(2, 0, 1)), (("x",),)),
    "transpose-4d-f64": ("transpose", {"x": r(2, 3, 4, 5, dtype=F64)}, dict(perm=(0, 2, 1, 3)),
                         (("x",),)),
    "sigmoid-f32": ("sigmoid", {"x": r(3, 17) * 10}, {}, (("x",),)),
    "sigmoid-f64": ("sigmoid", {"x": r(7, dtype=F64) * 40}, {}, (("x",),)),
    "tanh-f32": ("tanh", {"x": r(5, 9)}, {}, (("x",),)),
    "tanh-f64": ("tanh", {"x": r(11, dtype=F64)}, {}, (("x",),)),
    "gelu-f32": ("gelu", {"x": r(4, 13) * 3}, {}, (("x",),)),
    "gelu-f64": ("gelu", {"x": r(2, 9, dtype=F64) * 3}, {}, (("x",),)),
    "leaky_relu-f32": ("leaky_relu", {"x": r(6, 5)}, dict(alpha=0.1), (("x",),)),
    "leaky_relu-f64": ("leaky_relu", {"x": r(13, dtype=F64)}, {}, (("x",),)),
    "softmax-last-f32": ("softmax", {"x": r(5, 11) * 10}, {}, (("x",),)),
    "softmax-mid-f64": ("softmax", {"x": r(2, 7, 3, dtype=F64)}, dict(axis=1), (("x",),)),
    "softmax-first-f32": ("softmax", {"x": r(4, 3, 2)}, dict(axis=0), (("x",),)),
    "argmax-last-f32": ("argmax", {"x": r(6, 9)}, {}, ()),
    "argmax-mid-f64": ("argmax", {"x": r(3, 5, 4, dtype=F64)}, dict(axis=1), ()),
    "accuracy-f32": ("accuracy", {"logits": r(20, 4), "label": labels(20, 4)}, {}, ()),
    "accuracy-f64": ("accuracy", {"logits": r(7, 3, dtype=F64), "label": labels(7, 3)}, {}, ()),
    "dropout-train-f32": ("dropout", {"x": r(5, 13), "step": np.array(3, np.int64)},
                          dict(p=0.3, seed=11), (("x",),)),
    "dropout-train-f64": ("dropout", {"x": r(4, 8, dtype=F64), "step": np.array(0, np.int64)},
                          dict(p=0.6, seed=2**32 - 1), (("x",),)),
    "dropout-p0-f32": ("dropout", {"x": r(9), "step": np.array(1, np.int64)}, dict(p=0.0),
                       (("x",),)),
    "sgd-decay-f32": ("sgd", {"param": r(3, 5), "grad": r(3, 5, seed=1), "learning_rate": LR32},
                      dict(weight_decay=0.01), ()),
    "momentum-decay-nesterov-f64": ("momentum", {"param": r(4, 3, dtype=F64),
                                                 "grad": r(4, 3, dtype=F64, seed=1),
                                                 "velocity": r(4, 3, dtype=F64, seed=2),
                                                 "learning_rate": LR32},
                                    dict(mu=0.9, use_nesterov=True, weight_decay=0.1), ()),
}


def adam_inputs(dtype, shape=(3, 7)):
    return {"param": r(*shape, dtype=dtype), "grad": r(*shape, dtype=dtype, seed=1),
            "moment1": r(*shape, dtype=dtype, seed=2) * 0.1,
            "moment2": np.abs(r(*shape, dtype=dtype, seed=3)) * 0.01,
            "beta1_pow": np.array(0.9), "beta2_pow": np.array(0.999),
            "learning_rate": np.array(1e-3, np.float32)}


CASES.update({
    "adam-f32": ("adam", adam_inputs(np.float32), {}, ()),
    "adam-l2-f64": ("adam", adam_inputs(F64, (11,)), dict(weight_decay=0.05), ()),
    "adamw-f32": ("adam", adam_inputs(np.float32, (2, 9)),
                  dict(weight_decay=0.01, decoupled=True), ()),
    "lr-step": ("lr_schedule", {"step": np.array(7, np.int64)},
                dict(kind="step", base_lr=0.1, step_size=3, gamma=0.5), ()),
    "lr-cosine-warmup": ("lr_schedule", {"step": np.array(1, np.int64)},
                         dict(kind="cosine", base_lr=0.1, total_steps=10, warmup_steps=3), ()),
    "lr-cosine": ("lr_schedule", {"step": np.array(6, np.int64)},
                  dict(kind="cosine", base_lr=0.1, total_steps=10, end_lr=0.01), ()),
})


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_and_its_grads_match_the_cpu(device_place, case):
    op_type, inputs, attrs, grad_sets = CASES[case]
    want, want_grads = run_op(mg.CPUPlace(), op_type, inputs, attrs, grad_sets)
    got, got_grads = run_op(device_place, op_type, inputs, attrs, grad_sets)
    assert set(got) == set(want)
    for slot in want:
        if isinstance(want[slot], list):
            for i, (g, w) in enumerate(zip(got[slot], want[slot], strict=True)):
                assert_close(g, w, f"{case}: output {slot}[{i}]")
        else:
            assert_close(got[slot], want[slot], f"{case}: output {slot!r}")
    for wanted in grad_sets:
        assert set(got_grads[wanted]) == set(want_grads[wanted])
        for name in want_grads[wanted]:
            assert_close(got_grads[wanted][name], want_grads[wanted][name],
                         f"{case}: d/d {name} (grads asked for {wanted})")


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
