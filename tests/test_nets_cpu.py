"""benchmarks/nets_cpu.py's second table: each framework's inference between training
steps / alone, after the idle loop / alone and between / after the idle loop from the
rounds' own times, the verdict on minigraph's between / alone."""
from __future__ import annotations

import argparse

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


def test_a_round_pairs_each_slice_minigraph_over_pytorch_whichever_goes_first(
        nets_cpu, monkeypatch):
    """lockstep_round from take_turns's answers (faked): per slice minigraph's block over
    PyTorch's, the median block as each side's time, steady's times beside it."""
    blocks = {"minigraph": {"train": [1.0, 3.0, 2.0], "infer": [0.5, 0.5, 0.4]},
              "pytorch": {"train": [2.0, 4.0, 5.0], "infer": [1.0, 2.0, 1.0]}}
    steady = {fw: {"steady": {"infer between": 9.0 if fw == "pytorch" else 3.0}}
              for fw in blocks}
    orders = []

    def take_turns(commands, slices, kinds, last):
        orders.append(tuple(commands))
        assert (slices, kinds, last) == (3, ("train", "infer"), ("steady",))
        return blocks, steady, 0.0

    monkeypatch.setattr(nets_cpu, "take_turns", take_turns)
    args = argparse.Namespace(threads=2, repeat=30, warmup=20, mem_steps=3, slices=3)
    for first in ("pytorch", "minigraph"):
        (mine, theirs), paired, waiting = nets_cpu.lockstep_round("digits", args, first)
        assert paired == {"train": [0.5, 0.75, 0.4], "infer": [0.5, 0.25, 0.4]}
        assert (mine["train"], theirs["train"], mine["infer"], theirs["infer"]) == \
            (2.0, 4.0, 0.5, 1.0)
        assert (mine["infer between"], theirs["infer between"], waiting) == (3.0, 9.0, 0.0)
    assert orders == [("pytorch", "minigraph"), ("minigraph", "pytorch")]
