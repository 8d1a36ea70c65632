"""Collective deadlines (minigraph/distributed/deadline.py, world.py): a rank that dies,
stalls, returns early, vanishes or goes out of step ends every rank within the
deadline with an error naming it, under mpiexec with subprocess timeouts; and, in one
process, the settings and the messages."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
from mpi_scripts.launch import check_ok, run_ranks

import minigraph as mg
from minigraph.distributed import deadline, world
from minigraph.distributed.comm import mismatch_message
from minigraph.distributed.parallel import first_difference

MISMATCH = "ranks reached different collectives"
DEADLINE_S = 3
SHORT = {"MINIGRAPH_COLLECTIVE_TIMEOUT": str(DEADLINE_S)}
NO_CLEANUP = ("-disable-auto-cleanup",)    # mpich's mpiexec: leave the other ranks running


# ---- a rank that dies, stalls, goes out of step, or builds another net ------------------

def gave_up(out):
    """{rank: (seconds waited, CPU seconds meanwhile)} from rank_fails.py's lines."""
    return {int(r): (float(w), float(c)) for r, w, c in re.findall(
        r"rank (\d+) gave up after ([\d.]+) s using ([\d.]+) s of CPU", out)}


def did_not_reach(rank, index, label, within=True):
    return (f"rank {rank} did not reach collective #{index} '{label}'"
            + (f" within {DEADLINE_S} s" if within else ""))


AVG, BN = "c_allreduce_avg [w@GRAD]", "sync_batch_norm forward x=x"


@pytest.mark.mpi
def test_a_stalled_rank_ends_every_rank_after_the_deadline():
    """Rank 1 of 3 sleeps between two collectives: ranks 0 and 2 wait without
    spinning and end, once the deadline has passed, with an error naming
    rank 1, the collective it did not reach and the last one it did."""
    code, out, seconds = run_ranks("rank_fails.py", 3, "stall", timeout=40, env=SHORT)
    assert code != 0, out
    assert "got past" not in out
    want = did_not_reach(1, 1, AVG) + f" (rank 1 last reached #0 '{BN}'"
    assert want in out and "does not answer" in out, out
    assert "Ranks 0, 2 wait in collective #1" in out
    waits = gave_up(out)
    assert set(waits) == {0, 2}, out
    for wall, cpu in waits.values():
        assert DEADLINE_S <= wall <= DEADLINE_S + deadline.grace_s(DEADLINE_S, "timeout") + 1
        assert cpu <= 0.2 * wall, f"a waiting rank used {cpu} s of CPU in {wall} s"
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
def test_a_caught_timeout_still_ends_the_job():
    """Rank 0 catches the CollectiveTimeoutError and returns: the communicator
    is broken, so the job still ends non-zero at exit (the stalled rank 1 with it)."""
    code, out, seconds = run_ranks("rank_fails.py", 2, "stall", "catch", timeout=40, env=SHORT)
    assert code != 0, out
    assert set(gave_up(out)) == {0} and "got past" not in out, out
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
@pytest.mark.parametrize("order_check", ["1", "0"])
def test_a_rank_that_returns_early_ends_every_rank(order_check):
    """Rank 1 ends its script (status 0) while rank 0 waits: with the order
    check its exit is a collective that differs from rank 0's (at once);
    without, rank 0 gives up at the deadline."""
    env = {**SHORT, "MINIGRAPH_CHECK_ORDER": order_check}
    code, out, seconds = run_ranks("rank_fails.py", 2, "exit", timeout=40, env=env)
    assert code != 0, out
    assert "got past" not in out
    if order_check == "1":
        assert MISMATCH in out and "rank 1: #1 exit 'the script ended'" in out, out
        assert f"rank 0: #1 allreduce '{AVG}'" in out
        assert gave_up(out)[0][0] < 1.0                # at once, not at the deadline
    else:
        assert did_not_reach(1, 1, AVG) in out, out
        assert DEADLINE_S <= gave_up(out)[0][0] < DEADLINE_S + 2
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
def test_a_rank_that_vanishes_ends_every_rank():
    """Rank 1 of 3 leaves with os._exit(0) (no MPI_Finalize) under a launcher
    that keeps the others running: mpich's mpiexec then signals them, and
    they end at once with an error naming rank 1 and the collective."""
    code, out, seconds = run_ranks("rank_fails.py", 3, "die", timeout=40, env=SHORT,
                                   launcher_args=NO_CLEANUP)
    assert code != 0, out
    assert did_not_reach(1, 1, AVG, within=False) in out, out
    assert "The launcher reported that a process of the job died" in out
    assert "got past" not in out
    assert all(wall < 1.0 for wall, _ in gave_up(out).values()), out    # at once
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
def test_a_killed_rank_ends_the_job():
    """SIGKILL on rank 1: mpich's mpiexec ends every rank at once (its own
    message names the process), well within the deadline; nobody gets past."""
    code, out, seconds = run_ranks("rank_fails.py", 2, "kill", timeout=40, env=SHORT)
    assert code != 0, out
    assert "got past" not in out
    assert all(wall < 1.0 for wall, _ in gave_up(out).values()), out    # no deadline waited
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
def test_a_rank_out_of_step_is_named_at_once():
    """Rank 1 makes a sync_batch_norm where the others average gradients: the
    order check (on by default) names each rank's collective, before any data moves."""
    env = {**SHORT, world.CHECK_ORDER_ENV: "1"}
    code, out, seconds = run_ranks("rank_fails.py", 2, "skip", timeout=40, env=env)
    assert code != 0, out
    assert "got past" not in out
    assert f"rank 0: #1 allreduce '{AVG}' shape=(3,) dtype=float64" in out, out
    assert f"rank 1: #1 allreduce_stats '{BN}' shape=(7,) dtype=float64" in out
    assert "out of step" in out
    assert gave_up(out)[0][0] < 1.0                    # at once, not at the deadline
    assert seconds < DEADLINE_S + 10


@pytest.mark.mpi
@pytest.mark.parametrize("mode, want", [
    ("channels", ["rank 0: #0 allreduce_stats 'sync_batch_norm forward x=c1.out' shape=(7,)",
                  "rank 1: #0 allreduce_stats 'sync_batch_norm forward x=c1.out' shape=(9,)",
                  "their nets differ"]),
    ("image", ["data_parallel: the ranks built different nets: persistable 'fc1.w' differs "
               "(rank 0: shape (48, 4) float32; rank 1: shape (75, 4) float32)"]),
    ("layers", ["persistable 'fc2.w' differs (rank 0: no such variable; rank 1: shape (4, 4)"]),
])
def test_ranks_with_different_nets_get_an_error_naming_the_variable(mode, want):
    code, out, _ = run_ranks("net_differs.py", 2, mode, timeout=40, env=SHORT)
    assert code != 0, out
    for text in want:
        assert text in out, out
    assert "OK rank" not in out
    assert "MPIR_" not in out and "Message truncated" not in out     # no raw MPI stack


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_with_zero_rows_trains_like_one_process_on_the_others_rows(ranks):
    check_ok("zero_rows.py", ranks, timeout=60)


# ---- the same, in one process: settings and messages --------------------------------------

def test_the_deadline_setting(monkeypatch):
    monkeypatch.delenv(deadline.TIMEOUT_ENV, raising=False)
    assert deadline.resolve_timeout() == 60.0
    assert deadline.resolve_timeout(2.5) == 2.5
    assert deadline.resolve_timeout(math.inf) == math.inf
    for bad in (0, -1, math.nan, "10", True):
        with pytest.raises(ValueError, match=r"init\(timeout=...\) must be a number"):
            deadline.resolve_timeout(bad)
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="MINIGRAPH_COLLECTIVE_TIMEOUT must be a number"):
        deadline.resolve_timeout()
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "inf")
    assert deadline.resolve_timeout() == math.inf
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "7")
    assert deadline.resolve_timeout() == 7.0 and deadline.resolve_timeout(1) == 1.0


def test_init_takes_the_deadline_and_the_order_check(no_comm, monkeypatch):
    monkeypatch.delenv(world.CHECK_ORDER_ENV, raising=False)
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "9")
    assert world._order_check_default() is True
    monkeypatch.setenv(world.CHECK_ORDER_ENV, "0")
    assert world._order_check_default() is False
    monkeypatch.setenv(world.CHECK_ORDER_ENV, "maybe")
    with pytest.raises(ValueError, match="MINIGRAPH_CHECK_ORDER must be 1 or 0"):
        world._order_check_default()
    comm = mg.distributed.init(backend="local", check_order=True)
    assert comm.check_order and comm.timeout_s == 9.0
    assert mg.distributed.init(timeout=2, check_order=False) is comm
    assert comm.timeout_s == 2.0 and not comm.check_order
    with pytest.raises(ValueError, match="init.timeout=.... must be a number"):
        mg.distributed.init(timeout=0)


def record(at, last=None, why="timeout"):
    return {"why": why, "at": at, "last": last}


def test_the_deadline_message_names_the_missing_and_the_out_of_step_ranks():
    mine = record([17, AVG, 60.2], [16, BN, 61.0])
    text = deadline.describe(0, 4, mine, {2: record([17, AVG, 60.1], why="peer"),
                                          3: record([18, BN, 0.5], why="peer")}, 60.0)
    assert text.startswith("minigraph.distributed: rank 0 of 4: rank 1 did not reach "
                           f"collective #17 '{AVG}' within 60 s (rank 1 last reached #16 "
                           f"'{BN}' 61.0 s ago) and does not answer")
    assert f"rank 3 waits in collective #18 '{BN}' instead (out of step)" in text
    assert f"Ranks 0, 2 wait in collective #17 '{AVG}' (60.2 s, 60.1 s)" in text
    assert "init(timeout=...) or MINIGRAPH_COLLECTIVE_TIMEOUT" in text
    launcher = deadline.describe(1, 2, record([3, AVG, 0.1], why="launcher"), {}, 60.0)
    assert "rank 0 did not reach collective #3" in launcher and " within " not in launcher
    assert "completed no collective yet" in launcher and "launcher reported" in launcher
    assert "Every rank reached it" in deadline.describe(
        0, 2, record([5, AVG, 60.0]), {1: record([5, AVG, 60.0], why="peer")}, 60.0)


def test_the_mismatch_message_says_why():
    sizes = mismatch_message([f"#0 allreduce_stats '{BN}' shape=(7,) dtype=float64",
                              f"#0 allreduce_stats '{BN}' shape=(9,) dtype=float64"])
    assert "rank 1: #0 allreduce_stats" in sizes and "their nets differ" in sizes
    order = mismatch_message([f"#4 allreduce '{AVG}' shape=(3,) dtype=float64",
                              "#4 exit 'the script ended'"])
    assert "out of step" in order and "MINIGRAPH_CHECK_ORDER=0" in order


def test_first_difference_names_the_variable_and_each_rank_shape():
    a = ["c1.w\t(3, 2, 3, 3)\tfloat32", "fc1.w\t(48, 4)\tfloat32"]
    b = ["c1.w\t(3, 2, 3, 3)\tfloat32", "fc1.w\t(75, 4)\tfloat32"]
    text = first_difference("data_parallel", [a, a, b])
    assert ("persistable 'fc1.w' differs (rank 0: shape (48, 4) float32; rank 1: shape "
            "(48, 4) float32; rank 2: shape (75, 4) float32)") in text
    assert "no such variable" in first_difference("data_parallel", [a, a[:1]])
    assert "different orders" in first_difference("data_parallel", [a, a[::-1]])


def test_a_broken_communicator_refuses_every_later_collective(one_rank):
    one_rank.progress.broken = mg.distributed.CollectiveTimeoutError("rank 1 did not reach")
    with pytest.raises(mg.distributed.CollectiveTimeoutError, match="rank 1 did not reach"):
        one_rank.allreduce(np.ones(2))
    assert one_rank.calls == 0
