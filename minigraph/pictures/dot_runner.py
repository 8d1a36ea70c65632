"""Running a Graphviz program to turn DOT source into an .svg, .png or .pdf.

The program is Graphviz's `dot` when it is on PATH, else `graphviz-pure`
(a self-contained port of Graphviz installed from PyPI with minigraph; it
writes svg and png, not pdf). Every run has a time limit (`timeout`
seconds; default DOT_TIMEOUT, or the environment variable
MINIGRAPH_DOT_TIMEOUT): a program that hangs is killed with everything it
started, and one that fails, is killed, or writes nothing (or not the format
asked for) is a RuntimeError; no caller ever gets empty bytes.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

DOT_TIMEOUT = 60.0
TIMEOUT_ENV = "MINIGRAPH_DOT_TIMEOUT"
FALLBACK = "graphviz-pure"
MAGIC = {"svg": b"<svg", "png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}
FALLBACK_FORMATS = ("svg", "png")


def find_program(fmt):
    """(path, name) of the program that renders `fmt` ("svg", "png" or "pdf"):
    `dot` from PATH, else graphviz-pure (from PATH, this Python's scripts
    folder or the folder of sys.executable) for svg and png. A RuntimeError
    says what to install when neither is there."""
    dot = shutil.which("dot")
    if dot is not None:
        return dot, "dot"
    fallback = _find_fallback()
    if fallback is not None and fmt in FALLBACK_FORMATS:
        return fallback, FALLBACK
    if fallback is not None:
        raise RuntimeError(f"render: writing .{fmt} needs Graphviz's 'dot' program, which is "
                           f"not on PATH; {FALLBACK} (used when dot is missing) writes only "
                           f"{' and '.join('.' + f for f in FALLBACK_FORMATS)}. Install the "
                           "Graphviz system package (e.g. `apt install graphviz`, `brew install "
                           "graphviz` or `conda install graphviz`) or write .svg/.png.")
    raise RuntimeError(missing_program_message())


def missing_program_message():
    """What to tell someone whose machine has neither `dot` nor graphviz-pure."""
    return (f"render: neither Graphviz's 'dot' program nor {FALLBACK} was found. "
            f"`pip install {FALLBACK}` (a minigraph dependency) writes .svg and .png; for .pdf "
            "install the Graphviz system package (e.g. `apt install graphviz`, `brew install "
            "graphviz` or `conda install graphviz`). net.to_dot() still works without either.")


def pipe(source, fmt, timeout=None):
    """The bytes of `source` (DOT text) rendered as `fmt` by find_program(fmt).

    timeout: seconds (None: MINIGRAPH_DOT_TIMEOUT, else DOT_TIMEOUT). A
    RuntimeError names the program and what went wrong when it is missing,
    cannot start, runs past the limit, exits non-zero or on a signal, or
    writes nothing or something that is not a `fmt` file."""
    exe, name = find_program(fmt)
    limit = _timeout(timeout)
    try:
        proc = subprocess.Popen([exe, f"-T{fmt}"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=hasattr(os, "killpg"))
    except OSError as e:
        raise RuntimeError(f"render: could not run {name} ({exe}): {e}") from e
    try:
        out, err = proc.communicate(source.encode("utf-8"), timeout=limit)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise RuntimeError(f"render: {name} ({exe}) did not finish within {limit:g} s and was "
                           f"stopped; no file was written (raise the limit with "
                           f"render(..., timeout=S) or {TIMEOUT_ENV})") from None
    except BaseException:
        _kill(proc)
        raise
    detail = err.decode("utf-8", "replace").strip()
    detail = f": {detail.splitlines()[-1][:300]}" if detail else ""
    if proc.returncode != 0:
        how = (f"was killed by signal {-proc.returncode}" if proc.returncode < 0
               else f"failed with exit code {proc.returncode}")
        raise RuntimeError(f"render: {name} ({exe}) {how}{detail}; no file was written")
    if not out:
        raise RuntimeError(f"render: {name} ({exe}) wrote nothing{detail}; no file was written")
    if MAGIC[fmt] not in out[:4096]:
        raise RuntimeError(f"render: {name} ({exe}) did not write a .{fmt} file{detail}; no "
                           "file was written")
    return out


def _find_fallback():
    found = shutil.which(FALLBACK)
    if found is not None:
        return found
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which(FALLBACK, path=folder) if folder else None
        if found is not None:
            return found
    return None


def _timeout(timeout):
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DOT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"render: {TIMEOUT_ENV} must be a number of seconds > 0, got "
                             f"{raw!r}") from None
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"render: timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _kill(proc):
    """Stop `proc` and whatever it started (its own session), then reap it."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()
