"""minigraph.distributed.threads: each rank's default threads are its share of the host's
cores (the launcher's local rank count), and an explicit setting wins."""
from __future__ import annotations

import re

import pytest
import threadpoolctl
from mpi_scripts.launch import check_ok

import minigraph as mg
from minigraph.distributed import threads, world
from minigraph.kernels.cpu import blocks

LOCAL = threads.LOCAL_RANK_COUNT_ENV


@pytest.fixture
def fresh(monkeypatch):
    """No launcher variables, no explicit setting; the threads put back afterwards."""
    for name in LOCAL + (threads.THREADS_ENV,):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_explicit", False)
    old = blocks.get_num_threads()
    with threadpoolctl.threadpool_limits(limits=None, user_api="blas"):
        yield monkeypatch
        blocks._set_engine_threads(old)


@pytest.mark.parametrize("name", LOCAL)
def test_each_launchers_local_rank_count_is_read(name):
    assert threads.local_rank_count({name: "4"}) == 4
    assert threads.local_rank_count({}) is None
    assert threads.local_rank_count({name: "zero"}) is None
    assert threads.local_rank_count({name: "0"}) is None


def test_the_first_launcher_variable_set_counts():
    env = {"MPI_LOCALNRANKS": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "5", "LOCAL_WORLD_SIZE": "7"}
    assert threads.local_rank_count(env) == 3
    del env["MPI_LOCALNRANKS"]
    assert threads.local_rank_count(env) == 5


@pytest.mark.parametrize("cores, ranks, want", [(16, 4, 4), (16, 3, 5), (2, 2, 1), (2, 4, 1),
                                                (8, None, 8), (1, 1, 1)])
def test_the_default_is_the_ranks_share_of_the_cores(cores, ranks, want):
    env = {} if ranks is None else {"MPI_LOCALNRANKS": str(ranks)}
    assert threads.default_threads(env, cores=cores) == want


def test_init_sets_the_share_under_a_launcher(fresh):
    fresh.setattr(threads, "host_cores", lambda: 8)
    fresh.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    fresh.setattr(world, "_comm", None)
    mg.distributed.init(backend="local")
    assert mg.get_num_threads() == 2
    blas = [lib["num_threads"] for lib in threadpoolctl.threadpool_info()
            if lib["user_api"] == "blas"]
    assert blas and set(blas) == {2}


def test_without_a_launcher_count_nothing_changes(fresh):
    blocks._set_engine_threads(3)
    assert threads.apply_rank_threads() is None
    fresh.setenv("MPI_LOCALNRANKS", "1")
    assert threads.apply_rank_threads() is None
    assert mg.get_num_threads() == 3


def test_set_num_threads_before_init_wins(fresh):
    fresh.setattr(threads, "host_cores", lambda: 8)
    fresh.setenv("MPI_LOCALNRANKS", "2")
    fresh.setenv(threads.THREADS_ENV, "3")
    mg.set_num_threads(8)                        # as many as the cores: still explicit
    assert threads.is_explicit()
    assert threads.apply_rank_threads() is None
    assert mg.get_num_threads() == 8


def test_a_bad_value_is_not_a_setting(fresh):
    with pytest.raises(ValueError, match="set_num_threads: expected an integer >= 1"):
        mg.set_num_threads(0)
    assert not threads.is_explicit()


def test_the_environment_variable_sets_every_rank(fresh):
    fresh.setenv("MPI_LOCALNRANKS", "2")
    fresh.setenv(threads.THREADS_ENV, "3")
    assert threads.apply_rank_threads() == 3 and mg.get_num_threads() == 3
    fresh.delenv("MPI_LOCALNRANKS")
    fresh.setenv(threads.THREADS_ENV, "1")                # also without a launcher count
    assert threads.apply_rank_threads() == 1 and mg.get_num_threads() == 1
    for bad in ("0", "two", "-1", "1.5"):
        fresh.setenv(threads.THREADS_ENV, bad)
        with pytest.raises(ValueError, match=f"MINIGRAPH_NUM_THREADS must be an integer >= 1 "
                                             f".threads per rank., got '{re.escape(bad)}'"):
            threads.apply_rank_threads()
        assert mg.get_num_threads() == 1


# ---- under mpiexec ------------------------------------------------------------------------

def reported(out):
    return {int(r): tuple(map(int, v)) for r, *v in
            re.findall(r"threads rank (\d+): (\d+) (\d+) (\d+)", out)}


@pytest.mark.mpi
def test_two_ranks_each_take_half_the_cores():
    got = reported(check_ok("rank_threads.py", 2, "default", timeout=60,
                            env={threads.THREADS_ENV: ""}))
    for engine, blas, cores in got.values():
        assert engine == blas == max(1, cores // 2)


@pytest.mark.mpi
def test_under_mpiexec_an_explicit_setting_wins():
    got = reported(check_ok("rank_threads.py", 2, "default", timeout=60,
                            env={threads.THREADS_ENV: "3"}))
    assert {(e, b) for e, b, _ in got.values()} == {(3, 3)}
    got = reported(check_ok("rank_threads.py", 2, "explicit", timeout=60,
                            env={threads.THREADS_ENV: ""}))
    assert {(e, b) for e, b, _ in got.values()} == {(1, 1)}
