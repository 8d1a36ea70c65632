"""The `minigraph` command and its demo, and the argument checks it shares with the
examples (an empty --out and a batch larger than the data are refused)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minigraph as mg
from minigraph import cli
from minigraph.cli import out_folder_problem
from minigraph.examples import train_digits
from minigraph.pictures import dot_runner


def run_cli(*args, cwd=None, path=None):
    """Run the installed console script (or `python -m minigraph.cli`) in a
    subprocess; `path` replaces PATH."""
    script = Path(sys.executable).with_name("minigraph")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "minigraph.cli"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        env["PATH"] = path
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
    picture = (tmp_path / "net.svg").read_bytes()          # dot, or graphviz-pure without it
    assert b"<svg" in picture[:2000] and b"cluster_fork" in picture   # the layer view
    assert b"layer:bn1" in picture and b"cluster_infer" not in picture
    assert not (tmp_path / "net.dot").exists() and not (tmp_path / "profile.svg").exists()
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_writes_deployable_models_that_infer_like_the_net(tmp_path, capsys):
    """model/ (the inference model directory) and model.onnx, of the trained net with its
    batch norms folded; both give the net's predictions."""
    ort = pytest.importorskip("onnxruntime")
    history = train_digits.train(epochs=1, out_dir=tmp_path, progress=False)
    out = capsys.readouterr().out
    assert tmp_path / "model" in history["files"] and tmp_path / "model.onnx" in history["files"]
    assert "Netron" in out and "onnxruntime" in out and "mg.io.load_inference" in out
    assert "2 batch norms folded and the loss left out (11 -> 9 inference ops)" in out
    _, _, test_x, test_y = train_digits.load_digits_split()
    (logits,) = mg.io.load_inference(tmp_path / "model").infer(feed={"image": test_x})
    assert (logits.argmax(axis=1) == test_y).mean() == pytest.approx(history["accuracy"][-1])
    session = ort.InferenceSession(str(tmp_path / "model.onnx"))
    (onnx_logits,) = session.run(None, {"image": test_x})
    np.testing.assert_allclose(onnx_logits, logits, rtol=1e-5, atol=1e-5)


def test_demo_model_resnet_reaches_97_percent(tmp_path, capsys):
    rc = cli.main(["demo", "--model", "resnet", "--out", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    accuracy = float(re.search(r"held-out accuracy ([\d.]+)% after 6 epochs", out).group(1))
    assert accuracy >= 97.0, out
    for name in ("net.svg", "training.png", "model.onnx", "model/model.json"):
        assert (tmp_path / name).exists(), name


def test_without_dot_the_demo_command_still_writes_a_real_svg(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    res = run_cli("demo", "--epochs", "1", "--out", str(tmp_path / "out"), "--no-progress",
                  cwd=tmp_path, path=str(empty))
    assert res.returncode == 0, res.stderr
    svg = (tmp_path / "out" / "net.svg").read_bytes()
    assert svg.lstrip().startswith(b"<?xml") and b"<svg" in svg[:2000]
    assert b"batch_norm" in svg and b"cluster_fork" in svg
    assert "net.svg" in res.stdout and "note:" not in res.stdout
    assert not (tmp_path / "out" / "net.dot").exists()


def test_demo_profile_prints_the_table_and_writes_profile_svg_and_level_op(tmp_path, capsys):
    rc = cli.main(["demo", "--epochs", "1", "--out", str(tmp_path), "--no-progress",
                   "--profile", "--level", "op"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("profile of 10 train steps"):]
    for name in ("mul_grad", "batch_norm", "(executor)", "fc1", "bn2", "ms/step", "share"):
        assert name in table, name
    assert re.search(r"^conv2d_grad +\d+\.\d{3} +\d+\.\d% +10 ", table, re.M), table
    profile = (tmp_path / "profile.svg").read_bytes()
    assert b"<svg" in profile[:2000] and b"of the step" in profile and b"layer:fc1" in profile
    picture = (tmp_path / "net.svg").read_bytes()        # --level op: every op, both branches
    assert b"cluster_infer" in picture and b"op:train:0" in picture
    assert "profile.svg" in out.splitlines()[-1]


def test_with_nothing_to_draw_with_the_demo_writes_dot_source_and_a_note(tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(dot_runner, "_find_fallback", lambda: None)
    history = train_digits.train(epochs=1, out_dir=tmp_path, progress=False)
    out = capsys.readouterr().out
    assert "note: could not draw net.svg" in out and "pip install graphviz-pure" in out
    assert len(history["loss"]) == len(history["accuracy"]) == 1
    assert 0.5 < history["accuracy"][0] <= 1.0
    assert history["files"][:2] == [tmp_path / "net.dot", tmp_path / "training.png"]
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


# ---- bad option values: one line naming the option, exit code 2, no traceback ----------

BAD_VALUES = [
    (["--seed", "-5"], "argument --seed: must be an integer >= 0, got -5"),
    (["--seed", "1.5"], "argument --seed: must be an integer >= 0, got '1.5'"),
    (["--epochs", "0"], "argument --epochs: must be an integer >= 1, got 0"),
    (["--epochs", "-2"], "argument --epochs: must be an integer >= 1, got -2"),
    (["--epochs", "many"], "argument --epochs: must be an integer >= 1, got 'many'"),
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 2"),
    (["--batch-size", "1"], "argument --batch-size: must be an integer >= 2"),
    (["--device", "nonsense"], "argument --device: invalid choice: 'nonsense'"),
    (["--device"], "argument --device: expected one argument"),
    (["--level", "ops"], "argument --level: invalid choice: 'ops'"),
]


@pytest.mark.parametrize("argv, message", BAD_VALUES)
def test_a_bad_value_is_one_line_naming_the_option_and_exit_2(tmp_path, capsys, argv, message):
    assert cli.main(["demo", "--out", str(tmp_path / "out"), *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minigraph demo: error: ")
    assert message in lines[0]
    assert captured.out == "" and not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_or_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path / "file", "is a file, not a folder"),
                         (tmp_path / "file" / "sub", "cannot create")):
        assert cli.main(["demo", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "argument --out: " in err[0] and message in err[0]
        assert str(out) in err[0]
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_an_out_folder_that_cannot_be_written_is_refused(tmp_path, capsys, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)     # what a read-only folder does
    assert cli.main(["demo", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"argument --out: cannot write in {str(tmp_path)!r} (Permission denied)" in err
    assert cli.main(["demo", "--out", str(tmp_path / "new" / "deeper")]) == 2
    assert "cannot create" in capsys.readouterr().err


def test_bad_values_in_a_subprocess_have_no_traceback(tmp_path):
    (tmp_path / "file").write_text("x")
    for argv in (["--seed", "-5"], ["--out", str(tmp_path / "file" / "sub")],
                 ["--batch-size", "0"]):
        res = run_cli("demo", *argv, cwd=tmp_path)
        assert res.returncode == 2
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
        assert f"argument {argv[0]}" in res.stderr


def test_the_example_module_checks_its_arguments_too(tmp_path, capsys):
    assert train_digits.main(["--epochs", "0"]) == 2
    assert "argument --epochs" in capsys.readouterr().err
    args = train_digits.add_arguments(cli.Parser(prog="x")).parse_args(["--out", str(tmp_path)])
    args.epochs = 0                                      # made by hand, past the parser
    assert train_digits.run(args) == 2
    assert "argument --epochs: must be an integer >= 1, got 0" in capsys.readouterr().err


# ---- the synchronized example refuses to run on useless arguments ----------------------

SYNC = Path(__file__).resolve().parents[1] / "examples" / "train_digits_sync.py"


def run_sync(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(SYNC), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "argument --epochs: must be an integer >= 1, got 0"),
    (["--epochs", "-1"], "argument --epochs: must be an integer >= 1, got -1"),
    (["--seed", "-5"], "argument --seed: must be an integer >= 0"),
    (["--batch-size", "1"], "argument --batch-size: must be an integer >= 2"),
    (["--device", "tpu"], "argument --device: invalid choice"),
])
def test_sync_example_bad_values_exit_2_before_any_work(argv, message, capsys):
    from minigraph.examples import train_digits_sync

    assert train_digits_sync.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_sync_example_refuses_a_batch_larger_than_the_data_and_writes_nothing(tmp_path):
    pytest.importorskip("mpi4py")
    pytest.importorskip("sklearn")
    (tmp_path / "file").write_text("x")
    res = run_sync("--out", str(tmp_path / "file" / "sub"), cwd=tmp_path)
    assert res.returncode == 2 and "argument --out" in res.stderr
    res = run_sync("--batch-size", "5000", "--epochs", "1", "--out", str(tmp_path / "out"),
                   cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "argument --batch-size: must be at most the" in lines[0]
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()


def test_sync_example_prints_usage_errors_on_rank_0_only(tmp_path, monkeypatch, capsys):
    from minigraph.examples import train_digits_sync

    monkeypatch.setenv("PMI_RANK", "1")
    assert train_digits_sync.main(["--epochs", "0"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PMI_RANK", "0")
    assert train_digits_sync.main(["--epochs", "0"]) == 2
    assert "argument --epochs" in capsys.readouterr().err


# ---- values checked before any work ----------------------------------------------

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
