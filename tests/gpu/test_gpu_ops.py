"""The ops' GPU kernels, through the real Executor, against the CPU kernels.

The cases come from the registry (OpSchema.examples, declared in each op's module).
Every case runs on two GPU places and is compared with the same op on the CPU:
- "emulated": `EmuPlace` (tests/kernel_emulator): kind "gpu", so the
  Executor picks the GPU bindings, which run the real launchers and the real
  .cu kernels compiled with g++; arrays are host buffers shaped like GPUArrays.
  Runs wherever g++ exists.
- "gpu" (marker `gpu`): GPUPlace(0) through PyCUDA; skipped without a GPU.
Also: a small net trains with the CPU's losses, nothing but feeds and fetches
(and the device error flags) crosses between host and device in a step, and
errors flagged on the device raise at fetch time.
"""
from __future__ import annotations

import shutil
import types

import kernel_emulator
import numpy as np
import pytest
from helpers import call_kernel
from op_harness import assert_close, batches, is_device_array, labels, r, run_op, small_net

import minigraph as mg
from minigraph import device
from minigraph.schema import get_schema, registered_ops

EXAMPLES = types.SimpleNamespace(r=r, labels=labels)
CASES = {f"{t}-{name}": (t, inputs, attrs, grads) for t in registered_ops()
         if get_schema(t).examples for name, inputs, attrs, grads in get_schema(t).examples(EXAMPLES)}
# ops whose GPU kernels other tests check against the CPU (their slots do not fit run_op)
TESTED_ELSEWHERE = {
    "clip_by_global_norm": "test_gpu_layer_ops.py (a list in, the same list out, in place)",
    "c_allreduce_avg": "test_nccl.py and test_gpu_dispatch.py (one world, two ranks)",
    "c_avg_presummed": "test_gpu_sync_batch_norm.py (test_c_avg_presummed_matches_the_cpu)",
    "c_scale_by_batch_share": "test_gpu_sync_batch_norm.py (uneven batches, mpiexec)",
}


def test_every_op_with_a_gpu_kernel_has_cases():
    """The cases come from the registry (OpSchema.examples): a new op with a GPU kernel
    is compared with the CPU once it declares examples, and this fails until it does;
    a grad op is covered by its forward's cases that ask for gradients."""
    for op_type in registered_ops():
        if "gpu" not in get_schema(op_type).kernels or op_type in TESTED_ELSEWHERE or \
                op_type.startswith("test_"):                  # the tests' own ops
            continue
        forward = get_schema(op_type[:-len("_grad")]) if op_type.endswith("_grad") else None
        if forward is not None:
            assert forward.examples and any(grads for *_, grads in forward.examples(EXAMPLES)), \
                f"{op_type}: no case of {forward.type} asks for gradients"
        else:
            assert get_schema(op_type).examples, f"{op_type}: no examples (OpSchema.examples)"


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_and_its_grads_match_the_cpu(device_place, case):
    op_type, inputs, attrs, grad_sets = CASES[case]
    want, want_grads = run_op(mg.CPUPlace(), op_type, inputs, attrs, grad_sets)
    got, got_grads = run_op(device_place, op_type, inputs, attrs, grad_sets)
    assert set(got) == set(want)
    for slot in want:
        assert_close(got[slot], want[slot], f"{case}: output {slot!r}")
    for wanted in grad_sets:
        assert set(got_grads[wanted]) == set(want_grads[wanted])
        for name in want_grads[wanted]:
            assert_close(got_grads[wanted][name], want_grads[wanted][name],
                         f"{case}: d/d {name} (grads asked for {wanted})")


def test_softmax_grad_from_the_loss_alone(device_place):
    inputs = {"logits": r(6, 4), "label": labels(6, 4)}
    args = ("softmax_with_cross_entropy", inputs, {}, (("logits",),), ("loss",))
    want, want_grads = run_op(mg.CPUPlace(), *args)
    got, got_grads = run_op(device_place, *args)
    assert_close(got_grads[("logits",)]["logits"], want_grads[("logits",)]["logits"], "dlogits")


@pytest.mark.parametrize("op_type,inputs,attrs,skipped", [
    ("mul_grad", {"x": r(2, 3), "y": r(3, 4), "dout": r(2, 4)}, {}, "dx"),
    ("mul_grad", {"x": r(2, 3), "y": r(3, 4), "dout": r(2, 4)}, {}, "dy"),
    ("elementwise_add_grad", {"y": r(3), "dout": r(2, 3)}, {}, "dx"),
    ("elementwise_add_grad", {"y": r(3), "dout": r(2, 3)}, {}, "dy"),
    ("conv2d_grad", {"x": r(1, 2, 4, 4), "filter": r(3, 2, 3, 3), "dout": r(1, 3, 2, 2)}, {},
     "dx"),
    ("conv2d_grad", {"x": r(1, 2, 4, 4), "filter": r(3, 2, 3, 3), "dout": r(1, 3, 2, 2)}, {},
     "dfilter"),
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


def test_outputs_stay_on_the_device_and_get_copies_them_out(device_place):
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.set(device_place.to_device(np.array([-1.0, 2.0], np.float32)))
    mg.Executor(device_place).run([mg.Operator("relu", x=x, out=out)], scope)
    assert is_device_array(out.value)
    host = out.get()
    assert isinstance(host, np.ndarray) and host.tolist() == [0.0, 2.0]
    host[:] = 7
    assert out.get().tolist() == [0.0, 2.0]          # a copy, not a view of the device


def test_scalars_stay_scalars_on_the_device(device_place):
    assert tuple(device_place.to_device(np.array(2.5, np.float32)).shape) == ()
    assert tuple(device_place.to_device(np.float64(1.0)).shape) == ()
    assert device_place.to_device(np.array(2.5, np.float32)).get() == np.float32(2.5)


def test_float16_on_the_gpu_is_a_clear_error(device_place):
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.set(device_place.to_device(np.ones(3, np.float16)))
    with pytest.raises(mg.OpError, match=r"relu: input 'x' has dtype float16; the GPU kernels "
                                         r"take float32 or float64"):
        mg.Executor(device_place).run([mg.Operator("relu", x=x, out=out)], scope)


def test_the_mean_of_an_empty_batch_is_zero_as_on_the_cpu(device_place):
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.set(device_place.to_device(np.ones((0, 3), np.float32)))
    mg.Executor(device_place).run([mg.Operator("mean", x=x, out=out)], scope)
    assert out.get().shape == () and float(out.get()) == 0.0


# ---- a small net -------------------------------------------------------------------


def train_losses(place, make_optimizer, steps=3):
    net, logits, loss = small_net(place, make_optimizer())
    feeds = batches(steps + 1)
    losses = [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds[:steps]]
    (out,) = net.infer(feed={"image": feeds[-1]["image"]}, fetch=[logits])
    params = {v.name: v.get() for v in net.parameters()}
    return losses, out, params


@pytest.mark.parametrize("make_optimizer", [
    lambda: mg.optimizer.SGD(learning_rate=0.1),
    lambda: mg.optimizer.Momentum(learning_rate=0.05, momentum=0.9),
    lambda: mg.optimizer.Momentum(learning_rate=0.05, momentum=0.9, nesterov=True),
], ids=["sgd", "momentum", "nesterov"])
def test_small_net_trains_like_on_the_cpu(device_place, make_optimizer):
    want_losses, want_out, want_params = train_losses(mg.CPUPlace(), make_optimizer)
    got_losses, got_out, got_params = train_losses(device_place, make_optimizer)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert want_losses[-1] < want_losses[0]
    assert_close(got_out, want_out, "infer logits")
    for name, want in want_params.items():
        assert_close(got_params[name], want, f"parameter {name}")


def test_a_step_moves_only_feeds_flags_and_fetches(monkeypatch):
    """Host <-> device traffic of one emulated training step: the two feeds in;
    out, the two label-status flags (softmax_with_cross_entropy's and its
    grad's: a step checks them before it commits), and the loss when it is
    fetched. Nothing else: the learning rate and mean's gradient are read on
    the device."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernel emulator")
    with kernel_emulator.emulated_gpu() as emu:
        net, _, loss = small_net(emu, mg.optimizer.Momentum(learning_rate=0.05))
        first, second = batches(2)
        net.train(feed=first, fetch=[loss])                     # initialises the parameters
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
        net.train(feed=second)
        assert moved == {"in": 2, "out": 2}
        net.train(feed=second, fetch=[loss])
        assert moved == {"in": 4, "out": 5}


def test_bad_labels_fail_the_step_and_change_nothing(device_place):
    net, logits, loss = small_net(device_place, mg.optimizer.SGD(learning_rate=0.1))
    good, bad = batches(2)
    bad["label"][2] = 9
    net.train(feed=good, fetch=[loss])
    before = {v.name: v.get().copy() for v in net.persistables()}
    with pytest.raises(ValueError, match=r"softmax_with_cross_entropy: input 'label' had 1 "
                                         r"value\(s\) outside \[0, K\), e.g. at row 2") as e:
        net.train(feed=bad)                             # checked before the step commits
    assert "also: softmax_with_cross_entropy_grad: input 'label' had 1 value(s)" in str(e.value)
    for name, value in before.items():
        np.testing.assert_array_equal(net.var(name).get(), value, err_msg=name)
    (value,) = net.train(feed=good, fetch=[loss])       # reported once, then clear
    assert np.isfinite(value)
    with pytest.raises(ValueError, match="outside"):
        net.train(feed=bad, fetch=[loss])


# ---- the real GPU only -----------------------------------------------------------------


@pytest.mark.gpu
def test_digits_net_trains_on_the_gpu_like_on_the_cpu(gpu_place):
    from minigraph.examples.train_digits import build_net, load_digits_split

    pytest.importorskip("sklearn")
    old = device.use_backend(None)
    try:
        x, y, _, _ = load_digits_split()
        runs = []
        for place in (mg.CPUPlace(), gpu_place):
            net, h = build_net(place, seed=0)
            losses = []
            for k in range(5):
                feed = {"image": x[32 * k:32 * k + 32], "label": y[32 * k:32 * k + 32]}
                losses.append(float(net.train(feed=feed, fetch=[h["loss"]])[0]))
            (logits,) = net.infer(feed={"image": x[:64]}, fetch=[h["logits"]])
            runs.append((losses, logits))
        (cpu_losses, cpu_logits), (gpu_losses, gpu_logits) = runs
        np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-4)
        np.testing.assert_allclose(gpu_logits, cpu_logits, rtol=1e-3, atol=1e-4)
    finally:
        device.use_backend(old)
