"""benchmarks/lockstep.py: blocks of calls timed after untimed ones, the worker's
command loop, and two worker processes taking turns (each with a hard timeout), whose
waiting side's CPU time shows whether the turns overlapped."""
from __future__ import annotations

import io
import json
import sys
import textwrap
import time

import pytest
from benchmark_modules import BENCHMARKS, import_benchmarks


@pytest.fixture(scope="module")
def lockstep():
    return import_benchmarks("lockstep")[0]


def counter():
    calls = [0]

    def fn():
        calls[0] += 1
    return fn, calls


def test_a_block_times_its_calls_after_the_untimed_ones(lockstep):
    fn, calls = counter()
    assert lockstep.block_ms(fn, 3, rewarm=2, min_s=0.0, rewarm_s=0.0) >= 0.0
    assert calls[0] == 5


def test_a_block_of_quick_calls_goes_on_for_its_least_time(lockstep, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(lockstep.time, "perf_counter", lambda: clock[0])
    fn, calls = counter()

    def tick():                                 # 1 ms a call
        fn()
        clock[0] += 0.001
    assert lockstep.block_ms(tick, 3, rewarm=1, min_s=0.05, rewarm_s=0.01) == \
        pytest.approx(1.0)
    assert calls[0] == 10 + 50                  # rewarm: 10 ms; timed: 50 ms


def test_serve_answers_each_command_on_a_line_until_quit(lockstep):
    out = io.StringIO()
    lockstep.serve({"a": lambda: 1, "b": lambda: {"x": 2.5}}, io.StringIO("a\nb\nquit\na\n"), out)
    assert out.getvalue().splitlines() == ["ready", "1", json.dumps({"x": 2.5})]


def test_serve_names_the_commands_it_knows(lockstep):
    with pytest.raises(KeyError, match=r"unknown command 'c'.*\['a', 'b'\]"):
        lockstep.serve({"a": int, "b": int}, io.StringIO("c\n"), io.StringIO())


WORKER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {benchmarks!r})
    from lockstep import serve
    if "spin" in sys.argv:                      # a thread that never waits
        threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
    if "fail" in sys.argv:
        sys.exit("no net for you")
    if "hang" in sys.argv:
        time.sleep(60)
    if "late" in sys.argv:                      # a warm-up of 0.3 s
        time.sleep(0.3)

    def busy():                                 # 0.1 s of work on this thread
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            pass
        return sys.argv[1]
    serve({{"busy": busy}})
""")


def worker(tmp_path, *flags):
    path = tmp_path / "worker.py"
    path.write_text(WORKER.format(benchmarks=str(BENCHMARKS)))
    return [sys.executable, str(path), *flags]


def test_two_workers_take_turns_and_the_waiting_one_spends_nothing(lockstep, tmp_path):
    with lockstep.Pair({"a": worker(tmp_path, "A"), "b": worker(tmp_path, "B")},
                       timeout_s=30) as pair:
        answers = [pair.ask(name, "busy") for name in ("a", "b", "b", "a")]
        waiting = pair.waiting_ms
    assert answers == ["A", "B", "B", "A"]
    if lockstep.cpu_ns(1) is None:
        pytest.skip("no /proc/<pid>/task/<tid>/schedstat here")
    assert waiting < 20             # 4 turns of 100 ms; a blocked read spends none of them


def test_a_waiting_worker_that_spins_is_counted(lockstep, tmp_path):
    if lockstep.cpu_ns(1) is None:
        pytest.skip("no /proc/<pid>/task/<tid>/schedstat here")
    with lockstep.Pair({"a": worker(tmp_path, "A"), "b": worker(tmp_path, "B", "spin")},
                       timeout_s=30) as pair:
        for _ in range(30):             # a's turns of 100 ms until b's thread has run 50 ms
            pair.ask("a", "busy")       # (fewer where other processes load the cores)
            if pair.waiting_ms > 50:
                break
        waiting = pair.waiting_ms
    assert waiting > 50             # its spinning thread ran through much of a's turns


def test_a_worker_that_exits_is_an_error_with_its_stderr(lockstep, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)worker b exited with 1.*no net for you"):
        lockstep.Pair({"a": worker(tmp_path, "A"), "b": worker(tmp_path, "B", "fail")},
                      timeout_s=30)


def test_a_worker_that_answers_nothing_is_stopped(lockstep, tmp_path):
    with pytest.raises(RuntimeError, match=r"worker b answered nothing in 2 s"):
        lockstep.Pair({"a": worker(tmp_path, "A"), "b": worker(tmp_path, "B", "hang")},
                      timeout_s=2)


def recorded_starts(lockstep, monkeypatch):
    """[(perf_counter at the start, the process)] of each worker Pair starts from now."""
    started, real = [], lockstep.subprocess.Popen

    def popen(cmd, **kw):
        at = time.perf_counter()
        started.append((at, real(cmd, **kw)))
        return started[-1][1]
    monkeypatch.setattr(lockstep.subprocess, "Popen", popen)
    return started


def test_the_second_worker_starts_once_the_first_is_ready(lockstep, tmp_path, monkeypatch):
    """Warm-ups never overlap: what one framework times at first use (minigraph's
    kernel choices) is not slowed by the other's start."""
    started = recorded_starts(lockstep, monkeypatch)
    with lockstep.Pair({"a": worker(tmp_path, "A", "late"), "b": worker(tmp_path, "B")},
                       timeout_s=30) as pair:
        assert pair.ask("b", "busy") == "B"
    assert started[1][0] - started[0][0] >= 0.3          # a's warm-up of 0.3 s came first


def test_a_worker_that_cannot_start_stops_the_other(lockstep, tmp_path, monkeypatch):
    started = recorded_starts(lockstep, monkeypatch)
    with pytest.raises(OSError):
        lockstep.Pair({"a": worker(tmp_path, "A"), "b": [str(tmp_path / "no-such-program")]},
                      timeout_s=30)
    assert len(started) == 1 and started[0][1].poll() is not None      # a was killed
