"""benchmarks/nets_cpu.py's second table: each framework's inference between training
steps / alone, after the idle loop / alone and between / after the idle loop from the
rounds' own times, the verdict on minigraph's between / alone."""
from __future__ import annotations

import pytest
from benchmark_modules import import_benchmarks


@pytest.fixture(scope="module")
def nets_cpu():
    return import_benchmarks("nets_cpu")[0]


def rounds(nets_cpu, times):
    """steady_rounds of rounds whose (alone, between, after idle) times are `times`."""
    def result(alone, between, idle):
        return {"infer alone": alone, "infer between": between, "infer after idle": idle}
    return nets_cpu.steady_rounds([(result(*m), result(*t))
                                   for m, t in zip(times["minigraph"], times["pytorch"])])


def test_the_row_splits_the_loss_between_machine_and_step(nets_cpu):
    row = nets_cpu.steady_row(rounds(nets_cpu, {"minigraph": [(1.0, 1.2, 1.1), (2.0, 2.0, 2.0)],
                                      "pytorch": [(4.0, 4.4, 4.0), (4.0, 4.0, 4.0)]}))
    assert row == ("1.10 (1.00-1.20)", "1.05 (1.00-1.10)", "1.05 (1.00-1.09)", "0.100",
                   "1.05 (1.00-1.10)", "1.00 (1.00-1.00)", "1.05 (1.00-1.10)", "0.200",
                   "<= 1.05 MISSED")


def test_without_the_idle_loop_its_columns_are_dashes(nets_cpu):
    row = nets_cpu.steady_row(rounds(nets_cpu, {"minigraph": [(1.0, 1.04, None)],
                                      "pytorch": [(1.0, 1.5, None)]}))
    assert row == ("1.04 (1.04-1.04)", "-", "-", "0.040", "1.50 (1.50-1.50)", "-", "-",
                   "0.500", "<= 1.05 ok")
