"""GradientMerge under data_parallel (minigraph.distributed.merge and the data-parallel
pass): the merged sums themselves (avg=False, k_steps=1) are averaged in the update
section and train like one process; a checkpoint taken mid-accumulation holds the
whole job's sums and resumes bit for bit; io.save of one rank's sums is refused.

The multi-rank cases run tests/mpi_scripts/* under `mpiexec -n K` with a hard timeout.
"""
from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_bn_net
from mpi_scripts.launch import check_ok

import minigraph as mg
from minigraph.distributed import merge as dmerge

MERGES = {"sum": dict(k_steps=2, avg=False), "k1": dict(k_steps=1),
          "mean": dict(k_steps=2, avg=True)}


def merged_net(kind, parallel):
    opt = mg.optimizer.GradientMerge(mg.optimizer.Momentum(0.1), **MERGES[kind])
    net, loss, _ = tiny_bn_net(sync=True, seed=2, optimizer=opt)
    if parallel:
        mg.distributed.data_parallel(net, batch_size_from="label")
    return net, loss


@pytest.mark.parametrize("kind", ["sum", "k1"])
def test_merged_sums_are_averaged_before_the_first_update_op(one_rank, kind):
    """avg=False and k_steps=1 hand the optimizer the persistable sums themselves
    (used to be a RecursionError): their allreduce opens the update section, so it
    runs only on the steps that update, and nothing is averaged in the backward one.
    The sums of sync batch norm's dscale and dbias, the whole batch's already on every
    rank, need no allreduce."""
    net, _ = merged_net(kind, parallel=True)
    assert "c_allreduce_avg" not in [op.type for op in net.section("backward")]
    first = net.section("update")[0]
    assert first.type == "c_allreduce_avg"
    assert {v.name for v in first.inputs["x"]} == {
        f"gradient_merge_0.{n}.merged_grad" for n in ("c1.w", "c1.b", "fc1.w", "fc1.b")}
    assert first.outputs["out"] == first.inputs["x"]


@pytest.mark.parametrize("kind", ["sum", "k1", "mean"])
def test_data_parallel_merge_in_a_world_of_one_equals_one_process(one_rank, kind):
    rng = np.random.default_rng(1)
    feeds = [{"image": rng.standard_normal((5, 2, 4, 4)).astype(np.float32),
              "label": rng.integers(0, 4, 5)} for _ in range(5)]
    results = []
    for parallel in (False, True):
        net, loss = merged_net(kind, parallel)
        losses = [float(net.train(feed=f, fetch=[loss])[0]) for f in feeds]
        results.append((losses, {v.name: v.get() for v in net.persistables()}))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        np.testing.assert_array_equal(results[1][1][name], value, err_msg=name)


def test_in_a_world_of_one_the_sums_are_the_job_s_and_io_save_works(one_rank, tmp_path):
    net, _ = merged_net("mean", parallel=True)
    rng = np.random.default_rng(0)
    net.train(feed={"image": rng.standard_normal((4, 2, 4, 4)).astype(np.float32),
                    "label": rng.integers(0, 4, 4)})
    assert int(net.optimizer.counter.get()) == 1               # mid-accumulation
    assert dmerge.average_merged(net, one_rank) == 0           # nothing to send
    mg.io.save(net, tmp_path / "a.npz")
    mg.distributed.save(net, tmp_path / "b.npz")
    assert mg.io.read_checkpoint(tmp_path / "a.npz").keys() == \
        mg.io.read_checkpoint(tmp_path / "b.npz").keys()


def test_merged_gradients_of_a_net_without_gradient_merge():
    net, _, _ = tiny_bn_net(sync=False, optimizer=mg.optimizer.SGD(0.1))
    assert dmerge.merged_gradients(net) == (None, [])
    merge = mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 3)
    net, _, _ = tiny_bn_net(sync=False, optimizer=merge)
    assert dmerge.merged_gradients(net)[0] is merge
    assert [v.name for v in merge.merged] == [f"gradient_merge_0.{p.name}.merged_grad"
                                              for p in net.parameters()]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("avg", ["avg", "sum"])
def test_a_checkpoint_taken_mid_accumulation_resumes_bit_for_bit(ranks, avg, tmp_path):
    """k=3, saved after 2 steps with mg.distributed.save, loaded on rank 0 and broadcast:
    equal to the run that saved and went on (it used to end 0.05-0.09 away); one
    process resumes from the same file; io.save on one rank is refused."""
    check_ok("merge_resume.py", ranks, tmp_path, avg, timeout=120)
