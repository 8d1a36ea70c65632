"""Kernels chosen by timing on the machine (kernels/cpu/choices.py): a choice made once
and kept in a per-machine file beside the native kernels, keyed by the CPU; damaged,
foreign or untrusted files ignored and rewritten, never unpickled; every option of
fused_fc and the convolutions giving the float64 reference's result
(test_choices_results.py); and nothing timed where tuning or the native kernels are
off. No test asserts which option is faster: only that a choice is made, kept and
honoured."""
import fcntl
import json
import os
import pickle
import time

import pytest

from minigraph.kernels.cpu import choices, native, native_cache

KIND = "conv2d_dw"


class Counted:
    """An option that counts its calls and returns its name."""

    def __init__(self, name):
        self.name, self.calls = name, 0

    def __call__(self):
        self.calls += 1
        return self.name


def options():
    return {"direct": Counted("direct"), "im2col": Counted("im2col")}


def test_a_choice_is_timed_in_two_processes_then_kept_in_the_machines_file(fresh_choices):
    first = options()
    got = choices.choose(KIND, "shape-a", first, "direct")
    assert got in ("direct", "im2col")
    assert all(o.calls >= 1 + choices.ROUNDS for o in first.values())   # timed
    again = options()                            # the same process: not timed again
    assert choices.choose(KIND, "shape-a", again, "direct") == got
    assert sum(o.calls for o in again.values()) == 1
    path = choices.path()
    assert path is not None and path.parent == fresh_choices and path.name.startswith("choices-")
    doc = json.loads(path.read_text())
    assert doc["format"] == choices.FORMAT and doc["cpu"] == native.cpu_identity()
    entry = doc["choices"][f"{KIND}|shape-a"]
    assert entry["pick"] == got and set(entry["ms"]) == {"direct", "im2col"}
    assert entry["runs"] == 1
    choices.forget()                             # a second process: timed again
    second = options()
    choices.choose(KIND, "shape-a", second, "direct")
    assert all(o.calls >= 1 + choices.ROUNDS for o in second.values())
    entry = json.loads(path.read_text())["choices"][f"{KIND}|shape-a"]
    assert entry["runs"] == choices.PROCESSES == 2
    choices.forget()                             # a third: read from the file
    third = options()
    got = choices.choose(KIND, "shape-a", third, "direct")
    assert got == entry["pick"] and sum(o.calls for o in third.values()) == 1


def run_process(clock, seconds, key="loaded"):
    """A fresh process's choice between direct and im2col (the default: direct) taking
    `seconds` (a pair) on the fake clock; (its pick, the options)."""
    choices.forget()
    opts = {name: Clocked(name, t, clock) for name, t in zip(("direct", "im2col"), seconds)}
    return choices.choose(KIND, key, opts, "direct"), opts


def test_a_choice_timed_under_load_is_put_right_by_the_next_process(fresh_choices, monkeypatch):
    """Each option's least time over the processes decides: im2col timed at 4x its time
    alone (another program loading the CPU) loses in the first process and wins in the
    second; a third runs it untimed, and a slower second process changes nothing."""
    clock = type("Clock", (), {"now": 0.0, "perf_counter": lambda self: self.now})()
    monkeypatch.setattr(choices, "time", clock)
    assert run_process(clock, (1.0, 2.0))[0] == "direct"        # im2col under load
    assert run_process(clock, (1.0, 0.5))[0] == "im2col"        # alone
    entry = json.loads(choices.path().read_text())["choices"][f"{KIND}|loaded"]
    assert entry == {"pick": "im2col", "ms": {"direct": 1000.0, "im2col": 500.0}, "runs": 2}
    pick, opts = run_process(clock, (1.0, 0.5))
    assert pick == "im2col" and (opts["direct"].calls, opts["im2col"].calls) == (0, 1)
    assert run_process(clock, (1.0, 0.5), "steady")[0] == "im2col"
    assert run_process(clock, (0.9, 3.0), "steady")[0] == "im2col"   # loaded: least times
    entry = json.loads(choices.path().read_text())["choices"][f"{KIND}|steady"]
    assert entry["ms"] == {"direct": 900.0, "im2col": 500.0}


def test_an_entry_timed_by_one_process_is_timed_once_more(fresh_choices, monkeypatch):
    """A file's entry without a count of processes (an older minigraph's) counts as
    one process's: timed again at the first pick, its times the least of both, then
    kept."""
    choices.choose(KIND, "warm", options(), "direct")
    choices.path().write_bytes(valid(pick="direct", runs=None,
                                     ms={"direct": 100.0, "im2col": 5000.0}))
    clock = type("Clock", (), {"now": 0.0, "perf_counter": lambda self: self.now})()
    monkeypatch.setattr(choices, "time", clock)
    pick, opts = run_process(clock, (1.0, 0.2), "shape-e")
    assert pick == "direct" and all(o.calls >= 1 + choices.ROUNDS for o in opts.values())
    entry = json.loads(choices.path().read_text())["choices"][f"{KIND}|shape-e"]
    assert entry == {"pick": "direct", "ms": {"direct": 100.0, "im2col": 200.0}, "runs": 2}
    pick, opts = run_process(clock, (1.0, 0.2), "shape-e")
    assert pick == "direct" and (opts["direct"].calls, opts["im2col"].calls) == (1, 0)


def test_a_write_keeps_the_entries_another_process_wrote_meanwhile(fresh_choices):
    """Two processes that time at once (the ranks of one host) each write the whole
    file: the second writer takes in the first's entries of keys it does not hold."""
    choices.choose(KIND, "mine", options(), "direct")
    path = choices.path()
    doc = json.loads(path.read_text())                      # another process's write
    doc["choices"][f"{KIND}|theirs"] = {"pick": "im2col", "ms": {"im2col": 1.0}, "runs": 2}
    doc["choices"][f"{KIND}|mine"] = {"pick": "im2col", "runs": 2}
    path.write_text(json.dumps(doc))
    choices.choose(KIND, "later", options(), "direct")      # this process writes again
    written = json.loads(path.read_text())["choices"]
    assert {f"{KIND}|mine", f"{KIND}|theirs", f"{KIND}|later"} <= set(written)
    assert written[f"{KIND}|theirs"]["pick"] == "im2col"    # taken in, and used here:
    assert written[f"{KIND}|mine"]["runs"] == 1             # this process's own kept
    opts = options()
    assert choices.choose(KIND, "theirs", opts, "direct") == "im2col"
    assert (opts["im2col"].calls, opts["direct"].calls) == (1, 0)


def test_a_write_holds_the_files_lock_from_its_read_to_its_rename(fresh_choices, monkeypatch):
    """No other process can take the lock (flock of choices-<digest>.lock) while this one
    reads the file and writes it back, so neither loses the other's entries."""
    choices.choose(KIND, "first", options(), "direct")
    lock = choices.path().with_suffix(".lock")
    assert lock.exists() and lock.stat().st_mode & 0o777 == 0o600
    held, real = [], native_cache.write_text

    def write(target, text):
        fd = os.open(lock, os.O_RDWR)           # another open file: what another process has
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        real(target, text)

    monkeypatch.setattr(native_cache, "write_text", write)
    choices.choose(KIND, "second", options(), "direct")
    assert held == [True]
    fd = os.open(lock, os.O_RDWR)                # and let go after
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


@pytest.mark.parametrize("runs", [0, -3, "2", 2.0, True, None, [2]])
def test_a_count_of_processes_that_is_not_a_positive_int_counts_as_one(fresh_choices, runs):
    """A planted or damaged "runs" never makes a choice final: it is timed again."""
    choices.choose(KIND, "warm", options(), "direct")
    doc = json.loads(valid(pick="im2col"))
    doc["choices"][f"{KIND}|shape-e"]["runs"] = runs
    opts = write_then_choose(choices.path(), json.dumps(doc).encode())
    assert all(o.calls >= 1 + choices.ROUNDS for o in opts.values())


def test_a_lock_held_elsewhere_delays_a_write_at_most_lock_wait_s(fresh_choices, monkeypatch):
    choices.choose(KIND, "first", options(), "direct")
    monkeypatch.setattr(choices, "LOCK_WAIT_S", 0.2)
    fd = os.open(choices.path().with_suffix(".lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)                      # a process stopped holding it
    try:
        start = time.monotonic()
        choices.choose(KIND, "second", options(), "direct")
        waited = time.monotonic() - start
    finally:
        os.close(fd)
    assert 0.2 <= waited < 5
    assert f"{KIND}|second" in json.loads(choices.path().read_text())["choices"]


def test_a_symlinked_lock_is_not_followed(fresh_choices, tmp_path):
    choices.choose(KIND, "first", options(), "direct")
    lock = choices.path().with_suffix(".lock")
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    lock.unlink()
    lock.symlink_to(target)
    choices.choose(KIND, "second", options(), "direct")     # written without the lock
    assert f"{KIND}|second" in json.loads(choices.path().read_text())["choices"]
    assert target.read_text() == "keep" and lock.is_symlink()


class Clocked(Counted):
    """An option that takes `seconds` on a fake clock."""

    def __init__(self, name, seconds, clock):
        super().__init__(name)
        self.seconds, self.clock = seconds, clock

    def __call__(self):
        self.clock.now += self.seconds
        return super().__call__()


@pytest.mark.parametrize("slower, more, pick", [(1.05, True, "direct"), (1.2, True, "im2col"),
                                               (1.3, False, "im2col"), (3.0, False, "im2col")])
def test_a_close_call_is_timed_for_more_rounds(fresh_choices, monkeypatch, slower, more, pick):
    """Where both options take at most 1 / MARGIN^2 times the faster's time, both get
    CLOSE_ROUNDS more rounds, else none; the faster replaces the default (direct) only
    where it takes at most MARGIN of its time."""
    clock = type("Clock", (), {"now": 0.0, "perf_counter": lambda self: self.now})()
    monkeypatch.setattr(choices, "time", clock)
    opts = {"direct": Clocked("direct", slower, clock), "im2col": Clocked("im2col", 1.0, clock)}
    assert choices.choose(KIND, f"close-{slower}", opts, "direct") == pick
    rounds = choices.ROUNDS + (choices.CLOSE_ROUNDS if more else 0)
    for name, option in opts.items():          # a warm-up call, the rounds, the run
        assert option.calls == 1 + rounds + (name == pick)


def test_the_default_runs_untimed_where_tuning_is_off(fresh_choices, monkeypatch):
    for env in ({choices.ENV: "0"}, {"MINIGRAPH_NATIVE": "0"}):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            opts = options()
            assert choices.choose(KIND, "shape-b", opts, "im2col") == "im2col"
            assert (opts["im2col"].calls, opts["direct"].calls) == (1, 0)
    assert not list(fresh_choices.glob("choices-*"))


def test_forcing_runs_the_named_option(fresh_choices):
    opts = options()
    with choices.forcing({KIND: "im2col"}):
        assert choices.choose(KIND, "shape-c", opts, "direct") == "im2col"
    assert opts["direct"].calls == 0 and not list(fresh_choices.glob("choices-*"))


def test_forcing_names_the_option_of_a_conv_too_small_to_be_timed():
    """conv2d.pick runs its default untimed below MIN_CHOICE_WORK, and what forcing
    names there too (so that two runs can be made to take the same kernels)."""
    from types import SimpleNamespace

    from minigraph.kernels.cpu import conv2d as kernels

    g = SimpleNamespace(n=1, o=1, c=1, groups=1, kh=1, kw=1, ho=1, wo=1)
    opts = {"winograd": None, "direct": None}
    assert kernels.pick("conv2d", None, g, 1, opts) == "winograd"
    with choices.forcing({"conv2d": "direct"}):
        assert kernels.pick("conv2d", None, g, 1, opts) == "direct"
    with choices.forcing({"conv2d": "im2col"}):                 # not an option here
        assert kernels.pick("conv2d", None, g, 1, opts) == "winograd"


def test_another_cpu_has_a_file_of_its_own(fresh_choices, monkeypatch):
    choices.choose(KIND, "shape-d", options(), "direct")
    mine = choices.path()
    monkeypatch.setattr(native, "cpu_identity", lambda: "another CPU\nflags: avx2")
    choices.forget()
    opts = options()
    choices.choose(KIND, "shape-d", opts, "direct")
    assert all(o.calls > 1 for o in opts.values())          # timed again there
    assert choices.path() != mine and mine.exists()
    assert json.loads(choices.path().read_text())["cpu"] == "another CPU\nflags: avx2"


def write_then_choose(path, data):
    """Put `data` (bytes) at `path` as the machine's file, then choose once in a fresh
    process state; the options (to see whether they were timed)."""
    path.write_bytes(data)
    choices.forget()
    opts = options()
    choices.choose(KIND, "shape-e", opts, "direct")
    return opts


def valid(pick="im2col", cpu=None, runs=choices.PROCESSES, ms=None):
    entry = {"pick": pick, **({} if runs is None else {"runs": runs}),
             **({} if ms is None else {"ms": ms})}
    return json.dumps({"format": choices.FORMAT, "cpu": cpu or native.cpu_identity(),
                       "choices": {f"{KIND}|shape-e": entry}}).encode()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "pickle", "not an object",
                                    "wrong format", "foreign cpu", "unknown option",
                                    "option of another kind", "wrong types", "too large"])
def test_a_damaged_or_foreign_file_is_ignored_and_rewritten(fresh_choices, damage):
    choices.choose(KIND, "warm", options(), "direct")        # makes the file and its path
    path = choices.path()
    data = {"garbage": b"\x00\xff not json",
            "truncated": valid()[:40],
            "empty": b"",
            "pickle": pickle.dumps({"choices": {f"{KIND}|shape-e": {"pick": "im2col"}}}),
            "not an object": b"[1, 2, 3]",
            "wrong format": valid().replace(b'"format": 1', b'"format": 99'),
            "foreign cpu": valid(cpu="some other machine"),
            "unknown option": valid(pick="os.system"),
            "option of another kind": valid(pick="winograd"),   # conv2d_dw has none
            "wrong types": json.dumps({"format": 1, "cpu": native.cpu_identity(),
                                       "choices": {f"{KIND}|shape-e": ["im2col"]}}).encode(),
            "too large": valid() + b" " * choices.MAX_FILE_BYTES}[damage]
    opts = write_then_choose(path, data)
    assert all(o.calls > 1 for o in opts.values())           # measured anew
    doc = json.loads(path.read_text())                       # and the file rewritten whole
    assert doc["cpu"] == native.cpu_identity()
    assert doc["choices"][f"{KIND}|shape-e"]["pick"] in ("direct", "im2col")


def test_a_valid_file_is_honoured(fresh_choices):
    choices.choose(KIND, "warm", options(), "direct")
    opts = write_then_choose(choices.path(), valid(pick="im2col"))
    assert (opts["im2col"].calls, opts["direct"].calls) == (1, 0)


@pytest.mark.parametrize("how", ["symlink", "writable by others"])
def test_an_untrusted_file_is_not_read(fresh_choices, how, tmp_path):
    choices.choose(KIND, "warm", options(), "direct")
    path = choices.path()
    if how == "symlink":
        target = tmp_path / "elsewhere.json"
        target.write_bytes(valid(pick="im2col"))
        path.unlink()
        path.symlink_to(target)
    else:
        path.write_bytes(valid(pick="im2col"))
        os.chmod(path, 0o666)
    choices.forget()
    opts = options()
    choices.choose(KIND, "shape-e", opts, "direct")
    assert all(o.calls > 1 for o in opts.values())


def test_a_failed_write_leaves_the_old_file_and_no_temporary(fresh_choices, monkeypatch):
    choices.choose(KIND, "shape-f", options(), "direct")
    path = choices.path()
    before = path.read_bytes()

    def failing(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing)
    choices.choose(KIND, "shape-g", options(), "direct")    # chosen, kept in memory
    assert path.read_bytes() == before
    assert [p.name for p in fresh_choices.iterdir() if p.name.startswith(".")] == []
    assert f"{KIND}|shape-g" in choices.chosen()


def test_an_unsafe_cache_directory_keeps_choices_in_memory(fresh_choices):
    fresh_choices.mkdir(parents=True)
    os.chmod(fresh_choices, 0o777)
    try:
        assert choices.choose(KIND, "shape-h", options(), "direct") in ("direct", "im2col")
        assert choices.path() is None and not list(fresh_choices.glob("choices-*"))
    finally:
        os.chmod(fresh_choices, 0o700)
