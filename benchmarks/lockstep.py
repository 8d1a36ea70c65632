"""Two frameworks timed in lockstep: each in a process of its own, both alive at once,
taking turns in short blocks, so that a spell of a slow machine lands on both sides of
a pair of blocks.

On a shared machine a process's speed moves by 2x within seconds (a digits training
step on one thread: 0.78-1.51 ms from one 200-step window to the next in one process;
docs/performance.md). Two processes run one after the other see different spells;
blocks of a few steps that alternate a few milliseconds apart see the same one, and
the ratio of a pair of blocks is the comparison.

Worker side: `serve(commands)` answers commands read from stdin, one JSON line each;
`block_ms(fn, block)` is a block's median time. Driver side: `Pair` starts the two
workers one after the other, each warming up alone (a framework's first-use work, such
as minigraph's kernel builds and the kernel choices it times, then has the machine to
itself), and `ask`s one at a time while the other waits on its pipe (blocked in a
read: it spends no CPU time, which `waiting_ms` checks).
"""
from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

READY = "ready"
REWARM = 2            # untimed calls at the start of a block: the other process ran meanwhile
REWARM_S = 0.005      # ... and at least this long
MIN_BLOCK_S = 0.05    # a block's timed calls go on at least this long (small nets' steps)
SETTLE_S = 0.02       # the pause before each block: the other side's threads stop spinning


def block_ms(fn, block, rewarm=REWARM, min_s=MIN_BLOCK_S, rewarm_s=REWARM_S):
    """The median wall time in ms of `block` calls of fn() (more, until they have taken
    `min_s` seconds), after `rewarm` untimed ones (more, until `rewarm_s` seconds)."""
    start = time.perf_counter()
    calls = 0
    while calls < rewarm or time.perf_counter() - start < rewarm_s:
        fn()
        calls += 1
    times = []
    while len(times) < block or sum(times) < min_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def serve(commands, stdin=None, stdout=None):
    """Worker side: print READY, then for each line read (a command's name) print the
    JSON of commands[name]() on one line, until "quit" or the end of input. An unknown
    name is an error (the driver and the worker disagree)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    print(READY, file=stdout, flush=True)
    for line in stdin:
        name = line.strip()
        if name == "quit":
            return
        if name not in commands:
            raise KeyError(f"lockstep.serve: unknown command {name!r}; known: "
                           f"{sorted(commands)}")
        print(json.dumps(commands[name]()), file=stdout, flush=True)


def cpu_ns(pid):
    """CPU time in ns that process `pid`'s threads have spent (the first field of each
    /proc/<pid>/task/<tid>/schedstat; Linux), or None where that is not readable."""
    total, root = 0, f"/proc/{pid}/task"
    try:
        for tid in os.listdir(root):
            with open(f"{root}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total


class Pair:
    """Two workers (name -> command line), each started once the one before is ready;
    `ask(name, command)` runs one command on one of them while the other waits.
    `waiting_ms` sums the CPU time the waiting side spent during the other's commands
    (None where /proc is not readable): near 0 when the turns do not overlap. A worker
    that exits, or answers nothing for `timeout_s`, is a RuntimeError with its stderr
    (both are stopped)."""

    def __init__(self, commands, env=None, timeout_s=600.0):
        self.timeout_s = timeout_s
        self.errs = {name: tempfile.TemporaryFile("w+") for name in commands}
        self.procs = {}
        self.waiting_ms = 0.0
        for name, cmd in commands.items():
            try:
                self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                                    stdout=subprocess.PIPE,
                                                    stderr=self.errs[name], text=True, env=env)
            except OSError:             # a command that cannot start: stop the other
                self.close(kill=True)
                raise
            line = self._line(name)     # its warm-up, alone on the machine
            if line != READY:
                self._fail(name, f"sent {line!r} where it should say {READY!r}")

    def ask(self, name, command):
        """The JSON answer of worker `name` to `command`, after SETTLE_S of pause."""
        time.sleep(SETTLE_S)
        others = [p.pid for n, p in self.procs.items() if n != name]
        before = [cpu_ns(pid) for pid in others]
        proc = self.procs[name]
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        answer = json.loads(self._line(name))
        after = [cpu_ns(pid) for pid in others]
        if self.waiting_ms is not None and None not in before + after:
            self.waiting_ms += sum(a - b for a, b in zip(after, before)) / 1e6
        else:
            self.waiting_ms = None
        return answer

    def _line(self, name):
        """The next line of worker `name` (one answer: nothing else is ever buffered)."""
        proc = self.procs[name]
        if not select.select([proc.stdout], [], [], self.timeout_s)[0]:
            self._fail(name, f"answered nothing in {self.timeout_s:g} s", kill=True)
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=self.timeout_s)
            self._fail(name, f"exited with {proc.returncode}")
        return line.strip()

    def _fail(self, name, what, kill=False):
        self.close(kill=kill)
        err = self.errs[name]
        err.seek(0)
        raise RuntimeError(f"lockstep worker {name} {what}:\n{err.read()[-4000:]}")

    def close(self, kill=False):
        """Ask every worker to quit and wait for it (killed at once with `kill`, else
        after the timeout)."""
        for proc in self.procs.values():
            try:
                if proc.poll() is None:
                    if kill:
                        proc.kill()
                    else:
                        proc.stdin.write("quit\n")
                        proc.stdin.flush()
            except OSError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        for err in self.errs.values():
            err.close()


def take_turns(commands, slices, kinds, last=()):
    """Driver side: a Pair of `commands` (name -> command line; the first name's turn
    first in even slices, last in odd ones); per slice, each of `kinds` asked of each
    worker in turn; then each of `last` of each worker. Returns ({name: {kind: the
    answers, one a slice}}, {name: {command in last: its answer}}, the Pair's
    waiting_ms)."""
    order = tuple(commands)
    with Pair(commands) as pair:
        answers = {name: {kind: [] for kind in kinds} for name in order}
        for s in range(slices):
            for kind in kinds:
                for name in (order if s % 2 == 0 else order[::-1]):
                    answers[name][kind].append(pair.ask(name, kind))
        ends = {name: {command: pair.ask(name, command) for command in last}
                for name in order}
        return answers, ends, pair.waiting_ms
