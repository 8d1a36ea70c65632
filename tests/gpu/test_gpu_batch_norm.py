"""batch_norm and sync_batch_norm on a GPU place against the CPU kernels.

Each test runs on the kernel emulator's EmuPlace (the real launchers and .cu
kernels, compiled with g++; see tests/kernel_emulator) and, marked `gpu`, on
GPUPlace(0) (skipped without one; these have never run):
- batch_norm in every mode (training, use_global_est, is_infer), both layouts,
  ranks 2 to 5, odd shapes, offset data; outputs, in-place estimates and
  counter, and the gradients equal the CPU's;
- a sequence of batches (first batch, momentum, cumulative average);
- a non-finite batch raises at the next fetch and leaves the estimates alone;
- the digits net trains and infers with the CPU's losses;
- sync_batch_norm in a world of one is batch_norm; its synchronized path
  (one collective each way: allreduce_stats forward, allreduce backward) and
  the packed 2C+1 vectors; several ranks in one process through the launchers;
  the device merge of the ranks' (n, mean, M2) on offset data; 2 ranks under mpiexec with the host-staged
  MPI backend (tests/mpi_scripts/gpu_sync_bn_check.py) and, on a real GPU,
  NCCL in a world of one.
"""
from __future__ import annotations

import shutil

import kernel_emulator
import numpy as np
import pytest
from mpi_scripts.gpu_sync_bn_check import BN
from mpi_scripts.launch import check_ok
from op_harness import TOL, assert_close, run_op

import minigraph as mg
from minigraph.distributed import world
from minigraph.distributed.comm import LocalComm
from minigraph.kernels.cpu import batch_norm as sync_ops
from minigraph.kernels.cpu import batch_norm_stats as bn_cpu


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


def bn_inputs(shape, layout, dtype, seed=0, offset=0.0, counter=0):
    """The inputs of a batch_norm op; counter None leaves num_batches out."""
    channels = shape[1] if layout == "NCHW" else shape[-1]
    rng = np.random.default_rng(seed + 100)
    ins = dict(x=(rng.standard_normal(shape) * 2 + offset).astype(dtype),
               estimated_mean=rng.normal(0, 1, channels).astype(dtype),
               estimated_var=rng.uniform(0.5, 2, channels).astype(dtype),
               scale=rng.uniform(0.5, 1.5, channels).astype(dtype),
               bias=rng.normal(0, 1, channels).astype(dtype))
    if counter is not None:
        ins["num_batches"] = np.array(counter, np.int64)
    return ins


F32, F64 = np.float32, np.float64
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


class LoneRankComm(LocalComm):
    """Two ranks as this process sees them when the other holds no rows: every
    vector it contributes is zero, so the sum is this rank's vector."""

    def __init__(self, place):
        super().__init__(place)
        self.size = 2


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


# ---- sync_batch_norm -----------------------------------------------------------------


def test_sync_batch_norm_in_a_world_of_one_is_batch_norm(device_place, monkeypatch):
    comm = LocalComm(device_place)
    monkeypatch.setattr(world, "_comm", comm)
    ins = bn_inputs((5, 3, 4, 4), "NCHW", np.float32, counter=2)
    grads = (("x", "scale", "bias"),)
    want, want_grads = run_op(device_place, "batch_norm", ins, {}, grads, ("y",))
    got, got_grads = run_op(device_place, "sync_batch_norm", ins, {}, grads, ("y",))
    for slot in want:
        np.testing.assert_array_equal(got[slot], want[slot], err_msg=slot)
    for name, value in want_grads[grads[0]].items():
        np.testing.assert_array_equal(got_grads[grads[0]][name], value, err_msg=name)
    assert comm.calls == 0


@pytest.mark.parametrize("layout,shape,dtype", [("NCHW", (5, 3, 4, 4), F32),
                                                ("NHWC", (7, 2, 5), F64),
                                                ("NCHW", (9, 4), F32)])
def test_sync_path_makes_one_allreduce_each_way(device_place, monkeypatch, layout, shape, dtype):
    comm = LoneRankComm(device_place)
    comm.trace = []
    monkeypatch.setattr(world, "_comm", comm)
    ins = bn_inputs(shape, layout, dtype, counter=1)
    attrs = dict(data_layout=layout)
    grads = (("x", "scale", "bias"),)
    want, want_grads = run_op(mg.CPUPlace(), "batch_norm", ins, attrs, grads, ("y",))
    got, got_grads = run_op(device_place, "sync_batch_norm", ins, attrs, grads, ("y",))
    for slot in want:
        assert_close(got[slot], want[slot], f"sync {slot}")
    for name, value in want_grads[grads[0]].items():
        assert_close(got_grads[grads[0]][name], value, f"sync d/d {name}")
    channels = shape[1] if layout == "NCHW" else shape[-1]
    size = 8 * (2 * channels + 1)
    assert comm.trace == [("allreduce_stats", "sync_batch_norm forward x=x", size),
                          ("allreduce", "sync_batch_norm_grad x=x", size)]
    comm.trace = []
    run_op(device_place, "sync_batch_norm", ins, dict(attrs, is_infer=True), grads, ("y",))
    run_op(device_place, "sync_batch_norm", ins, dict(attrs, use_global_est=True), grads, ("y",))
    assert comm.trace == []                  # the estimates need no communication


@pytest.mark.parametrize("average", [False, True], ids=["sums", "average_ranks"])
def test_the_fused_sync_op_and_its_averaged_grads_match_the_cpu(device_place, monkeypatch,
                                                                  average):
    """sync_batch_norm_relu on the synchronized kernels (as one of two ranks) against the
    CPU's, forward and its grad op; with average_ranks, dscale and dbias divided by the
    two ranks in the gradient-from-sums kernel."""
    monkeypatch.setattr(world, "_comm", LoneRankComm(device_place))
    rng = np.random.default_rng(5)
    shape, c = (6, 4, 5, 5), 4
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    results = []
    for place in (mg.CPUPlace(), device_place):
        scope = mg.Scope()
        v = {}
        for name, value in (("x", x), ("dy", dy), ("scale", np.linspace(.5, 1.5, c)),
                            ("bias", np.linspace(-.5, .5, c)), ("mean", np.zeros(c)),
                            ("var", np.ones(c))):
            v[name] = scope.new_var(name, persistable=name not in ("x", "dy"))
            v[name].set(place.to_device(np.asarray(value, np.float32)))
        out = {k: scope.new_var(k) for k in ("y", "bm", "bv", "dx", "ds", "db")}
        fwd = mg.Operator("sync_batch_norm_relu", x=v["x"], scale=v["scale"], bias=v["bias"],
                          estimated_mean=v["mean"], estimated_var=v["var"], y=out["y"],
                          batch_mean=out["bm"], batch_var=out["bv"], saved_mean=v["mean"],
                          saved_var=v["var"])
        grad = mg.Operator("sync_batch_norm_relu_grad", x=v["x"], scale=v["scale"],
                           mean=out["bm"], var=out["bv"], dy=v["dy"], y=out["y"], dx=out["dx"],
                           dscale=out["ds"], dbias=out["db"], average_ranks=average)
        results.append(mg.Executor(place).run([fwd, grad], scope,
                                              fetch=["y", "dx", "ds", "db", "mean"]))
    for name, got, want in zip(("y", "dx", "dscale", "dbias", "mean"), results[1], results[0],
                               strict=True):
        assert_close(got, want, f"sync relu {name}")
    plain_db = np.where(results[0][0] > 0, dy, 0).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(results[0][3], plain_db / (2 if average else 1), rtol=1e-4,
                               atol=1e-4)


def test_c_avg_presummed_matches_the_cpu(device_place, monkeypatch):
    """c_avg_presummed (data_parallel still adds it after an op whose presummed outputs
    have no attribute to divide them itself) divides by the world size on the device."""
    monkeypatch.setattr(world, "_comm", LoneRankComm(device_place))
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5)]
    results = []
    for place in (mg.CPUPlace(), device_place):
        scope = mg.Scope()
        ins, outs = [scope.new_var(f"x{i}") for i in range(2)], \
            [scope.new_var(f"out{i}") for i in range(2)]
        for var, x in zip(ins, xs, strict=True):
            var.set(place.to_device(x))
        op = mg.Operator("c_avg_presummed", x=ins, out=outs)
        results.append(mg.Executor(place).run([op], scope, fetch=outs))
    for got, want, x in zip(results[1], results[0], xs, strict=True):
        assert_close(got, want, "c_avg_presummed")
        np.testing.assert_allclose(want, x / 2, rtol=1e-6)


def test_local_vectors_are_the_cpu_packing(device_place, force_splits):
    from minigraph.kernels.cuda import batch_norm_sync as gpu

    rng = np.random.default_rng(2)
    for layout, shape in (("NCHW", (4, 3, 5, 7)), ("NHWC", (6, 5, 4)), ("NCHW", (0, 3))):
        x = (rng.standard_normal(shape) + 5).astype(np.float32)
        x3 = bn_cpu.as_3d(x, layout)
        want = sync_ops.pack_stats(*bn_cpu.local_stats(x3))
        got = gpu.local_stats(device_place.to_device(x), layout).get()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=layout)
        mean = np.linspace(4, 6, x3.shape[1]).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        n, s_dy, s_dyx = bn_cpu.grad_sums(x3, bn_cpu.as_3d(dy, layout), mean.astype(np.float64))
        put = device_place.to_device
        got = gpu.backward_sums(put(x), put(dy), put(mean), layout).get()
        np.testing.assert_allclose(got, np.concatenate(([n], s_dy, s_dyx)), rtol=1e-5,
                                   atol=1e-4, err_msg=layout)


@pytest.mark.parametrize("layout,shape_of,dtype", [
    ("NCHW", lambda n: (n, 3, 4, 5), F64), ("NHWC", lambda n: (n, 3, 4), F32),
    ("NCHW", lambda n: (n, 2), F64)], ids=["nchw-f64", "nhwc-f32", "rank2-f64"])
def test_ranks_in_one_process_match_batch_norm_on_the_whole_batch(device_place, force_splits,
                                                                  layout, shape_of, dtype):
    """Three ranks (5, 0 and 2 rows) run through the launchers one after another,
    their statistics merged on the device (merge_stats), their gradient sums added
    on the host: the whole batch's results on every rank."""
    from minigraph.kernels.cuda import batch_norm_sync as gpu

    counts = (5, 0, 2)
    channels = shape_of(1)[1] if layout == "NCHW" else shape_of(1)[-1]
    rng = np.random.default_rng(4)
    cpu = BN(mg.CPUPlace(), "batch_norm", channels, dtype, layout)
    params = {k: cpu.scope.find_var(k).get().copy() for k in ("scale", "bias", "mean", "var")}
    dev = device_place.to_device
    ranks = [{k: dev(v) for k, v in params.items()} | {"counter": dev(np.array(0, np.int64))}
             for _ in counts]
    for step in range(3):
        full = (rng.standard_normal(shape_of(sum(counts))) * 3 + 2).astype(dtype)
        dy = rng.standard_normal(full.shape).astype(dtype)
        want = cpu.step(full, dy)
        parts = np.split(np.arange(sum(counts)), np.cumsum(counts)[:-1])
        xs = [dev(full[p]) for p in parts]
        dys = [dev(dy[p]) for p in parts]
        rows = np.stack([gpu.local_stats(x, layout).get() for x in xs])
        total = gpu.merge_stats(dev(rows)).get()
        outs = [gpu.forward_train_from_sums(x, dev(total), r["scale"], r["bias"], r["mean"],
                                            r["var"], r["counter"], 0.9, 1e-5, layout)
                for x, r in zip(xs, ranks, strict=True)]
        gsum = sum(gpu.backward_sums(x, g, bm, layout).get()
                   for x, g, (_, bm, _) in zip(xs, dys, outs, strict=True))
        for p, x, g, r, (y, bm, bv) in zip(parts, xs, dys, ranks, outs, strict=True):
            dx, dscale, dbias = gpu.backward_from_sums(x, g, r["scale"], bm, bv, dev(gsum), 1e-5,
                                                       layout)
            got = dict(y=y.get(), bm=bm.get(), bv=bv.get(), mean=r["mean"].get(),
                       var=r["var"].get(), counter=r["counter"].get(), dx=dx.get(),
                       dscale=dscale.get(), dbias=dbias.get())
            for k in ("y", "dx"):                    # this rank's rows (maybe none)
                assert_close(got[k], want[k][p], f"step {step} {k}")
            for k in ("bm", "bv", "mean", "var", "dscale", "dbias", "counter"):
                assert_close(got[k], want[k], f"step {step} {k}")


def test_device_merge_keeps_offset_variance_and_equals_the_host_merge(device_place):
    """kernels.batch_norm_sync.merge_stats on K ranks' local vectors of data with
    |mean|/std = 1e6 (one rank empty): the variance to 1e-6 relative, and the
    host's rank-order merge to 1e-12 (the NCCL path vs the MPI path)."""
    from minigraph.distributed.comm import merge_rows
    from minigraph.kernels.cuda import batch_norm_sync as gpu

    rng = np.random.default_rng(9)
    counts = (6, 0, 3, 9)
    full = 1e6 + rng.standard_normal((sum(counts), 5, 3, 3))
    parts = np.split(full, np.cumsum(counts)[:-1])
    rows = np.stack([gpu.local_stats(device_place.to_device(p), "NCHW").get() for p in parts])
    got = gpu.merge_stats(device_place.to_device(rows)).get()
    centred = full - full.mean(axis=(0, 2, 3), keepdims=True)
    want_var = (centred * centred).mean(axis=(0, 2, 3))
    assert got[0] == full.size // 5
    assert np.max(np.abs(got[6:] / got[0] - want_var) / want_var) < 1e-6
    np.testing.assert_allclose(got, merge_rows(rows), rtol=1e-12)


def prebuild_emulator():
    """Compile the emulator's libraries here, so the ranks find them cached."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernel emulator")
    backend = kernel_emulator.EmuBackend()
    for module in ("batch_norm", "elementwise", "fill"):
        backend._lib(module)


@pytest.mark.mpi
def test_two_emulated_gpus_over_host_staged_mpi():
    prebuild_emulator()
    check_ok("gpu_sync_bn_check.py", 2, "--place", "emulated", timeout=120)


@pytest.mark.mpi
def test_one_emulated_gpu_takes_the_synced_path_in_a_world_of_one():
    prebuild_emulator()
    check_ok("gpu_sync_bn_check.py", 1, "--place", "emulated", timeout=120)


@pytest.mark.gpu
@pytest.mark.mpi
def test_two_ranks_sharing_the_gpu_over_host_staged_mpi(gpu_place):
    check_ok("gpu_sync_bn_check.py", 2, "--place", "gpu", "--backend", "mpi", timeout=300)


@pytest.mark.gpu
@pytest.mark.mpi
def test_nccl_in_a_world_of_one(gpu_place):
    from minigraph.distributed.nccl import nccl_available

    if not nccl_available():
        pytest.skip("nccl4py is not installed")
    check_ok("gpu_sync_bn_check.py", 1, "--place", "gpu", "--backend", "nccl", timeout=300)
