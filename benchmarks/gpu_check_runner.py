"""The machinery of benchmarks/gpu_check.py, apart from what its steps check: a Step,
running its commands with a hard timeout in their own process group, choosing steps
(--from / --only), and the results file (RESULTS.md) rewritten atomically after each
step, naming no local paths. Loaded by gpu_check.py by path (no sys.path entry)."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEFAULT_RESULTS = ROOT / "benchmarks" / "RESULTS.md"
DEFAULT_TIMEOUT = 1800.0
TAIL_LINES = 40             # lines of output kept per command (pytest and tables: more)
MARK = "<!-- gpu_check results: "


@dataclass
class Step:
    """One step: `commands` (argument lists) run in order, all of them, sharing the
    step's timeout; the step fails when one exits non-zero or times out, or when
    `check(outputs)` returns a problem. `skip()` returns a reason to skip it, or None.
    `check` returns (problem or None, [notes for the results])."""

    name: str
    title: str
    commands: list
    skip: Callable[[], str | None] | None = None
    check: Callable[[list], tuple] | None = None
    keep_lines: int = TAIL_LINES
    markdown: Callable[[list], list] | None = None


def run_command(command, timeout):
    """Run `command` in the repository root, in its own process group, stdout and stderr
    merged, echoed as it comes and kept; the whole group is killed after `timeout` s (and
    at the end: leftover ranks). {rc (None: timed out; 127: did not start), seconds,
    output, notes}."""
    done, start, lines = dict(rc=None, seconds=0.0, output="", notes=[]), time.monotonic(), []
    try:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, errors="replace",
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except OSError as e:
        return dict(done, rc=127, output=f"could not start: {e}")

    def read():
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        done["rc"] = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        done["notes"].append(f"timed out after {timeout:.0f} s: process group killed")
    finally:                    # also on Ctrl-C: the group is in a session of its own
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    return dict(done, seconds=time.monotonic() - start, output="".join(lines))


def tail(text, n):
    """The last `n` lines of `text`."""
    lines = text.rstrip("\n").splitlines()
    cut = [f"[{len(lines) - n} earlier lines left out]"] if len(lines) > n else []
    return "\n".join(cut + lines[-n:])


def run_step(step, timeout):
    """Run one step; returns its result as a dict (status ok / failed / skipped ...)."""
    start = time.monotonic()
    result = dict(name=step.name, title=step.title, commands=[], notes=[], output="",
                  date=now(), commit=commit())
    reason = step.skip() if step.skip else None
    if reason:
        result.update(status=f"skipped ({reason})", seconds=0.0)
        return result
    outputs, failed = [], False
    for command in step.commands:
        left, shown = timeout - (time.monotonic() - start), shlex.join(map(str, command))
        print(f"[{step.name}] $ {shown}", flush=True)
        run = run_command(command, left) if left > 0 else dict(
            rc=None, seconds=0.0, output="", notes=["not run: the step's time was up"])
        outputs.append(run["output"])
        failed |= run["rc"] != 0
        result["commands"].append(dict(command=shown, rc=run["rc"],
                                       seconds=round(run["seconds"], 1)))
        result["notes"] += run["notes"]
        result["output"] += f"$ {shown}\n{tail(run['output'], step.keep_lines)}\n"
    if step.check and not failed:
        problem, notes = step.check(outputs)
        result["notes"] += notes + ([f"problem: {problem}"] if problem else [])
        failed = bool(problem)
    if step.markdown and not failed:
        result["markdown"] = step.markdown(outputs)
    result.update(status="failed" if failed else "ok", seconds=round(time.monotonic() - start, 1))
    return result


def select(steps, start=None, only=None):
    """The steps `--from start` / `--only only` pick (all of them without either)."""
    names = [s.name for s in steps]
    for name in (start, only):
        if name is not None and name not in names:
            raise ValueError(f"unknown step {name!r}: choose from {', '.join(names)}")
    if only is not None:
        return [s for s in steps if s.name == only]
    return steps[names.index(start):] if start is not None else list(steps)


def rerun_command(name, results=DEFAULT_RESULTS, timeout=DEFAULT_TIMEOUT):
    """The command line that reruns step `name` alone (with the same options)."""
    script = Path(__file__).with_name("gpu_check.py").resolve()
    if script.is_relative_to(Path.cwd()):
        script = script.relative_to(Path.cwd())
    python = "python" if shutil.which("python") == PY else PY
    words = [python, str(script), "--only", name]
    if Path(results).resolve() != DEFAULT_RESULTS:
        words += ["--results", str(results)]
    if timeout != DEFAULT_TIMEOUT:
        words += ["--timeout", f"{timeout:g}"]
    return shlex.join(words)


def run_steps(steps, results=DEFAULT_RESULTS, timeout=DEFAULT_TIMEOUT, start=None, only=None,
              header=None):
    """Run the steps `start` / `only` select, in order, rewriting `results` after each;
    stop at the first failed step and print how to rerun it. Returns the exit code."""
    chosen = select(steps, start, only)
    kept = {} if start is None and only is None else read_results(results)
    order = [s.name for s in steps]
    for step in chosen:
        kept.pop(step.name, None)
    for step in chosen:
        print(f"[{step.name}] {step.title}", flush=True)
        result = run_step(step, timeout)
        kept[step.name] = result
        write_results(results, header or {}, kept, order)
        for note in result["notes"]:
            print(f"[{step.name}] {note}")
        print(f"[{step.name}] {result['status']} ({result['seconds']:.1f} s)", flush=True)
        if result["status"] == "failed":
            print(f"step {step.name} failed; rerun it alone with:\n    "
                  f"{rerun_command(step.name, results, timeout)}")
            return 1
    print(f"all {len(chosen)} step(s) done; results in {results}")
    return 0


def read_results(path):
    """{step: result} kept in an earlier RESULTS.md (empty when none can be read)."""
    try:
        text = Path(path).read_text()
        return json.loads(text[text.rindex(MARK) + len(MARK):text.rindex(" -->")])
    except (OSError, ValueError):
        return {}


def write_results(path, header, results, order):
    """Write the results (markdown, and the same as JSON in a trailing comment) to
    `path` atomically: a temporary file in the same folder, then os.replace."""
    lines = ["# GPU check", ""] + [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| step | status | seconds | date | commit |", "|---|---|---|---|---|"]
    for name in order:
        r = results.get(name)
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.1f} | {r['date']} | "
                     f"{r['commit']} |" if r else f"| {name} | not run | | | |")
    for name in (n for n in order if n in results):
        r = results[name]
        lines += ["", f"## {name}: {r['title']} - {r['status']} ({r['seconds']:.1f} s)", ""]
        lines += [f"- `{c['command']}`: exit {c['rc']} ({c['seconds']} s)" if c["rc"] is not None
                  else f"- `{c['command']}`: timed out" for c in r["commands"]]
        lines += [f"- {note}" for note in r["notes"]]
        if r.get("markdown"):
            lines += [""] + r["markdown"]
        if r["output"]:
            lines += ["", "````text", r["output"].rstrip("\n"), "````"]
    lines += ["", MARK + json.dumps(results) + " -->", ""]
    text = scrub("\n".join(lines))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)                    # mkstemp's file is private; a results file is not
    os.replace(tmp, path)


def scrub(text, root=ROOT, prefix=None):
    """`text` naming no local paths: the repository root reads ".", and a virtual
    environment's prefix (sys.prefix, when it is one) "<venv>"."""
    if prefix is None and sys.prefix != sys.base_prefix:
        prefix = sys.prefix
    text = text.replace(str(root), ".")
    return text.replace(prefix, "<venv>") if prefix else text


def now():
    """The local date and time, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def commit(root=ROOT):
    """The checked-out commit (short), marked when tracked files other than the results
    file (which every step rewrites) have local changes."""
    def git(*words):
        try:
            return subprocess.run(["git", *words], cwd=root, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "-uno", "--", ".",
                  ":(exclude)" + DEFAULT_RESULTS.relative_to(ROOT).as_posix())
    return head + (" (with local changes)" if changed else "")
