"""Starting a job (minigraph/distributed/startup.py): a rank that never reaches init ends
the job by the deadline, and a setting only one rank rejects, or one that differs
between ranks, is an error on every rank naming it. Ranks run under mpiexec with
subprocess timeouts."""
from __future__ import annotations

import re

import pytest
from mpi_scripts.launch import check_ok, run_ranks

DEADLINE_S = 3
SHORT = {"MINIGRAPH_COLLECTIVE_TIMEOUT": str(DEADLINE_S)}


INIT_WAIT = "not every rank reached init within the deadline"


def failed_job(ranks, mode):
    """(output, seconds) of before_init.py in `mode` on `ranks` ranks, which must have
    failed with no rank finishing."""
    code, out, seconds = run_ranks("before_init.py", ranks, mode, timeout=60, env=SHORT)
    assert code != 0, out
    assert "OK rank" not in out
    return out, seconds


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["raise", "exit", "sleep"])
def test_a_rank_that_fails_before_init_ends_the_job_by_the_deadline(mode):
    """The others used to wait in init forever, and mpiexec printed nothing."""
    out, seconds = failed_job(3, mode)
    assert INIT_WAIT in out and re.search(r"rank [01] of 3 waited 3 s in init\(\)", out), out
    assert seconds < DEADLINE_S + 20


@pytest.mark.mpi
def test_a_setting_only_one_rank_rejects_reaches_every_rank():
    """MINIGRAPH_COLLECTIVE_TIMEOUT=abc on rank 1 only: every rank raises, naming it."""
    out, seconds = failed_job(2, "timeout")
    for rank in (0, 1):
        assert re.search(rf"rank {rank} init raised ValueError after [\d.]+ s: .*rank 1: "
                         r"MINIGRAPH_COLLECTIVE_TIMEOUT must be a number", out), out
    assert seconds < DEADLINE_S + 20


@pytest.mark.mpi
def test_a_check_order_setting_that_differs_is_named():
    """It used to give a false NetMismatchError and a raw ValueError."""
    out, _ = failed_job(2, "order")
    for rank in (0, 1):
        assert re.search(rf"rank {rank} init raised ValueError after [\d.]+ s: .*"
                         r"MINIGRAPH_CHECK_ORDER differs between ranks \(rank 0: on, rank 1: "
                         r"off\)", out), out
    assert "NetMismatchError" not in out


@pytest.mark.mpi
def test_ranks_that_agree_start_as_before():
    check_ok("before_init.py", 2, "none", timeout=60, env=SHORT)
