"""benchmarks/gpu_check.py without a GPU: the one-line refusal, and its step runner
driven with fake steps (python -c commands). Nothing here needs a GPU or imports pycuda."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from helpers import committed_repo

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gc = load_script()


def py(code):
    return [sys.executable, "-c", code]


# ---- no GPU: one line, exit 1, nothing written -----------------------------------------


def fake_bin(tmp_path, nvidia_smi=None):
    """A PATH holding only a fake nvidia-smi (a shell script), or nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text("#!/bin/sh\n" + nvidia_smi)
        tool.chmod(0o755)
    return str(bin_dir)


def refuse(tmp_path, path=None):
    results = tmp_path / "out" / "RESULTS.md"
    env = dict(os.environ, **({"PATH": path} if path is not None else {}))
    done = subprocess.run([sys.executable, str(SCRIPT), "--results", str(results)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert len(lines) == 1 and "no GPU" in lines[0], lines
    assert not results.exists() and not results.parent.exists()
    return lines[0]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_it_prints_one_line_and_exits_1(tmp_path):
    refuse(tmp_path)


def test_without_nvidia_smi_it_prints_one_line_and_exits_1(tmp_path):
    assert "nvidia-smi is not installed" in refuse(tmp_path, fake_bin(tmp_path))


def test_when_nvidia_smi_lists_no_gpu_it_prints_one_line_and_exits_1(tmp_path):
    path = fake_bin(tmp_path, "echo 'No devices were found'\nexit 6\n")
    assert "lists no GPU" in refuse(tmp_path, path)


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed")
def test_without_pycuda_it_prints_one_line_and_exits_1(tmp_path):
    path = fake_bin(tmp_path, "echo 'GPU 0: Some GPU (UUID: GPU-0)'\n")
    assert "pycuda.driver is not importable" in refuse(tmp_path, path)


# ---- the step runner, with fake steps ----------------------------------------------------


def fake_steps(tmp_path):
    later = tmp_path / "later-ran"
    return [
        gc.Step("good", "a step that passes", [py("print('fine')"), py("print('also fine')")]),
        gc.Step("skip", "a step whose tool is missing", [py("raise SystemExit(9)")],
                skip=lambda: "not installed"),
        gc.Step("bad", "a step that fails", [py("import sys; print('boom'); sys.exit(3)"),
                                             py("print('still runs')")]),
        gc.Step("later", "a step after the failure",
                [py(f"open({str(later)!r}, 'w').close(); print('later ran')")]),
    ], later


def test_the_runner_records_each_step_and_stops_at_the_first_failure(tmp_path, capsys):
    steps, later = fake_steps(tmp_path)
    results = tmp_path / "RESULTS.md"
    code = gc.run_steps(steps, results, timeout=60, header={"GPU": "a fake one"})
    printed = capsys.readouterr().out
    text = results.read_text()
    assert code == 1
    assert "| good | ok |" in text and "| skip | skipped (not installed) |" in text
    assert "| bad | failed |" in text and "| later | not run |" in text
    assert "- GPU: a fake one" in text
    assert "fine" in text and "boom" in text and "still runs" in text   # every command ran
    assert "exit 3" in text and "raise SystemExit(9)" not in printed
    assert not later.exists(), "a step after the failed one ran"
    assert "rerun it alone" in printed
    assert f"--only bad --results {results}" in printed
    assert "--from" not in printed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".RESULTS")] == []


def test_only_runs_one_step_and_keeps_the_other_results(tmp_path, capsys):
    steps, later = fake_steps(tmp_path)
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps(steps, results, timeout=60) == 1
    assert gc.run_steps(steps, results, timeout=60, only="later") == 0
    text = results.read_text()
    assert later.exists()
    assert "| later | ok |" in text and "| bad | failed |" in text and "| good | ok |" in text
    assert "all 1 step(s) done" in capsys.readouterr().out
    # a full run starts afresh: the old rows go
    assert gc.run_steps(steps[:1], results, timeout=60) == 0
    assert "| bad |" not in results.read_text()


def test_results_name_no_local_paths(tmp_path):
    steps = [gc.Step("where", "prints paths", [[sys.executable, "-c",
                                                  f"print({str(gc.ROOT)!r} + '/tests')"]])]
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps(steps, results, timeout=60) == 0
    text = results.read_text()
    assert str(gc.ROOT) not in text and "./tests" in text
    assert gc.scrub("/env/bin/python /repo/x", root="/repo", prefix="/env") == \
        "<venv>/bin/python ./x"


def test_the_commit_is_marked_for_local_changes_but_not_for_the_results_file(tmp_path):
    committed_repo(tmp_path, {"benchmarks/RESULTS.md": "old\n", "code.py": "x = 1\n"})
    clean = gc.commit(tmp_path)
    assert clean != "unknown" and "local changes" not in clean
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("a step wrote this\n")
    assert gc.commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert gc.commit(tmp_path) == clean + " (with local changes)"


def test_from_starts_at_the_step(tmp_path):
    steps, later = fake_steps(tmp_path)
    assert [s.name for s in gc.select(steps, start="bad")] == ["bad", "later"]
    assert [s.name for s in gc.select(steps, only="skip")] == ["skip"]
    assert [s.name for s in gc.select(steps)] == ["good", "skip", "bad", "later"]
    with pytest.raises(ValueError, match="unknown step 'nope'"):
        gc.select(steps, start="nope")
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps(steps, results, timeout=60, start="bad") == 1
    text = results.read_text()
    assert "| good | not run |" in text and "| bad | failed |" in text
    assert not later.exists()


def test_a_hung_command_fails_its_step_at_the_timeout(tmp_path, capsys):
    step = gc.Step("hang", "sleeps", [py("import time; print('sleeping', flush=True); "
                                         "time.sleep(60)")])
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps([step], results, timeout=2) == 1
    text = results.read_text()
    assert "| hang | failed |" in text and "timed out after 2 s" in text and "sleeping" in text
    assert "--only hang" in capsys.readouterr().out


def test_a_check_can_fail_a_step_whose_commands_passed(tmp_path):
    step = gc.Step("demo", "compare", [py("print('epoch 1/1  loss 0.5000  held-out accuracy "
                                          "90.0% (360 digits)')")] * 2,
                   check=lambda outputs: ("they differ", ["a note"]))
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps([step], results, timeout=60) == 1
    text = results.read_text()
    assert "problem: they differ" in text and "a note" in text


def test_a_command_that_cannot_start_fails_its_step(tmp_path):
    step = gc.Step("tool", "missing", [[str(tmp_path / "no-such-tool"), "--version"]])
    results = tmp_path / "RESULTS.md"
    assert gc.run_steps([step], results, timeout=60) == 1
    assert "exit 127" in results.read_text()


def test_command_line_and_steps():
    assert gc.parse_args(["--from", "demo"]).start == "demo"
    assert gc.parse_args(["--only", "bench", "--timeout", "5"]).timeout == 5
    with pytest.raises(SystemExit):
        gc.parse_args(["--from", "env", "--only", "bench"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--only", "nope"])
    steps = gc.gpu_steps()
    assert tuple(s.name for s in steps) == gc.STEP_NAMES
    assert gc.rerun_command("tests").endswith("gpu_check.py --only tests")
    by_name = {s.name: s for s in steps}
    sanitizer = [" ".join(c) for c in by_name["sanitizer"].commands]
    assert [c.split("--tool ")[1].split()[0] for c in sanitizer] == ["memcheck", "racecheck",
                                                                     "synccheck"]
    assert all("-m gpu" in c for c in sanitizer)
    assert by_name["sanitizer"].skip() in (None, "not installed")


def test_env_warns_when_nvcc_is_newer_than_the_driver():
    smi = "| NVIDIA-SMI 550.54  Driver Version: 550.54  CUDA Version: 12.4 |"
    problem, notes = gc.check_env([smi, "0, Some GPU, 550.54, Default, 81559 MiB",
                                   "Cuda compilation tools, release 13.0, V13.0.48"])
    assert problem is None and any("WARNING: nvcc" in n for n in notes)
    problem, notes = gc.check_env([smi, "0, Some GPU, 550.54, Default, 81559 MiB",
                                   "Cuda compilation tools, release 12.6, V12.6.1"])
    assert problem is None and not any("WARNING" in n for n in notes)


def demo_output(*epochs):
    return "\n".join(f"epoch {k}/{len(epochs)}  loss {loss:.4f}  held-out accuracy {acc:.1f}% "
                     f"(360 digits)" for k, (loss, acc) in enumerate(epochs, 1))


def test_the_demo_comparison_and_its_tolerance():
    cpu = demo_output((1.2, 80.0), (0.5, 90.0), (0.3000, 95.0))
    assert gc.DEMO_EPOCHS == 3
    assert gc.check_demo([demo_output((1.2001, 80.3), (0.5002, 90.0), (0.3001, 94.4)), cpu])[0] \
        is None
    problem, notes = gc.check_demo([demo_output((1.2, 80.0), (0.51, 90.0), (0.3, 95.0)), cpu])
    assert "epochs [2]" in problem and len(notes) == 3
    assert "accuracies" in gc.check_demo([demo_output((1.2, 80.0), (0.5, 90.0), (0.3, 93.0)),
                                          cpu])[0]
    nan = cpu.replace("loss 0.3000", "loss nan")
    assert gc.check_demo([nan, cpu])[0] is not None
    assert "expected 3 epoch lines" in gc.check_demo(["crashed", cpu])[0]


def test_loading_the_script_imports_neither_pycuda_nor_minigraph():
    code = (f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('gpu_check', {str(SCRIPT)!r})\n"
            f"module = importlib.util.module_from_spec(spec)\n"
            f"sys.modules['gpu_check'] = module\n"
            f"spec.loader.exec_module(module)\n"
            f"bad = [m for m in sys.modules if m.split('.')[0] in ('pycuda', 'minigraph')]\n"
            f"assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


# ---- the review's first-run order, and the pins ----------------------------------------------

def test_the_steps_follow_the_reviews_first_run_order():
    """Environment and versions, the place, the kernel build, every entry point loaded,
    compute-sanitizer on small tests, the suites, the findings, then the benchmarks."""
    assert gc.STEP_NAMES == ("env", "place", "build", "load", "sanitizer", "tests", "findings",
                             "demo", "bench", "nets")
    by_name = {s.name: s for s in gc.gpu_steps()}
    env = [" ".join(map(str, c)) for c in by_name["env"].commands]
    assert env[0] == "nvidia-smi" and env[2] == "nvcc --version"
    assert env[-1].endswith("gpu_probes.py versions")
    assert by_name["place"].commands[0][-1].endswith("mg.GPUPlace(0))")
    assert by_name["build"].commands == [[*by_name["build"].commands[0][:-1],
                                          "tests/gpu/test_kernel_build.py"]]
    assert by_name["load"].commands[0][-1] == "load"
    assert all("bench" in " ".join(c) for c in by_name["bench"].commands)
    assert by_name["nets"].commands[0][1] == "benchmarks/nets_gpu.py"
    listed = [gc.__doc__.index(f"\n  {name} ") for name in gc.STEP_NAMES]   # the module doc
    assert listed == sorted(listed)


def test_the_gpu_extra_pins_pycuda_and_an_nccl4py_extra():
    """Pre-flight review finding 2: PyCUDA builds against CUDA 13's headers only from
    2025.1.2; nccl4py 0.6 without its cu12 / cu13 extra may leave libnccl out, and
    backend='auto' then quietly falls back to MPI."""
    pins = gc.required_versions()
    assert pins["pycuda"][1] >= (2025, 1, 2)
    assert pins["nccl4py"][0] in ("cu12", "cu13") and pins["nccl4py"][1] >= (0, 6)
    text = (ROOT / "docs" / "gpu.md").read_text()
    for words in ("pycuda>=2025.1.2", "nccl4py[cu12]", "nccl4py[cu13]"):
        assert words in text, words


SMI = "| NVIDIA-SMI 580.65  Driver Version: 580.65  CUDA Version: 13.0 |"
QUERY = "0, NVIDIA H100 80GB HBM3, 580.65, Default, 81559 MiB"


def versions(pycuda="2025.1.2", nccl4py="0.6.0", nccl="2.28.3"):
    return (f"python: 3.12.3\nnumpy: 2.1.0\npycuda: {pycuda}\nnccl4py: {nccl4py}\n"
            f"NCCL (nccl4py): {nccl}\n")


@pytest.mark.parametrize("pycuda,nvcc,fails", [("2024.1.2", "13.0", True),
                                               ("2024.1.2", "12.6", False),
                                               ("2025.1.2", "13.0", False)])
def test_env_checks_pycuda_against_its_pin(pycuda, nvcc, fails):
    problem, notes = gc.check_env([SMI, QUERY, f"Cuda compilation tools, release {nvcc}, V{nvcc}",
                                   "g++ 12", versions(pycuda=pycuda)])
    if fails:
        assert "pycuda 2024.1.2 cannot build against CUDA 13" in problem
        assert "pycuda>=2025.1.2" in problem
    else:
        assert problem is None
        assert any("older than the pin" in n for n in notes) == (pycuda < "2025")


def test_env_warns_about_a_missing_nccl():
    problem, notes = gc.check_env([SMI, QUERY, "Cuda compilation tools, release 13.0, V13.0",
                                   "g++ 12", versions(nccl="unavailable (OSError: libnccl.so.2)")])
    assert problem is None
    assert any("no usable NCCL" in n and "nccl4py[cu13]" in n for n in notes)
    problem, notes = gc.check_env([SMI, QUERY, "Cuda compilation tools, release 13.0, V13.0",
                                   "g++ 12", versions(nccl4py="unavailable (PackageNotFound)")])
    assert any("nccl4py is not installed (pip install 'nccl4py[cu12]>=0.6')" in n for n in notes)


def test_env_says_which_gpu_library_is_missing_and_what_it_costs():
    probe = versions() + (
        "cuBLAS: unavailable (RuntimeError: not installed for a driver of CUDA 13 (pip install "
        "nvidia-cublas); without it matrix products run on the hand-written scalar fp32 GEMM)\n"
        "cuDNN: /x/nvidia/cudnn/lib/libcudnn.so.9 (CUDA 13; cuDNN 9.28.1)\n"
        "CUDA graphs: unavailable (RuntimeError: cuda-bindings is not installed; without it "
        "every step launches its kernels one by one)\n")
    problem, notes = gc.check_env([SMI, QUERY, "Cuda compilation tools, release 13.0, V13.0",
                                   "g++ 12", probe])
    assert problem is None
    blas = [n for n in notes if "no cuBLAS" in n]
    assert blas and "hand-written scalar fp32 GEMM" in blas[0] and "nvidia-cublas" in blas[0]
    assert not any("no cuDNN" in n for n in notes)
    assert any("no CUDA graphs" in n and "one by one" in n for n in notes)


def test_env_fails_when_minigraph_is_not_installed():
    """Run from a checkout that was never installed, the probe's library lines fail on
    the import: the step fails with the command to run, not three missing-library
    warnings."""
    probe = versions() + "".join(
        f"{label}: unavailable (ModuleNotFoundError: No module named 'minigraph')\n"
        for label in ("cuBLAS", "cuDNN", "CUDA graphs"))
    problem, notes = gc.check_env([SMI, QUERY, "Cuda compilation tools, release 13.0, V13.0",
                                   "g++ 12", probe])
    assert "minigraph is not installed" in problem and "pip install -e ." in problem
    assert not any("no cuBLAS" in n for n in notes)
