"""minigraph.distributed: communicators, data_parallel, checkpoints, failure handling.

In-process tests use a world of one; the multi-rank ones launch
tests/mpi_scripts/* with `mpiexec -n K` (K = 2, 3, 4) under a hard timeout.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_bn_net
from mpi_scripts.launch import RANKS, check_ok, require_mpi, run_ranks

import minigraph as mg
from minigraph import layers
from minigraph.distributed import world
from minigraph.distributed.comm import LocalComm

MISMATCH = "ranks reached different collectives"


@pytest.fixture
def one_rank(monkeypatch):
    comm = LocalComm(mg.CPUPlace())
    monkeypatch.setattr(world, "_comm", comm)
    return comm


@pytest.fixture
def no_comm(monkeypatch):
    monkeypatch.setattr(world, "_comm", None)


@pytest.fixture(scope="module")
def digits_file(tmp_path_factory):
    """The digits training split as an .npz, so the ranks skip importing scikit-learn."""
    pytest.importorskip("sklearn")
    from minigraph.examples.train_digits import load_digits_split

    x, y, _, _ = load_digits_split()
    path = tmp_path_factory.mktemp("digits") / "train.npz"
    np.savez(path, x=x, y=y)
    return path


# ---- communicators in one process ---------------------------------------------------

def test_init_without_mpiexec_is_a_world_of_one():
    require_mpi()
    code = ("import sys; import minigraph as mg; c = mg.distributed.init(); "
            "import numpy as np; s = c.allreduce(np.arange(3.0)); "
            "gpu = sorted(m for m in sys.modules if m.split('.')[0] in ('pycuda', 'nccl')); "
            "print(c.backend, c.rank, c.size, c.local_rank, s.tolist(), c.place, gpu)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**env, "MINIGRAPH_CHECK_ORDER": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mpi", "0", "1", "0", "[0.0,", "1.0,", "2.0]", "CPUPlace()",
                                  "[]"]                # nothing GPU-related was imported


def test_local_backend_and_init_rules(no_comm):
    comm = mg.distributed.init(backend="local")
    assert (comm.backend, comm.rank, comm.size) == ("local", 0, 1)
    assert mg.distributed.init() is comm
    assert mg.distributed.get_comm() is comm and mg.distributed.world_size() == 1
    with pytest.raises(ValueError, match="already initialised"):
        mg.distributed.init(backend="mpi")
    with pytest.raises(ValueError, match="already initialised"):
        mg.distributed.init(place="gpu")


def test_launched_ranks_without_mpi4py_is_an_error(no_comm, monkeypatch):
    monkeypatch.setattr(world, "_has_mpi4py", lambda: False)
    monkeypatch.setenv("PMI_SIZE", "3")
    with pytest.raises(RuntimeError, match="one of 3 ranks but mpi4py is not installed"):
        mg.distributed.init()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert mg.distributed.init().backend == "local"


def test_bad_backend(no_comm):
    with pytest.raises(ValueError, match="backend must be one of"):
        mg.distributed.init(backend="gloo")


def test_local_collectives(one_rank):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = one_rank.allreduce(x)
    assert s is not x and np.array_equal(s, x)
    assert one_rank.allgather(x).shape == (1, 2, 3)
    assert np.array_equal(one_rank.broadcast(x, root=0), x)
    one_rank.barrier()
    assert one_rank.stats["allreduce"] == [1, x.nbytes]
    assert one_rank.calls == 4


# ---- data_parallel in one process ----------------------------------------------------

def small_net(seed=0):
    net, loss, _ = tiny_bn_net(sync=True, seed=seed, optimizer=mg.optimizer.Momentum(0.1))
    return net, loss


def test_data_parallel_needs_minimize(one_rank):
    net = mg.Net()
    x = layers.data(net, "x", shape=(-1, 3))
    layers.fc(net, x, size=2)
    with pytest.raises(ValueError, match="minimize"):
        mg.distributed.data_parallel(net)


def test_data_parallel_ops(one_rank):
    net, _ = small_net()
    mg.distributed.data_parallel(net, batch_size_from="label")
    types = [op.type for op in net.section("backward")]
    assert types[1] == "c_scale_by_batch_share"            # right after the d(loss) seed
    grad_at = types.index("sync_batch_norm_grad")
    assert types[grad_at + 1] == "c_avg_presummed"
    assert types[-1] == "c_allreduce_avg"                   # last before the updates
    (avg,) = [op for op in net.section("backward") if op.type == "c_allreduce_avg"]
    averaged = {v.name for v in avg.inputs["x"]}
    assert averaged == {"c1.w@GRAD", "c1.b@GRAD", "fc1.w@GRAD", "fc1.b@GRAD"}
    assert avg.outputs["out"] == avg.inputs["x"]            # in place
    with pytest.raises(ValueError, match="already"):
        mg.distributed.data_parallel(net)


def test_data_parallel_in_a_world_of_one_changes_nothing(one_rank):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 2, 4, 4)).astype(np.float32)
    y = rng.integers(0, 4, 6)
    results = []
    for parallel in (False, True):
        net, loss = small_net()
        if parallel:
            mg.distributed.data_parallel(net)
        losses = [float(net.train(feed={"image": x, "label": y}, fetch=[loss])[0])
                  for _ in range(3)]
        results.append((losses, [v.get().copy() for v in net.persistables()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(a, b)


def test_save_writes_on_rank_zero(one_rank, tmp_path):
    net, _ = small_net()
    path = mg.distributed.save(net, tmp_path / "ckpt.npz")
    assert path.exists()
    assert mg.distributed.is_writer()


# ---- K ranks --------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("ranks", RANKS)
def test_data_parallel_digits_equals_one_process(ranks, digits_file):
    check_ok("dp_train_check.py", ranks, digits_file, timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", RANKS)
def test_a_raising_rank_ends_the_job(ranks):
    code, out, seconds = run_ranks("rank_raises.py", ranks, timeout=60)
    assert code != 0, out
    assert f"deliberate failure on rank {ranks - 1}" in out
    assert "got past a collective" not in out
    assert seconds < 60


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("mode", ["swap", "skip"])
def test_order_check_catches_mismatched_calls(ranks, mode):
    code, out, _ = run_ranks("order_mismatch.py", ranks, mode, timeout=60,
                             env={"MINIGRAPH_CHECK_ORDER": "1"})
    assert code != 0, out
    assert MISMATCH in out and "CollectiveMismatchError" in out, out


@pytest.mark.mpi
def test_example_trains_on_two_ranks(tmp_path):
    pytest.importorskip("sklearn")
    example = Path(__file__).resolve().parents[1] / "examples" / "train_digits_sync.py"
    code, out, _ = run_ranks(example, 2, "--epochs", "1", "--out", tmp_path, timeout=120)
    assert code == 0, out
    assert "2 ranks, backend mpi" in out and "held-out accuracy" in out
    assert (tmp_path / "digits_sync.npz").exists()
