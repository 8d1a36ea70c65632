"""sync_batch_norm on a GPU place against the CPU kernels.

Each test runs on the kernel emulator's EmuPlace (the real launchers and .cu
kernels, compiled with g++; see tests/kernel_emulator) and, marked `gpu`, on
GPUPlace(0) (skipped without one): in a world of one it is batch_norm; its
synchronized path (one collective each way: allreduce_stats forward, allreduce
backward) and the packed 2C+1 vectors; the fused op with averaged gradients and
c_avg_presummed; several ranks in one process through the launchers; the device
merge of the ranks' (n, mean, M2) on offset data; 2 ranks under mpiexec with the
host-staged MPI backend (tests/mpi_scripts/gpu_sync_bn_check.py) and, on a real
GPU, NCCL in a world of one.
"""
from __future__ import annotations

import shutil

import kernel_emulator
import numpy as np
import pytest
from bn_cases import F32, F64, LoneRankComm, bn_inputs
from mpi_scripts.gpu_sync_bn_check import BN
from mpi_scripts.launch import check_ok
from op_harness import assert_close, run_op

import minigraph as mg
from minigraph.distributed import world
from minigraph.distributed.comm import LocalComm
from minigraph.kernels.cpu import batch_norm as sync_ops
from minigraph.kernels.cpu import batch_norm_stats as bn_cpu


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
