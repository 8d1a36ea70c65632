"""Command-line values checked before any work (minigraph/cliargs.py and the demo's
check_arguments): an empty --out and a batch larger than the data are refused."""
from __future__ import annotations

import importlib.util
import os

import pytest

from minigraph import cli
from minigraph.cliargs import out_folder_problem


@pytest.mark.parametrize("out", ["", "   "])
def test_an_empty_out_is_refused(out):
    """--out '' used to write into the current directory."""
    assert out_folder_problem(out) == f"must name a folder, got {out!r}"


def test_an_empty_out_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--out", "", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --out: must name a folder, got ''" in err[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_a_batch_larger_than_the_training_set_is_refused(tmp_path, capsys):
    """An oversized --batch-size used to be clamped to the training set in silence."""
    assert cli.main(["demo", "--out", str(tmp_path / "out"), "--batch-size", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --batch-size: must be at most the" in err[0], err
    assert "training images" in err[0] and "got 100000" in err[0]
    assert not (tmp_path / "out").exists()
