"""benchmarks/idle_loop.py: the idle loop lasts the time it is given, and where no C
compiler builds it the benchmarks get None (and leave its column out)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def idle_loop():
    spec = importlib.util.spec_from_file_location("idle_loop",
                                                  ROOT / "benchmarks" / "idle_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_loop_lasts_the_time_given(idle_loop):
    idle = idle_loop.idle_loop()
    if idle is None:
        pytest.skip("no C compiler")
    for seconds in (0.002, 0.01):
        t = time.perf_counter()
        assert idle(seconds) > 0                    # the count it kept in a register
        took = time.perf_counter() - t
        assert seconds <= took < seconds + 0.5
    assert idle(-1.0) == 0                          # no time: not one count


def test_no_compiler_gives_none(idle_loop, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert idle_loop.idle_loop() is None
    monkeypatch.setenv("CC", f"{sys.executable} -c 'raise SystemExit(1)'")
    assert idle_loop.build_c(idle_loop.SPIN_C, str(tmp_path)) is None   # the build fails
