"""benchmarks/timing.py: medians over calls, and over whole cycles of calls (a training
step with GradientMerge), on a fake clock that the timed function advances."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_timing(monkeypatch, clock):
    spec = importlib.util.spec_from_file_location("timing", ROOT / "benchmarks" / "timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    return module


def stepper(clock, costs):
    """A function whose n-th call advances the clock by costs[n % len(costs)] seconds;
    calls[0] counts the calls."""
    calls = [0]

    def step():
        clock[0] += costs[calls[0] % len(costs)]
        calls[0] += 1
    return step, calls


def test_a_cycle_is_timed_whole_and_reported_per_call(monkeypatch):
    clock = [0.0]
    timing = load_timing(monkeypatch, clock)
    step, calls = stepper(clock, (0.010, 0.030))      # a cheap step, then an updating one
    assert timing.median_ms(step, repeat=5, warmup=3, cycle=2) == pytest.approx(20.0)
    assert calls[0] == 4 + 5 * 2                       # warm-up rounded up to whole cycles


def test_single_calls_are_the_default(monkeypatch):
    clock = [0.0]
    timing = load_timing(monkeypatch, clock)
    step, calls = stepper(clock, (0.010, 0.010, 0.050))
    assert timing.median_ms(step, repeat=6, warmup=3) == pytest.approx(10.0)
    assert calls[0] == 3 + 6


def test_alone_between_and_after_idle_alternate_in_blocks(monkeypatch):
    clock = [0.0]
    timing = load_timing(monkeypatch, clock)
    last = ["alone"]

    def before():
        clock[0] += 1.0
        last[0] = "between"

    def idle():
        clock[0] += 1.0
        last[0] = "idle"

    order = []

    def fn():               # slower right after a step, slower still after the idle loop
        order.append(last[0])
        clock[0] += {"alone": 0.010, "between": 0.012, "idle": 0.015}[last[0]]
        last[0] = "alone"

    got = timing.alone_and_between_ms(before, fn, repeat=6, warmup=1, block=3, idle=idle)
    assert got == pytest.approx((10.0, 12.0, 15.0))
    assert order[3:] == (["alone"] * 3 + ["between"] * 3 + ["idle"] * 3) * 2
    assert timing.alone_and_between_ms(before, fn, repeat=4, warmup=0)[2] is None


def test_lockstep_commands_time_blocks_in_their_modes(monkeypatch):
    clock = [0.0]
    timing = load_timing(monkeypatch, clock)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))     # timing imports lockstep
    modes, idles = [], []

    def step():
        clock[0] += 0.004

    def infer():            # in the wrong mode a thousand times slower
        clock[0] += 0.001 if modes[-1] == "eval" else 1.0

    monkeypatch.setattr(timing, "idle_as_long_as",
                        lambda ms: idles.append(ms) or (lambda: None))
    commands = timing.lockstep_commands(
        step, infer, repeat=4, warmup=0, block=3,
        modes=(lambda: modes.append("train"), lambda: modes.append("eval")),
        extras=lambda: {"ops": 3})
    assert commands["train"]() == pytest.approx(4.0)
    assert commands["train"]() == pytest.approx(4.0)
    assert commands["infer"]() == pytest.approx(1.0)
    got = commands["steady"]()
    assert modes == ["train", "train", "eval", "eval"]
    assert idles == [pytest.approx(4.0)]          # the idle loop: the training blocks' median
    assert got == {"infer alone": pytest.approx(1.0), "infer between": pytest.approx(1.0),
                   "infer after idle": pytest.approx(1.0), "ops": 3}
