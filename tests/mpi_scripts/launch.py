"""Run a rank script under `mpiexec -n K` with a hard timeout (imported by the tests)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
RANKS = (2, 3, 4)


def require_mpi():
    """Skip unless mpi4py and the mpiexec next to this interpreter are installed."""
    pytest.importorskip("mpi4py")
    if not os.path.exists(MPIEXEC):
        pytest.skip(f"no mpiexec next to {sys.executable} (pip install mpich)")


def run_ranks(script, ranks, *args, timeout=90, env=None, launcher_args=()):
    """Run tests/mpi_scripts/<script> (or the script at an absolute path) on
    `ranks` processes; return (returncode, combined output, seconds). The
    whole process group is killed at `timeout` and the test fails: a hang is
    a failure, never a wait. launcher_args go to mpiexec before "-n"."""
    require_mpi()
    cmd = [MPIEXEC, *launcher_args, "-n", str(ranks), sys.executable, str(SCRIPTS / script),
           *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (hang?)\n{out}")
    return proc.returncode, out, time.monotonic() - start


def check_ok(script, ranks, *args, timeout=90, env=None):
    """Run and require exit status 0 and an "OK" line from every rank."""
    code, out, _ = run_ranks(script, ranks, *args, timeout=timeout, env=env)
    assert code == 0, f"{script} on {ranks} ranks exited with {code}:\n{out}"
    oks = set(re.findall(r"OK rank (\d+)", out))
    assert len(oks) == ranks, f"expected {ranks} OK lines:\n{out}"
    return out
