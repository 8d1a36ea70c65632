"""The benchmark scripts as modules, for their tests: benchmarks/ is no package, and
its scripts import their siblings by name."""
from __future__ import annotations

import importlib
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmarks(*names):
    """The modules benchmarks/<name>.py, imported with benchmarks/ on sys.path for as
    long as the imports take (their own imports of siblings included)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(BENCHMARKS))
