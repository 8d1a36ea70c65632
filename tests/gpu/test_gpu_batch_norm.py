"""batch_norm and sync_batch_norm on a GPU place against the CPU kernels.

Each test runs on the kernel emulator's EmuPlace (the real launchers and .cu
kernels, compiled with g++; see tests/kernel_emulator) and, marked `gpu`, on
GPUPlace(0) (skipped without one; these have never run):
- batch_norm in every mode (training, use_global_est, is_infer), both layouts,
  ranks 2 to 5, odd shapes, offset data; outputs, in-place estimates and
  counter, and the gradients equal the CPU's;
- a sequence of batches (first batch, momentum, cumulative average);
- a non-finite batch raises at the next fetch and leaves the estimates alone;
- the digits net trains and infers with the CPU's losses.
sync_batch_norm's own paths are in test_gpu_sync_batch_norm.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from bn_cases import F32, F64, LoneRankComm, bn_inputs
from mpi_scripts.gpu_sync_bn_check import BN
from op_harness import TOL, assert_close, run_op

import minigraph as mg
from minigraph.distributed import world
from minigraph.distributed.comm import LocalComm


def assert_near(got, want, where, loosen=1.0):
    """assert_close with the tolerance multiplied by `loosen` (offset data: sums of
    dy·(x − mean) lose |mean|/std digits in both kernels)."""
    got, want = np.asarray(got), np.asarray(want)
    if loosen == 1.0 or want.dtype.kind != "f":
        return assert_close(got, want, where)
    assert got.shape == want.shape and got.dtype == want.dtype, where
    scale = np.linalg.norm(want.astype(np.float64).ravel()) or 1.0
    err = np.linalg.norm((got.astype(np.float64) - want).ravel()) / scale
    assert err < TOL[want.dtype] * loosen, f"{where}: relative error {err:.3g}"


# id: (layout, shape, dtype, extra attrs, bn_inputs keywords)
SHAPES = {
    "nchw4-f32": ("NCHW", (4, 3, 5, 7), F32, {}, {}),
    "nchw4-packs-f64": ("NCHW", (8, 4, 8, 8), F64, dict(momentum=0.8), dict(counter=3)),
    "nhwc4-f32": ("NHWC", (4, 5, 6, 8), F32, {}, dict(counter=2)),
    "nhwc4-cumulative-f64": ("NHWC", (3, 7, 7, 3), F64, dict(momentum=None), dict(counter=2)),
    "rank2-f32": ("NCHW", (6, 3), F32, {}, {}),
    "rank2-c1-nhwc-f64": ("NHWC", (37, 1), F64, {}, {}),
    "rank3-f32": ("NCHW", (4, 3, 10), F32, dict(momentum=0.0), dict(counter=1)),
    "rank3-nhwc-f64": ("NHWC", (4, 10, 3), F64, dict(momentum=1.0), dict(counter=1)),
    "c1-hw1-f32": ("NCHW", (5, 1, 1, 1), F32, {}, {}),
    "hw1-f64": ("NCHW", (3, 2, 1, 1), F64, {}, dict(counter=4)),
    "rank5-f64": ("NCHW", (2, 3, 4, 5, 3), F64, {}, {}),
    "rank5-nhwc-f32": ("NHWC", (2, 3, 4, 5, 6), F32, dict(epsilon=1e-3), {}),
    "odd-663-f32": ("NCHW", (3, 2, 17, 13), F32, {}, {}),
    "offset-1e4-f32": ("NCHW", (3, 2, 17, 13), F32, {}, dict(offset=1e4)),
    "offset-1e4-nhwc-f32": ("NHWC", (601, 3), F32, {}, dict(offset=1e4, counter=5)),
    "offset-1e4-f64": ("NHWC", (4, 9, 5), F64, {}, dict(offset=1e4)),
    "torch-rule-f32": ("NCHW", (4, 3, 5, 7), F32, dict(first_batch_sets_estimates=False), {}),
    "torch-rule-nhwc-f64": ("NHWC", (3, 4, 6), F64,
                            dict(first_batch_sets_estimates=False, momentum=0.7),
                            dict(counter=2)),
    # one launch per pass, 68 KiB of shared memory (the function attribute)
    "resident-68k-f32": ("NCHW", (64, 8, 7, 7), F32, {}, dict(counter=2)),
    # more channel groups than CTAs: the next group double-buffered
    "resident-double-f64": ("NCHW", (128, 32, 7, 7), F64, {}, {}),
    "rows-wide-f32": ("NCHW", (40, 64), F32, {}, {}),
}
MODES = {"train": {}, "use_global_est": dict(use_global_est=True), "is_infer": dict(is_infer=True)}
GRADS = (("x", "scale", "bias"), ("x",), ("scale", "bias"))


# op types of the tests below: sync_batch_norm in a world of one (exactly batch_norm's
# kernels) and as one of two ranks (the synchronized kernels: one allreduce each way)
OP_WORLDS = {"batch_norm": ("batch_norm", LocalComm),
             "sync_batch_norm": ("sync_batch_norm", LocalComm),
             "sync_batch_norm-2-ranks": ("sync_batch_norm", LoneRankComm)}


@pytest.mark.parametrize("op_type", ["batch_norm", "batch_norm_relu"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("case", sorted(SHAPES))
def test_batch_norm_matches_the_cpu(device_place, force_splits, case, mode, op_type):
    layout, shape, dtype, attrs, kw = SHAPES[case]
    ins = bn_inputs(shape, layout, dtype, **kw)
    attrs = dict(attrs, data_layout=layout, **MODES[mode])
    grad_sets = GRADS if mode == "train" else GRADS[:1]
    want, want_grads = run_op(mg.CPUPlace(), op_type, ins, attrs, grad_sets, ("y",))
    got, got_grads = run_op(device_place, op_type, ins, attrs, grad_sets, ("y",))
    assert set(got) == set(want)
    loosen = 10.0 if kw.get("offset") else 1.0
    for slot in want:
        assert_near(got[slot], want[slot], f"{case} {mode}: output {slot!r}", loosen)
    if mode != "train":       # the estimates as batch statistics, nothing updated
        assert_close(got["batch_mean"], ins["estimated_mean"], "batch_mean")
        np.testing.assert_array_equal(got["saved_var"], ins["estimated_var"])
        if "num_batches" in ins:
            assert got["saved_num_batches"] == ins["num_batches"]
    for wanted in grad_sets:
        assert set(got_grads[wanted]) == set(want_grads[wanted])
        for name, value in want_grads[wanted].items():
            assert_near(got_grads[wanted][name], value, f"{case} {mode}: d/d {name}", loosen)


@pytest.mark.parametrize("momentum", [0.9, None], ids=["momentum", "cumulative"])
def test_a_sequence_of_batches_updates_like_the_cpu(device_place, momentum):
    runs = [BN(p, "batch_norm", 3, np.float32, "NCHW", momentum)
            for p in (mg.CPUPlace(), device_place)]
    rng = np.random.default_rng(3)
    for step in range(4):
        x = rng.normal(step, 1 + step, (5, 3, 4, 3)).astype(np.float32)
        dy = rng.standard_normal(x.shape).astype(np.float32)
        want, got = (r.step(x, dy) for r in runs)
        for k in want:
            assert_close(got[k], want[k], f"step {step}: {k}")
        assert int(got["counter"]) == step + 1
        if step == 0:                             # the first batch replaces the estimates
            assert_close(got["mean"], want["bm"], "first batch mean")
    x = rng.standard_normal((2, 3, 4, 3)).astype(np.float32)
    assert_close(runs[1].infer(x), runs[0].infer(x), "infer after training")


def test_no_counter_always_uses_momentum(device_place):
    runs = [BN(p, "batch_norm", 4, np.float64, "NHWC", 0.7, counter=False)
            for p in (mg.CPUPlace(), device_place)]
    for step in range(2):
        x = np.random.default_rng(step).standard_normal((6, 3, 4))
        want, got = (r.step(x) for r in runs)
        for k in want:
            assert_close(got[k], want[k], f"step {step}: {k}")


@pytest.mark.parametrize("world_case", sorted(OP_WORLDS))
@pytest.mark.parametrize("poison", ["nan", "inf", "overflow"])
def test_non_finite_batch_raises_at_the_next_fetch(device_place, monkeypatch, world_case, poison):
    op_type, make_comm = OP_WORLDS[world_case]
    monkeypatch.setattr(world, "_comm", make_comm(device_place))
    gpu, cpu = (BN(p, op_type, 3, np.float32) for p in (device_place, mg.CPUPlace()))
    rng = np.random.default_rng(0)
    good = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    bad = good.copy()
    if poison == "overflow":                 # finite values whose variance overflows float32
        bad[:, 1] = np.where(np.arange(25).reshape(5, 5) % 2, 3e38, -3e38).astype(np.float32)
    else:
        bad[1, 2, 3, 4] = np.nan if poison == "nan" else np.inf
    for r in (gpu, cpu):
        r.step(good)
    kept = gpu.estimates()
    with pytest.raises(mg.OpError, match=f"{op_type}: the batch statistics are not finite"):
        cpu.step(bad)
    gpu.step(bad, fetch=False)                            # a GPU kernel cannot raise here
    for k, v in gpu.estimates().items():                  # ...but commits nothing
        np.testing.assert_array_equal(v, kept[k], err_msg=k)
    with pytest.raises(mg.OpError, match=rf"{op_type}: the batch statistics of 1 training "
                                         r"batch\(es\) were not finite") as e:
        gpu.ex.run([], gpu.scope, fetch=[gpu.y])         # the next fetch reports it
    assert "left unchanged" in str(e.value)
    want, got = cpu.step(good), gpu.step(good)            # reported once; training goes on
    for k in want:
        assert_close(got[k], want[k], f"after the bad batch: {k}")
    assert int(got["counter"]) == 2


@pytest.mark.parametrize("world_case", sorted(OP_WORLDS))
@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1, 1)])
def test_one_value_per_channel_is_the_cpu_error(device_place, monkeypatch, world_case, shape):
    op_type, make_comm = OP_WORLDS[world_case]
    errors = []
    for p in (mg.CPUPlace(), device_place):
        monkeypatch.setattr(world, "_comm", make_comm(p))
        with pytest.raises(mg.OpError, match="training needs more than one value") as e:
            BN(p, op_type, 3, np.float32).step(np.ones(shape, np.float32))
        errors.append(str(e.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("world_case", sorted(OP_WORLDS))
@pytest.mark.parametrize("momentum", [0.7, None])
def test_pytorchs_estimate_rule_over_batches_is_the_cpus(device_place, monkeypatch, world_case,
                                                         momentum):
    """first_batch_sets_estimates=False through batch_norm, sync_batch_norm in a world of
    one and its synchronized kernels: three batches, the estimates and counter as the CPU's."""
    op_type, make_comm = OP_WORLDS[world_case]
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((6, 3, 2, 2)) + k).astype(np.float64) for k in range(3)]
    dy = rng.standard_normal((6, 3, 2, 2))
    results = []
    for p in (mg.CPUPlace(), device_place):
        monkeypatch.setattr(world, "_comm", make_comm(p))
        bn = BN(p, op_type, 3, np.float64, momentum=momentum, first_batch=False)
        results.append([bn.step(x, dy=dy) for x in batches])
    for k, (want, got) in enumerate(zip(*results)):
        for key in ("y", "mean", "var", "counter", "dx"):
            assert_close(got[key], want[key], f"{world_case} batch {k}: {key}")


@pytest.mark.parametrize("world_case", sorted(OP_WORLDS))
@pytest.mark.parametrize("shape", [(0, 3), (0, 3, 2, 2)])
def test_an_empty_batch_gives_an_empty_output_and_changes_nothing(device_place, monkeypatch,
                                                                  world_case, shape):
    op_type, make_comm = OP_WORLDS[world_case]
    results = []
    for p in (mg.CPUPlace(), device_place):
        monkeypatch.setattr(world, "_comm", make_comm(p))
        bn = BN(p, op_type, 3, np.float32)
        kept = bn.estimates()
        got = bn.step(np.ones(shape, np.float32), dy=np.ones(shape, np.float32))
        assert got["y"].shape == shape and got["dx"].shape == shape
        for k, v in kept.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        np.testing.assert_array_equal(got["dscale"], 0)
        np.testing.assert_array_equal(got["dbias"], 0)
        results.append(got)
    for k in ("bm", "bv", "mean", "var", "counter"):
        assert_close(results[1][k], results[0][k], f"{world_case} {k}")


def test_float16_is_a_clear_error_on_the_gpu(device_place):
    ins = bn_inputs((4, 3), "NCHW", np.float16)
    with pytest.raises(mg.OpError, match="batch_norm: input 'x' has dtype float16"):
        run_op(device_place, "batch_norm", ins)


def test_digits_net_trains_like_on_the_cpu(device_place):
    pytest.importorskip("sklearn")
    from minigraph.examples.train_digits import build_net, load_digits_split

    x, y, _, _ = load_digits_split()
    runs = []
    for p in (mg.CPUPlace(), device_place):
        net, h = build_net(p, seed=0)
        losses = [float(net.train(feed={"image": x[8 * k:8 * k + 8], "label": y[8 * k:8 * k + 8]},
                                  fetch=[h["loss"]])[0]) for k in range(3)]
        (logits,) = net.infer(feed={"image": x[100:110]}, fetch=[h["logits"]])
        est = {v.name: v.get() for v in net.persistables() if "estimated" in v.name}
        runs.append((losses, logits, est))
    (cpu_losses, cpu_logits, cpu_est), (gpu_losses, gpu_logits, gpu_est) = runs
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-5)
    assert_close(gpu_logits, cpu_logits, "infer logits")
    for name, value in cpu_est.items():
        assert_close(gpu_est[name], value, name)
