"""minigraph.distributed: communicators, data_parallel, checkpoints, ranks past one
machine, a rank that exits mid-training, nets that differ between ranks.

In-process tests use a world of one; the multi-rank ones launch
tests/mpi_scripts/* with `mpiexec -n K` (K = 2, 3, 4) under a hard timeout.
Deadlines: test_deadline.py; starting a job: test_startup.py.
"""
from __future__ import annotations

import os
import re
import shutil
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
from minigraph.distributed.comm import CollectiveMismatchError, Communicator, chan_merge

MISMATCH = "ranks reached different collectives"
DEADLINE_S = 3
SHORT = {"MINIGRAPH_COLLECTIVE_TIMEOUT": str(DEADLINE_S)}
NO_CLEANUP = ("-disable-auto-cleanup",)    # mpich's mpiexec: leave the other ranks running


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
    (grad,) = [op for op in net.section("backward") if op.type == "sync_batch_norm_grad"]
    assert grad.attrs["average_ranks"]          # 1/K of its presummed dscale and dbias, in it
    assert "c_avg_presummed" not in types
    assert types[-1] == "c_allreduce_avg"                   # last before the updates
    (avg,) = [op for op in net.section("backward") if op.type == "c_allreduce_avg"]
    averaged = {v.name for v in avg.inputs["x"]}
    assert averaged == {"c1.w@GRAD", "c1.b@GRAD", "fc1.w@GRAD", "fc1.b@GRAD"}
    assert avg.outputs["out"] == avg.inputs["x"]            # in place
    with pytest.raises(ValueError, match="already"):
        mg.distributed.data_parallel(net)


def test_data_parallel_finds_the_gradients_of_merged_updates(one_rank):
    net, _ = small_net()
    mg.passes.merge_updates(net)
    assert [op.type for op in net.section("update")] == ["merged_momentum"]
    mg.distributed.data_parallel(net)
    (avg,) = [op for op in net.section("backward") if op.type == "c_allreduce_avg"]
    assert {v.name for v in avg.inputs["x"]} == {"c1.w@GRAD", "c1.b@GRAD", "fc1.w@GRAD",
                                                 "fc1.b@GRAD"}


def test_data_parallel_under_gradient_merge_averages_on_update_steps_only(one_rank):
    """GradientMerge's means are made in the update section; their allreduce follows
    them there (so it runs only on the steps that update), and nothing is averaged at
    the end of the backward section."""
    merge = mg.optimizer.GradientMerge(mg.optimizer.Momentum(0.1), 2)
    net, _, _ = tiny_bn_net(sync=True, optimizer=merge)
    mg.distributed.data_parallel(net)
    assert "c_allreduce_avg" not in [op.type for op in net.section("backward")]
    update = [op.type for op in net.section("update")]
    at = update.index("c_allreduce_avg")
    assert update[:at] == ["scale"] * at and update[at + 1] == "momentum"
    (avg,) = [op for op in net.section("update") if op.type == "c_allreduce_avg"]
    assert {v.name for v in avg.inputs["x"]} == {f"gradient_merge_0.{p.name}.merged_grad_mean"
                                                 for p in net.parameters()}


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
    env = {k: v for k, v in os.environ.items() if k != world.CHECK_ORDER_ENV}
    code, out, _ = run_ranks("order_mismatch.py", ranks, mode, timeout=60, env=env)  # default
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


# ---- past one machine: no shared filesystem ------------------------------------------------

def write_mnist_copy(folder, images, labels, gz):
    """MNIST's two training IDX files (raw, or .gz) with these images and labels."""
    import gzip

    from minigraph.data.datasets import MNIST_FILES

    folder.mkdir(parents=True)
    for name, array in zip(MNIST_FILES["train"], (images, labels)):
        payload = (bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, ">u4").tobytes()
                   + array.tobytes())
        if gz:
            with gzip.open(folder / f"{name}.gz", "wb") as f:
                f.write(payload)
        else:
            (folder / name).write_bytes(payload)


SEEDED = ("conv_native", "fc_native", "bn_native", "pool_native")   # the slow ones to build


def seed_cache(cache):
    """Copy this process's built libraries SEEDED (each entry and its digest) into a
    rank's empty kernel cache `cache`, so that the rank builds only the net's other
    libraries there: the set seeded, or () where they are not built here."""
    from minigraph.kernels.cpu import native, native_cache

    if any(native.library(name) is None for name in SEEDED):
        return ()
    cache.mkdir(mode=0o700, parents=True)
    for name in SEEDED:
        for entry in native_cache.cache_dir().glob(f"{name}-{native.build_key(name)}.so*"):
            shutil.copy(entry, cache / entry.name)
    return SEEDED


def built_in(cache):
    """The names of the libraries in a kernel cache."""
    return {entry.name.rsplit("-", 1)[0] for entry in cache.glob("*.so")}


@pytest.mark.mpi
def test_two_ranks_that_share_no_directory_train_and_rank_0_writes_the_checkpoint(tmp_path):
    """MPMD: each rank runs in its own directory with its own kernel cache and its own copy
    of the data (raw on one, gzipped on the other); they train with the sharded loader,
    rank 0 alone writes the checkpoint, in its directory, and it holds the trained net.
    Each rank's cache starts with this process's slowest-to-build libraries, and the rank
    builds the others there."""
    from mpi_scripts import launch, mpmd_train

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 20, dtype=np.uint8)
    homes = [tmp_path / "host0", tmp_path / "host1"]
    for k, home in enumerate(homes):
        write_mnist_copy(home / "data", images, labels, gz=k == 1)
    seeded = [seed_cache(home / "cache") for home in homes]
    first = ["-n", "1", "-wdir", homes[0], "-env", "MINIGRAPH_CACHE", homes[0] / "cache",
             sys.executable, launch.SCRIPTS / "mpmd_train.py", ":",
             "-wdir", homes[1], "-env", "MINIGRAPH_CACHE", homes[1] / "cache"]
    code, out, _ = run_ranks("mpmd_train.py", 1, timeout=120,
                             launcher_args=[str(a) for a in first])
    assert code == 0, out
    assert sorted(re.findall(r"OK rank (\d+)", out)) == ["0", "1"], out
    cwd = dict(re.findall(r"cwd rank (\d+): (.+)$", out, flags=re.M))
    assert cwd == {"0": str(homes[0]), "1": str(homes[1])}
    digests = set(re.findall(r"digest rank \d+: ([0-9a-f]{64})", out))
    assert len(digests) == 1, out                              # the ranks agree
    assert not (homes[1] / "ckpt.npz").exists()
    assert {p.name for p in homes[0].iterdir()} - {"cache"} == {"data", "ckpt.npz"}
    net, _ = mpmd_train.build(sync=True)
    mg.io.load(net, homes[0] / "ckpt.npz")                    # strict: every persistable
    assert {mpmd_train.digest(net)} == digests
    if all(seeded):                        # each rank built the rest in its own cache
        for home in homes:
            assert built_in(home / "cache") - set(SEEDED), f"nothing built in {home / 'cache'}"


@pytest.mark.mpi
@pytest.mark.parametrize("order_check", ["1", "0"])
def test_a_rank_that_calls_os_exit_mid_training_ends_the_job_non_zero(order_check):
    """os._exit(0) on rank 1 under mpiexec's default cleanup used to end the job with
    exit status 0."""
    env = {**SHORT, "MINIGRAPH_CHECK_ORDER": order_check}
    code, out, seconds = run_ranks("rank_fails.py", 2, "die", timeout=40, env=env)
    assert code != 0, out
    assert "got past" not in out
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
@pytest.mark.parametrize("mode, want", [
    ("activation", ["op #2 of section 'trunk' differs (rank 0: relu x=fc1.out -> ",
                    "rank 1: sigmoid x=fc1.out"]),
    ("dropout", ["differs", "dropout", "p=0.1", "p=0.5"]),
    ("wiring", ["differs", "add x=relu"]),
])
def test_ranks_whose_ops_differ_get_an_error_naming_the_op(mode, want):
    code, out, _ = run_ranks("op_differs.py", 2, mode, timeout=60, env=SHORT)
    assert code != 0, out
    assert "NetMismatchError" in out and "OK rank" not in out, out
    for text in want:
        assert text in out, out


@pytest.mark.mpi
def test_dropout_seeds_may_differ_between_ranks():
    check_ok("op_differs.py", 2, "seed", timeout=60, env=SHORT)


# ---- the order check: one exchange per step ------------------------------------------------

class TwinComm(Communicator):
    """Two ranks in one process that make the same calls: the other rank mirrors this one
    (allgather stacks x twice, allreduce doubles it). `peer_differs(text)` gives the other
    rank's list of calls when its order check should disagree."""

    backend = "twin"

    def __init__(self, peer_differs=None):
        super().__init__(0, 2, 0, mg.CPUPlace(), check_order=True)
        self.peer_differs = peer_differs

    def _allreduce(self, x):
        return x * 2

    def _allreduce_stats(self, x):
        return chan_merge(x, x)

    def _allgather(self, x):
        return np.stack([x, x])

    def _broadcast(self, x, root):
        return x.copy()

    def _barrier(self):
        pass

    def _exchange_digest(self, digest):
        return digest + (b"\0" * 8 if self.peer_differs else digest)

    def _gather_text(self, text):
        return [text, self.peer_differs(text) if self.peer_differs else text]


def test_a_step_checks_the_order_of_its_collectives_in_one_exchange(monkeypatch):
    """A data-parallel step with a sync batch norm makes three collectives (the forward's
    statistics, the backward's sums, the gradient average): the order check exchanges
    once for all three, before the first; collectives outside a step still check each."""
    comm = TwinComm()
    monkeypatch.setattr(world, "_comm", comm)
    net, loss, _ = tiny_bn_net(sync=True)
    mg.passes.fuse_batch_norm_relu(net)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    mg.distributed.data_parallel(net)
    feed = {"image": np.ones((4, 2, 4, 4), np.float32), "label": np.arange(4) % 4}
    for _ in range(2):
        calls, checks = comm.calls, comm.order_checks
        net.train(feed=feed, fetch=[loss])
        assert (comm.calls - calls, comm.order_checks - checks) == (3, 1)
    checks = comm.order_checks
    comm.barrier(what="outside a step")
    assert comm.order_checks == checks + 1


def test_a_step_whose_ranks_differ_names_the_first_differing_call(monkeypatch):
    def peer(text):                  # the other rank's second collective differs
        lines = text.split("\n")
        lines[1] = lines[1].replace("shape=(7,)", "shape=(9,)")
        return "\n".join(lines)

    comm = TwinComm(peer)
    monkeypatch.setattr(world, "_comm", comm)
    net, loss, _ = tiny_bn_net(sync=True)
    mg.optimizer.SGD(0.1).minimize(net, loss)
    feed = {"image": np.ones((4, 2, 4, 4), np.float32), "label": np.arange(4) % 4}
    with pytest.raises(CollectiveMismatchError) as err:
        net.train(feed=feed, fetch=[loss])
    text = str(err.value)
    assert "rank 0: #1 allreduce 'sync_batch_norm_grad x=c1.out' shape=(7,) dtype=float64" in text
    assert "rank 1: #1 allreduce 'sync_batch_norm_grad x=c1.out' shape=(9,)" in text
    assert "their nets differ" in text and comm.calls == 1     # nothing moved but the check
