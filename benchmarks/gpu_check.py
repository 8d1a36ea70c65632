"""Everything a GPU can verify about minigraph, in one command, in the order of the
GPU pre-flight review's first run (the most basic and cheapest first):

    python benchmarks/gpu_check.py [--from STEP | --only STEP] [--timeout S] [--results PATH]

Steps, in order:
  env        the environment and versions: nvidia-smi (compute mode Default), nvcc
             (its CUDA major no newer than the driver's), g++, and what Python has:
             pycuda and nccl4py against the pins of pyproject.toml's gpu extra
             (pycuda older than 2025.1.2 with a CUDA 13 toolkit fails the step), the
             driver, the compute capability, NCCL;
  place      GPUPlace(0) in a fresh process, with no PyCUDA error at exit;
  build      tests/gpu/test_kernel_build.py (every .cu compiles; PTX parameters match);
  load       every kernel entry point loaded on the device, with its registers;
  sanitizer  compute-sanitizer on small launcher tests (skipped when not installed);
  tests      the suites: every test marked gpu, then those also marked mpi;
  findings   the review's findings 1 (a place used from a worker thread) and 6 (no
             out-of-thread event clean-up under the NCCL sync-BN script);
  demo       `minigraph demo` on the GPU against the CPU;
  bench      benchmarks/bn_gpu.py, benchmarks/sync_bn_gpu.py;
  nets       benchmarks/nets_gpu.py: whole nets (nets_cpu's and the GPT of
             examples/train_gpt.py), train and infer, against PyTorch eager on the same
             GPU (TF32 off, then on), peak device memory, the costliest ops of a ResNet
             step; its tables go into RESULTS.md as markdown (and into
             docs/performance.md).
gpu_steps() lists the exact commands.

Each command runs in the repository root in its own process group with a hard
timeout (--timeout seconds per step): a hang fails its step. After each step
--results (default benchmarks/RESULTS.md) is rewritten atomically, naming no local
paths (see scrub): machine, GPU, date, commit, then per step its status (ok /
failed / skipped), wall time, commands and the tail of their output (bench: all
of it). With --from or --only, earlier
results of the other steps are kept. The run stops at the first failed step and
prints the command that reruns it alone, e.g.
`python benchmarks/gpu_check.py --only sanitizer`.

Without a GPU (no nvidia-smi, no GPU listed, or pycuda.driver not importable) it
prints one line saying so, writes nothing and exits 1 (no GPU: nothing was checked).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the step machinery and the env step's verdict live beside this script (loaded by path:
# no sys.path entry)
def _sibling(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)        # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


probes, runner = _sibling("gpu_probes"), _sibling("gpu_check_runner")
check_env, required_versions = probes.check_env, probes.required_versions
Step, run_steps, rerun_command, select, scrub, now, commit = (
    runner.Step, runner.run_steps, runner.rerun_command, runner.select, runner.scrub,
    runner.now, runner.commit)
PY, DEFAULT_RESULTS, DEFAULT_TIMEOUT = runner.PY, runner.DEFAULT_RESULTS, runner.DEFAULT_TIMEOUT
PYTEST_LINES, FULL_LINES = 80, 400
DEMO_EPOCHS = 3
# the demo prints losses to 4 decimals, accuracy to 0.1 %. GPU and CPU (float32, other
# summation orders) must agree on each epoch's mean training loss within LOSS_RTOL relative
# + LOSS_ATOL (the printed rounding), on the final accuracy within ACC_POINTS points (~4 of
# the ~360 held-out digits)
LOSS_RTOL, LOSS_ATOL, ACC_POINTS = 1e-3, 1e-4, 1.0


def find_tool(name):
    """`name` on PATH, else in the CUDA toolkit's bin (beside nvcc, CUDA_HOME, CUDA_PATH,
    /usr/local/cuda); None when absent."""
    nvcc = shutil.which("nvcc")
    dirs = [os.path.dirname(os.path.realpath(nvcc))] if nvcc else []
    dirs += [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH")
             if os.environ.get(v)] + ["/usr/local/cuda/bin"]
    for path in [shutil.which(name)] + [os.path.join(d, name) for d in dirs]:
        if path and os.access(path, os.X_OK):
            return path
    return None


def gpu_listing():
    """(`nvidia-smi -L` lines, None) where the check can run, else ([], why not)."""
    if shutil.which("nvidia-smi") is None:
        return [], "nvidia-smi is not installed"
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        gpus = re.findall(r"^GPU \d+:.*$", listed.stdout, re.M)
        if listed.returncode or not gpus:
            return [], f"nvidia-smi lists no GPU (exit {listed.returncode})"
        probe = subprocess.run([PY, "-c", "import pycuda.driver"], capture_output=True,
                               text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"{type(e).__name__}: {e}"
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return [], f"pycuda.driver is not importable with {PY}: {last}"
    return gpus, None


def pytest_check(forbidden=None):
    """check(outputs) for pytest steps: notes skips; a problem when a skip reason
    matches `forbidden` (a regex: the test could not do what the step is for)."""
    def check(outputs):
        notes = [f"{m[0]} (reasons in the output)" for o in outputs
                 for m in [re.search(r"\d+ skipped", o)] if m]
        bad = [o for o in outputs if forbidden and re.search(forbidden, o)]
        return (f"a test skipped for {forbidden!r}" if bad else None), notes
    return check


def check_demo(outputs):
    """Compare the epochs `minigraph demo` printed on the GPU (outputs[0]) and the CPU."""
    gpu, cpu = ([(float(loss), float(acc)) for loss, acc in re.findall(
        r"epoch \d+/\d+\s+loss (\S+)\s+held-out accuracy (\S+)%", o)] for o in outputs)
    if len(gpu) != DEMO_EPOCHS or len(cpu) != DEMO_EPOCHS:
        return f"expected {DEMO_EPOCHS} epoch lines, got {len(gpu)} (gpu), {len(cpu)} (cpu)", []
    notes = [f"epoch {k}: loss gpu {g[0]:.4f} cpu {c[0]:.4f}, accuracy gpu {g[1]:.1f}% "
             f"cpu {c[1]:.1f}%" for k, (g, c) in enumerate(zip(gpu, cpu), 1)]
    bad = [k for k, (g, c) in enumerate(zip(gpu, cpu), 1)
           if not abs(g[0] - c[0]) <= LOSS_RTOL * abs(c[0]) + LOSS_ATOL]
    if bad:
        return f"losses differ beyond {LOSS_RTOL:g} relative + {LOSS_ATOL:g} in epochs {bad}", notes
    if not abs(gpu[-1][1] - cpu[-1][1]) <= ACC_POINTS:
        return f"final accuracies differ by more than {ACC_POINTS:g} points", notes
    return None, notes


def check_findings(outputs):
    """Finding 6 shows as PyCUDA's out-of-thread clean-up warning under the NCCL script
    (outputs[1], when it ran)."""
    if any("out-of-thread" in o for o in outputs[1:]):
        return "finding 6 reproduced: CUDA events cleaned up out of their thread", []
    return None, [] if outputs[1:] else ["finding 6 not checked: no nccl4py or mpiexec"]


NETS_BUDGET_S = 200          # nets_gpu.py starts no round after this (gpu_check: 8 min in all)


def nets_tables(outputs):
    """The markdown nets_gpu.py printed (its tables and the profile), from the line that
    opens the first table's title to the last table row."""
    lines = outputs[0].splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("TF32 off on both")),
                 None)
    if first is None:
        return []
    last = max(i for i, line in enumerate(lines) if line.startswith("|"))
    return lines[first:last + 1]


def gpu_steps():
    """The steps of the check, in order (see the module doc)."""
    pytest, probe = [PY, "-m", "pytest", "-q", "-rfEs"], [PY, "benchmarks/gpu_probes.py"]
    sanitizer = find_tool("compute-sanitizer")

    def sanitized(tool, *suites):
        return [sanitizer or "compute-sanitizer", "--tool", tool, "--error-exitcode", "1",
                *pytest, "-m", "gpu", *(f"tests/gpu/test_{s}_launchers.py" for s in suites)]
    out = Path(tempfile.gettempdir()) / "minigraph-gpu-check"
    demo = [PY, "-m", "minigraph.cli", "demo", "--no-progress", "--seed", "0",
            "--epochs", str(DEMO_EPOCHS)]
    mpiexec = os.path.join(os.path.dirname(PY), "mpiexec")
    nccl = [mpiexec, "-n", "1", PY, "-W", "always", "tests/mpi_scripts/gpu_sync_bn_check.py",
            "--place", "gpu", "--backend", "nccl"]
    has_nccl = os.path.exists(mpiexec) and subprocess.run(
        [PY, "-c", "import nccl.core"], capture_output=True, timeout=120).returncode == 0
    return [
        Step("env", "environment and versions", [
            ["nvidia-smi"],
            ["nvidia-smi", "--query-gpu=index,name,driver_version,compute_mode,memory.total",
             "--format=csv"],
            ["nvcc", "--version"], ["g++", "--version"], [*probe, "versions"]],
            check=check_env),
        Step("place", "GPUPlace(0) in a fresh process",
             [[PY, "-c", "import minigraph as mg; print(mg.GPUPlace(0))"]],
             check=lambda o: ("PyCUDA error at exit" if "PyCUDA ERROR" in o[0] else None, [])),
        Step("build", "every .cu compiles; PTX parameters match the launchers",
             [[*pytest, "tests/gpu/test_kernel_build.py"]], check=pytest_check("no nvcc"),
             keep_lines=PYTEST_LINES),
        Step("load", "every entry point compiled, loaded and fetched on the device",
             [[*probe, "load"]], keep_lines=FULL_LINES),
        Step("sanitizer", "compute-sanitizer on launcher tests (only those marked gpu)",
             [sanitized("memcheck", "fill", "map"), sanitized("racecheck", "softmax"),
              sanitized("synccheck", "bn")],
             skip=lambda: None if sanitizer else "not installed", check=pytest_check(),
             keep_lines=PYTEST_LINES),
        Step("tests", "every test marked gpu; then those also marked mpi (sync BN, NCCL)", [
            [*pytest, "-m", "gpu and not mpi", "tests"], [*pytest, "-m", "gpu and mpi", "tests"]],
            check=pytest_check(), keep_lines=PYTEST_LINES),
        Step("findings", "review findings 1 (place on a worker thread) and 6 (NCCL events)",
             [[*probe, "thread"]] + ([nccl] if has_nccl else []), check=check_findings),
        Step("demo", f"minigraph demo, {DEMO_EPOCHS} epochs, GPU against CPU (seed 0)", [
            [*demo, "--device", "gpu", "--out", str(out / "demo-gpu")],
            [*demo, "--device", "cpu", "--out", str(out / "demo-cpu")]], check=check_demo),
        Step("bench", "batch norm and sync batch norm on the GPU against PyTorch/cuDNN",
             [[PY, "benchmarks/bn_gpu.py"], [PY, "benchmarks/sync_bn_gpu.py"]],
             keep_lines=FULL_LINES),
        Step("nets", "whole nets, train and infer, against PyTorch eager on the same GPU",
             [[PY, "benchmarks/nets_gpu.py", "--budget-s", str(NETS_BUDGET_S)]],
             keep_lines=FULL_LINES, markdown=nets_tables),
    ]


STEP_NAMES = ("env", "place", "build", "load", "sanitizer", "tests", "findings", "demo", "bench",
              "nets")


def parse_args(argv=None):
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--from", dest="start", choices=STEP_NAMES, help="start at this step")
    which.add_argument("--only", choices=STEP_NAMES, help="run this step alone")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds per step (default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                   help="the results file (default benchmarks/RESULTS.md)")
    return p.parse_args(argv)


def main(argv=None):
    """Check for a GPU (one line and exit 1 without), then run the steps."""
    args = parse_args(argv)
    gpus, reason = gpu_listing()
    if reason:
        print(f"gpu_check: no GPU to check on this machine: {reason}", file=sys.stderr)
        return 1
    header = {"machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
              "GPU": "; ".join(re.sub(r"\s*\(UUID.*\)", "", g) for g in gpus),
              "date": now(), "commit": commit(),
              "command": shlex.join(["python", "benchmarks/gpu_check.py",
                                     *(sys.argv[1:] if argv is None else argv)])}
    return run_steps(gpu_steps(), args.results, args.timeout, args.start, args.only, header)


if __name__ == "__main__":
    sys.exit(main())
