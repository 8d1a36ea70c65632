"""sync_batch_norm: the op in a world of one (in process), and on K = 2, 3, 4 MPI ranks
(tests/mpi_scripts/sync_bn_check.py, launched with mpiexec under a hard timeout)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_bn_net
from mpi_scripts.launch import RANKS, check_ok

import minigraph as mg
from minigraph import layers
from minigraph.distributed import world
from minigraph.distributed.comm import LocalComm
from minigraph.kernels.cpu import batch_norm as sync_ops
from minigraph.schema import get_schema


@pytest.fixture
def one_rank(monkeypatch):
    """A world of one process without MPI, for the duration of a test."""
    comm = LocalComm(mg.CPUPlace())
    monkeypatch.setattr(world, "_comm", comm)
    return comm


def test_schema_matches_batch_norm():
    bn, sync = get_schema("batch_norm"), get_schema("sync_batch_norm")
    assert [s.name for s in sync.inputs] == [s.name for s in bn.inputs]
    assert [s.name for s in sync.outputs] == [s.name for s in bn.outputs]
    assert [(a.name, a.default) for a in sync.attrs] == [(a.name, a.default) for a in bn.attrs]
    assert sync.inplace == bn.inplace
    grad, sync_grad = get_schema("batch_norm_grad"), get_schema("sync_batch_norm_grad")
    assert [s.name for s in sync_grad.inputs] == [s.name for s in grad.inputs]


def test_cpu_and_gpu_kernels_are_registered():
    for op_type in ("sync_batch_norm", "sync_batch_norm_grad"):
        assert set(get_schema(op_type).kernels) == {"cpu", "gpu"}   # GPU: test_gpu_sync_batch_norm.py


def test_layer_sync_flag_builds_sync_op_in_both_branches():
    net, _, _ = tiny_bn_net(sync=True)
    for branch in ("train", "infer"):
        types = [op.type for op in net.section(branch)]
        assert "sync_batch_norm" in types and "batch_norm" not in types


def test_one_rank_trains_exactly_like_batch_norm(one_rank):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 2, 4, 4)).astype(np.float32)
    y = rng.integers(0, 4, 6)
    runs = []
    for sync in (False, True):
        net, loss, logits = tiny_bn_net(sync)
        mg.optimizer.SGD(0.1).minimize(net, loss)
        losses = [float(net.train(feed={"image": x, "label": y}, fetch=[loss])[0])
                  for _ in range(3)]
        (out,) = net.infer(feed={"image": x}, fetch=[logits])
        runs.append((losses, out, {v.name: v.get().copy() for v in net.persistables()}))
    (l0, o0, p0), (l1, o1, p1) = runs
    assert l0 == l1
    np.testing.assert_array_equal(o0, o1)
    for name in p0:
        np.testing.assert_array_equal(p0[name], p1[name], err_msg=name)
    assert one_rank.calls == 0                  # nothing to communicate in a world of one


def test_convert_keeps_variables_and_attributes():
    net, loss, _ = tiny_bn_net(sync=False)
    before = {b: list(net.section(b)) for b in ("train", "infer")}
    assert mg.distributed.convert_sync_batchnorm(net) == 2
    for b in ("train", "infer"):
        for old, new in zip(before[b], net.section(b)):
            if old.type != "batch_norm":
                assert new is old
                continue
            assert new.type == "sync_batch_norm"
            assert new.inputs == old.inputs and new.outputs == old.outputs
            assert dict(new.attrs) == dict(old.attrs)
    assert mg.distributed.convert_sync_batchnorm(net) == 0


def test_convert_after_minimize_rewrites_grad_ops(one_rank):
    net, loss, _ = tiny_bn_net(sync=False)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    assert mg.distributed.convert_sync_batchnorm(net) == 3        # train, infer, grad
    types = [op.type for op in net.ops("train")]
    assert "sync_batch_norm_grad" in types and "batch_norm_grad" not in types
    x = np.random.default_rng(1).standard_normal((5, 2, 4, 4)).astype(np.float32)
    (lo,) = net.train(feed={"image": x, "label": np.arange(5) % 4}, fetch=[loss])
    assert np.isfinite(lo)


def test_n_equal_one_is_an_error(one_rank):
    net = mg.Net()
    x = layers.data(net, "x", shape=(-1, 3))
    y = layers.batch_norm(net, x, sync=True)
    with pytest.raises(mg.OpError, match="n=1"):
        net.train(feed={"x": np.ones((1, 3), np.float32)}, fetch=[y])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", RANKS)
def test_matches_one_process_batch_norm_on_ranks(ranks):
    check_ok("sync_bn_check.py", ranks, timeout=90)


# ---- merging per-rank statistics (Chan) -------------------------------------------------

def rank_vectors(parts):
    """Each rank's pack_stats vector, from the CPU kernel's local statistics."""
    from minigraph.kernels.cpu import batch_norm_stats as batch_norm_cpu

    return [sync_ops.pack_stats(*batch_norm_cpu.local_stats(batch_norm_cpu.as_3d(p, "NCHW")))
            for p in parts]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_offset_data_keeps_its_variance_over_ranks(ranks):
    """|mean|/std = 1e6: merging (n, mean, M2) gives the variance to ~1e-6 relative,
    in any order of merging; the sums-of-squares message it replaced (S2 - mean*S1)
    loses it (the control below)."""
    from minigraph.distributed.comm import chan_merge, merge_rows

    rng = np.random.default_rng(ranks)
    counts = [5 + 3 * r for r in range(ranks)]
    full = 1e6 + rng.standard_normal((sum(counts), 3, 4, 4))
    parts = np.split(full, np.cumsum(counts)[:-1])
    centred = full - full.mean(axis=(0, 2, 3), keepdims=True)
    want_var = (centred * centred).mean(axis=(0, 2, 3))
    vectors = rank_vectors(parts)
    in_order = merge_rows(np.stack(vectors))
    tree = vectors[0]
    for v in reversed(vectors[1:]):
        tree = chan_merge(v, tree)
    for merged in (in_order, tree):
        n, mean, m2 = sync_ops.unpack_stats(merged)
        assert n == full.shape[0] * 16
        assert np.max(np.abs(m2 / n - want_var) / want_var) < 1e-6
        np.testing.assert_allclose(mean, full.mean(axis=(0, 2, 3)), rtol=1e-14)
    # control: the old message, sums of n*mean and M2 + n*mean^2, then S2 - mean*S1
    s = sum(np.concatenate(([v[0]], v[0] * v[1:4], v[4:] + v[0] * v[1:4] ** 2))
            for v in vectors)
    old = (s[4:] - s[1:4] / s[0] * s[1:4]) / s[0]
    assert np.max(np.abs(old - want_var) / want_var) > 1e-6


def test_chan_merge_is_bitwise_commutative_and_skips_empty_ranks():
    from minigraph.distributed.comm import chan_merge

    rng = np.random.default_rng(3)
    parts = [1e3 + rng.standard_normal((k, 5, 2, 2)) for k in (4, 4, 7, 0)]
    a, b, c, empty = rank_vectors(parts)
    for x, y in ((a, b), (a, c), (b, c), (c, empty)):
        assert chan_merge(x, y).tobytes() == chan_merge(y, x).tobytes()
    assert chan_merge(a, empty).tobytes() == a.tobytes()
    assert not chan_merge(empty, empty).any()


def test_one_rank_merges_nothing(one_rank):
    v = rank_vectors([np.arange(24.0).reshape(2, 3, 4)])[0]
    np.testing.assert_array_equal(one_rank.allreduce_stats(v), v)
    assert one_rank.stats["allreduce_stats"] == [1, v.nbytes]
