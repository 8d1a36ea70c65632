"""Which kernel runs a product or a convolution of a given shape: chosen by timing the
candidates on this machine at their first use, and kept per machine.

A kernel launcher that has more than one way to compute an op (fused_fc, and mul's
products in training (mul.product, mul_grad's input gradient): the native kernel or
BLAS's product; a weight gradient (mul.weight_grad): either native kernel or BLAS's
product; a convolution:
Winograd, the direct native kernel or the im2col engine on BLAS; each only where the
op's memory rules allow it) calls `choose(kind, key, options, default)` (or `pick`, for
the name of the option without running it, as a bound form does). The first
call for a key times every option: one untimed call each, then ROUNDS rounds of one
timed call each in alternating order, the least time of each counting; where more
than one option takes at most 1 / MARGIN^2 (about 1.23) times the fastest's time (a
close call, which a drift of this machine's speed could decide), CLOSE_ROUNDS more
rounds of those. An option replaces the default only where it takes at most MARGIN
of the default's time (so that noise does not flip a choice). Later calls run the
chosen option at once.

A choice is final once PROCESSES processes have timed it: a process that finds a
choice timed by fewer (in the machine's file) times it again at its first pick, and
each option's least time over all those processes decides. Another program loading
the CPU only ever makes an option slower, so a choice that the first process timed
under such load (some options at several times their time alone) is put right by
the next one that runs alone, and is then kept. Every option computes the same
result up to float32 rounding (each is tested against the same float64 reference),
so a choice changes the time, not the result beyond the tests' tolerances.

Choices are kept in memory and in one file per machine beside the native kernels
(native_cache.cache_dir()): `choices-<digest>.json`, the digest of this CPU's model
and instruction-set flags (native.cpu_identity()), which the file also holds. Keys
name the threads and the kernels' build (native.build_key: their source, flags and
compiler), so another thread count, a changed kernel or a build for another
instruction set (CC="cc -mno-avx512f") chooses anew. The file is written
atomically (a temporary file, fsynced, renamed), each write first taking in the
entries other processes wrote since for keys this one does not hold, under an
exclusive lock of `choices-<digest>.lock` beside it (processes that time at once,
such as the ranks of one host, keep each other's choices). It is JSON
(never unpickled), read defensively: only a regular file of this user's that no one
else can write, at most MAX_FILE_BYTES, of the expected format, for this CPU, whose
entries name options of their kind; anything else is ignored (its choices measured
again) and the file rewritten. Where the cache directory is not private (native_cache.
check_private) or cannot be written, choices live in memory only.

With MINIGRAPH_TUNE=0, or MINIGRAPH_NATIVE=0 (every kernel on numpy), nothing is
timed: each op runs its default. `forcing({kind: name})` runs a given option
(tests, benchmarks).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from time import monotonic, sleep  # the lock's wait (tests replace `time`'s clock)

from minigraph.kernels.cpu import native, native_cache

ENV = "MINIGRAPH_TUNE"
FORMAT = 1
ROUNDS = 3
PROCESSES = 2           # processes whose timings make a choice final
CLOSE_ROUNDS = 6
MARGIN = 0.9
MAX_FILE_BYTES = 1 << 20
LOCK_WAIT_S = 2.0       # the longest a write waits for another process's lock of the file
KINDS = {               # the options each kind of choice may name
    "fc": ("native", "blas"),
    "mm": ("native", "blas"),
    "fc_dw": ("native", "panels", "blas"),
    "conv2d": ("winograd", "direct", "im2col"),
    "conv2d_dx": ("winograd", "direct", "im2col"),
    "conv2d_dw": ("direct", "im2col"),
    "fused_conv2d": ("winograd", "direct", "im2col"),
}

_lock = threading.RLock()
_table = None           # key -> {"pick": option name, "ms": {name: least ms}, "runs":
                        # processes that timed it}; None until read
_path = None            # where the table is kept, or None (memory only)
_timed_here = set()     # keys this process timed (never timed twice in one process)
_forced = {}


def enabled():
    """False with MINIGRAPH_TUNE=0 (or off, no) or with the native kernels off."""
    return native.enabled() and not native.switched_off(ENV)


def choose(kind, key, options, default):
    """The result of the option chosen for (kind, key): options maps option names (of
    KINDS[kind]) to calls that compute the op; default names the one that runs where
    nothing is timed (see the module doc)."""
    return options[pick(kind, key, options, default)]()


def pick(kind, key, options, default):
    """The name of the option chosen for (kind, key), as choose runs it: timed (each
    option called) at the first pick of the key in each process until PROCESSES
    processes have timed it, looked up after."""
    name = forced(kind, options)
    if name is not None:
        return name
    if len(options) == 1 or not enabled():
        return default
    full = f"{kind}|{key}"
    with _lock:
        entry = _choices().get(full, {})
        name = entry.get("pick")
        if name in options and (entry.get("runs", 1) >= PROCESSES or full in _timed_here):
            return name
    times = _measure(options)
    earlier = entry.get("ms", {}) if name in options else {}
    for option, ms in earlier.items():
        if option in times:
            times[option] = min(times[option], ms / 1e3)
    name = _decide(times, default)
    with _lock:
        _timed_here.add(full)
    _remember(full, name, times, entry.get("runs", 1) + 1 if earlier else 1)
    return name


def forced(kind, options):
    """The option `forcing` names for choices of `kind`, where `options` has it; else
    None."""
    name = _forced.get(kind)
    return name if name in options else None


@contextlib.contextmanager
def forcing(names):
    """Inside the block, every choice of kind k runs option names[k] where the op has
    it (tests and benchmarks)."""
    global _forced
    old = _forced
    _forced = {**old, **names}
    try:
        yield
    finally:
        _forced = old


def chosen():
    """{key: option name}: the choices in effect in this process (read from the
    machine's file, or made here)."""
    with _lock:
        return {key: entry["pick"] for key, entry in _choices().items()}


def path():
    """The file this machine's choices are kept in (None: memory only)."""
    with _lock:
        _choices()
        return _path


def forget():
    """Drop the choices this process holds (read from the file again at next use)."""
    global _table, _path
    with _lock:
        _table, _path = None, None
        _timed_here.clear()


def _measure(options):
    """{name: least seconds} of every option, timed in alternating rounds."""
    names = list(options)
    for name in names:
        options[name]()                                   # warm: packing, first touch
    best = {name: float("inf") for name in names}
    for r in range(ROUNDS):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            options[name]()
            best[name] = min(best[name], time.perf_counter() - t)
    limit = min(best.values()) / MARGIN ** 2
    close = [name for name in names if best[name] <= limit]
    for r in range(CLOSE_ROUNDS if len(close) > 1 else 0):
        for name in close if r % 2 == 0 else close[::-1]:
            t = time.perf_counter()
            options[name]()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _decide(best, default):
    """The option to run, from each one's least time: the fastest where it takes at
    most MARGIN of the default's time, else the default."""
    fastest = min(best, key=best.get)
    return default if best[fastest] > MARGIN * best[default] else fastest


def _identity():
    return native.cpu_identity()


def _file():
    """The machine's choices file in the cache directory, or None where that directory
    is missing, not private or cannot be made."""
    directory = native_cache.cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        native_cache.check_private(directory)
    except (OSError, native_cache.UnsafeCache):
        return None
    digest = hashlib.sha256(_identity().encode()).hexdigest()[:16]
    return directory / f"choices-{digest}.json"


def _choices():
    global _table, _path
    if _table is None:
        _path = _file()
        _table = _read(_path) if _path is not None else {}
    return _table


def _read(path):
    """The valid entries of the file at `path` ({} where it is missing, damaged,
    foreign or not to be trusted: see the module doc)."""
    data = native_cache.read_trusted(path, MAX_FILE_BYTES)
    if data is None:
        return {}
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT
            and doc.get("cpu") == _identity() and isinstance(doc.get("choices"), dict)):
        return {}
    table = {}
    for key, entry in doc["choices"].items():
        kind = key.split("|", 1)[0]
        name = entry.get("pick") if isinstance(entry, dict) else None
        if name in KINDS.get(kind, ()):
            times = entry.get("ms")
            ok = isinstance(times, dict) and all(
                n in KINDS[kind] and isinstance(t, (int, float)) for n, t in times.items())
            runs = entry.get("runs", 1)
            table[key] = {"pick": name, **({"ms": times} if ok else {}),
                          "runs": runs if type(runs) is int and runs >= 1 else 1}
    return table


def _remember(key, name, times, runs):
    """Keep the choice (timed by `runs` processes) in memory and, where there is a
    file, write the whole table back with the file's entries of keys not held here
    (atomically; a failed write leaves the old file and costs nothing else)."""
    with _lock:
        table = _choices()
        table[key] = {"pick": name, "ms": {n: round(t * 1e3, 4) for n, t in times.items()},
                      "runs": runs}
        if _path is None:
            return
        with _file_locked(_path):
            for other, entry in _read(_path).items():
                table.setdefault(other, entry)
            doc = {"format": FORMAT, "cpu": _identity(), "choices": table}
            try:
                native_cache.write_text(_path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
            except OSError:
                pass


@contextlib.contextmanager
def _file_locked(path):
    """Holds an exclusive lock (flock) of the file `path` with .lock for .json, made
    where missing (never through a symlink), so that no other process reads and
    rewrites `path` meanwhile; without one where it cannot be opened, or locked
    within LOCK_WAIT_S (a process stopped while it holds the lock stalls no other)."""
    try:
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if monotonic() > deadline:
                    break
                sleep(0.001)
            except OSError:
                break
        yield
    finally:
        os.close(fd)                        # closing the last descriptor unlocks
