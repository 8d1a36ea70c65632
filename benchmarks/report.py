"""Benchmark results into docs/performance.md: one section per benchmark, replaced whole.

A section is the text between `<!-- begin: NAME -->` and `<!-- end: NAME -->`;
`update_section(NAME, markdown)` replaces it (or appends it where the file has
none), so the file always holds one current table per benchmark. The file is
written atomically: a temporary file in the same folder, then os.replace, so
an interrupted run leaves the old file whole.

    from report import machine_line, markdown_table, update_section
    update_section("nets_cpu", f"{machine_line()}\\n\\n{markdown_table(header, rows)}")
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PATH = REPO / "docs" / "performance.md"
NAME = re.compile(r"[A-Za-z0-9_.-]+")
LOAD_AT_START = os.getloadavg()[0]     # before the script's own work


def markers(name):
    """The (begin, end) marker lines of section `name`."""
    if not NAME.fullmatch(name):
        raise ValueError(f"section name {name!r}: use letters, digits, '_', '.' or '-'")
    return f"<!-- begin: {name} -->", f"<!-- end: {name} -->"


def update_section(name, markdown, path=None):
    """Replace the text between section `name`'s markers in `path` (default
    docs/performance.md) with `markdown`, or append the section, markers and
    all, where the file has none (or does not exist yet). Returns the path."""
    path = Path(path) if path is not None else DEFAULT_PATH
    begin, end = markers(name)
    body = markdown.strip("\n")
    if begin in body or end in body:
        raise ValueError(f"the markdown for section {name!r} contains its own markers")
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    first, last = text.find(begin), text.find(end)
    if first < 0 and last < 0:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + f"{begin}\n{body}\n{end}\n"
    elif first < 0 or last < first or text.count(begin) > 1 or text.count(end) > 1:
        raise ValueError(f"{path}: the markers of section {name!r} are unpaired, out of "
                         "order or repeated; fix the file by hand")
    else:
        text = text[:first + len(begin)] + f"\n{body}\n" + text[last:]
    write_atomically(path, text)
    return path


def write_atomically(path, text):
    """Write `text` to `path` through a temporary file in the same folder and
    os.replace: readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else platform's guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags():
    """The widest x86 vector extension the CPU reports ('AVX-512', 'AVX2'), or ''."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return ("AVX-512" if "avx512f" in flags else
                            "AVX2" if "avx2" in flags else "")
    except OSError:
        pass
    return ""


def blas_info():
    """numpy's BLAS: its name, version and the kernels it runs (cheap, best effort)."""
    try:
        from threadpoolctl import threadpool_info

        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                arch = lib.get("architecture")
                return (f"{lib.get('internal_api', 'BLAS')} {lib.get('version', '')}".strip()
                        + (f" ({arch} kernels)" if arch else ""))
    except Exception:                # threadpoolctl missing or broken: fall back
        pass
    try:
        import numpy as np

        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', 'BLAS')} {blas.get('version', '')}".strip()
    except Exception:
        return "BLAS unknown"


def machine():
    """One line describing this machine: CPU, cores, OS, Python, numpy and its BLAS,
    PyTorch where installed."""
    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cores
    vector = cpu_flags()
    parts = [cpu_model() + (f" with {vector}" if vector else ""),
             f"{cores} cores" + (f" ({usable} usable)" if usable != cores else ""),
             platform.system() or "unknown OS",
             f"Python {platform.python_version()}"]
    try:
        import numpy as np

        parts.append(f"numpy {np.__version__} with {blas_info()}")
    except ImportError:
        pass
    try:                             # the version only: importing torch here would be slow
        parts.append(f"PyTorch {importlib.metadata.version('torch')}")
    except importlib.metadata.PackageNotFoundError:
        pass
    return ", ".join(parts)


def commit(repo=REPO):
    """The repository's short commit hash, '+ uncommitted changes' where tracked files
    other than the two the benchmark scripts write (docs/performance.md, and
    benchmarks/RESULTS.md, which gpu_check.py rewrites before its nets step) differ;
    '' outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no", "--", ".",
                                ":(exclude)docs/performance.md",
                                ":(exclude)benchmarks/RESULTS.md"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def machine_line(extra=""):
    """'Measured DATE on MACHINE (commit C). EXTRA': the first line of a section,
    with the load average when the script began where EXTRA does not give one
    (other work on the machine shows in the absolute times, less in the ratios)."""
    rev = commit()
    line = (f"Measured {datetime.date.today().isoformat()} on {machine()}"
            + (f" (commit {rev})" if rev else "") + ".")
    if "load average" not in extra:
        extra = (extra + " " if extra else "") + f"Load average at the start: {LOAD_AT_START:.2f}."
    return line + " " + extra


def markdown_table(header, rows):
    """A markdown table: `header` a sequence of column titles, `rows` of cells."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def write_section(name, markdown, enabled=True, path=None):
    """update_section for a benchmark's main(): skipped when not `enabled`
    (--no-write), and an unwritable file is a warning, not a lost run."""
    if not enabled:
        return None
    try:
        written = update_section(name, markdown, path)
    except (OSError, ValueError) as e:
        print(f"not written to {path or DEFAULT_PATH}: {e}", file=sys.stderr)
        return None
    print(f"\nwritten to {written} (section {name!r}; --no-write skips this)")
    return written
