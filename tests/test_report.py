"""benchmarks/report.py: the commit a section names is not marked changed by the files
the benchmark scripts write (docs/performance.md, benchmarks/RESULTS.md), and is by any
other change."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

from helpers import committed_repo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("report", module)
    spec.loader.exec_module(module)
    return module


def test_the_commit_is_marked_for_changes_but_not_for_the_files_benchmarks_write(tmp_path):
    report = load_report()
    committed_repo(tmp_path, {"docs/performance.md": "old\n", "code.py": "x = 1\n",
                              "benchmarks/RESULTS.md": "old\n"})
    clean = report.commit(tmp_path)
    assert clean and "uncommitted" not in clean
    (tmp_path / "docs" / "performance.md").write_text("a run wrote this\n")
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("gpu_check wrote this\n")
    assert report.commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert report.commit(tmp_path) == clean + " + uncommitted changes"
