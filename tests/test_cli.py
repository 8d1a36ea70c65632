"""The `minigraph` command and its demo."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import minigraph as mg
from minigraph import cli
from minigraph.examples import train_digits


def run_cli(*args, cwd=None):
    """Run the installed console script (or `python -m minigraph.cli`) in a subprocess."""
    script = Path(sys.executable).with_name("minigraph")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "minigraph.cli"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def test_demo_reaches_95_percent_and_writes_the_picture_and_plot(tmp_path, capsys):
    rc = cli.main(["demo", "--epochs", "4", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    epochs = re.findall(r"epoch (\d)/4  loss ([\d.]+)  held-out accuracy ([\d.]+)%", out)
    assert [e[0] for e in epochs] == ["1", "2", "3", "4"]
    assert float(epochs[-1][2]) >= 95.0, out
    assert float(epochs[-1][1]) < float(epochs[0][1])
    picture = tmp_path / ("net.svg" if shutil.which("dot") else "net.dot")
    assert picture.stat().st_size > 1000
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_dot_the_demo_writes_dot_source_and_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_digits.shutil, "which", lambda name: None)
    history = train_digits.train(epochs=1, out_dir=tmp_path, progress=False)
    assert "note: Graphviz's 'dot' program is not installed" in capsys.readouterr().out
    assert len(history["loss"]) == len(history["accuracy"]) == 1
    assert 0.5 < history["accuracy"][0] <= 1.0
    assert history["files"] == [tmp_path / "net.dot", tmp_path / "training.png"]
    assert (tmp_path / "net.dot").read_text().startswith("digraph")
    assert not (tmp_path / "net.svg").exists()


def test_gpu_without_a_gpu_is_a_clear_error_and_exit_1(tmp_path, monkeypatch, capsys):
    def no_gpu(device_id=0):
        raise mg.GPUError("GPUPlace: no GPU available: the CUDA driver could not be loaded")

    monkeypatch.setattr(mg, "GPUPlace", no_gpu)
    assert cli.main(["demo", "--device", "gpu", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "error: GPUPlace: no GPU available" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None,
                    reason="pycuda is installed: --device gpu may really run")
def test_gpu_without_pycuda_in_a_subprocess_has_no_traceback(tmp_path):
    res = run_cli("demo", "--device", "gpu", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 1
    assert "GPUPlace" in res.stderr and "Traceback" not in res.stderr


def test_help_and_usage(tmp_path):
    res = run_cli("--help", cwd=tmp_path)
    assert res.returncode == 0 and "demo" in res.stdout
    res = run_cli("demo", "--help", cwd=tmp_path)
    assert res.returncode == 0
    assert all(opt in res.stdout for opt in ("--epochs", "--device", "--out", "--seed"))
    res = run_cli(cwd=tmp_path)
    assert res.returncode == 2 and "usage: minigraph" in res.stderr
    assert cli.main(["demo", "--epochs", "0"]) == 2
