"""net.profile(): where the time of a step goes, per op type and per layer.

`profile(net, feed, steps=10, mode="train")` runs `warmup` steps (in training on
the CPU, more while the plan still measures its threads per op: minigraph.op_threads),
then, in
turn, a step of `net.train` (or `net.infer`) as it is and a step whose
kernels are timed, `steps` of each, all with the same feed: the net's own
path, its compiled plan and kernels. For a timed step only, the kernels the
plan picked (minigraph.executor's `Compiled.kernels`) are wrapped by timers,
and put back after it: an unprofiled run never pays for profiling. On a GPU
each timer synchronises the device before and after its kernel, so a
kernel's time is its own. On the CPU a timed inference step runs each op's
kernel rather than its bound form (minigraph.bound_run), which would run past
the timer; untimed steps run the bound forms.

The step total is the wall time of the untimed `net.train` / `net.infer`
calls, as benchmarks/nets_cpu.py measures it (the timers' own cost is not in
it). The rows split the timed steps: every op's time is its kernel's; what a
step spends outside kernels (checking and storing the feeds, the journal's
copies of the persistables a step writes, handing values over and releasing
them, fetching, and the timers) is the row `(executor)`; shares are of the
timed step, so they add up to 1. With GradientMerge(k) the steps come in
whole cycles of k. Each op belongs to a layer as
minigraph.pictures.layer_map says; ops of no layer are `(optimizer)` in the update
section and `(no layer)` elsewhere.

Profiling a training net does not train it: every persistable (parameters,
estimates, counters, optimizer state) is put back as it was before the first
profiled step, also when a step raises.
"""
from __future__ import annotations

import statistics
import time
import weakref
from typing import NamedTuple

from minigraph import feeds, op_threads
from minigraph.pictures.layer_map import LayerMap

MODES = ("train", "infer")
EXECUTOR = "(executor)"
OPTIMIZER = "(optimizer)"
NO_LAYER = "(no layer)"
SECTIONS = {"train": ("trunk", "train", "backward", "update"), "infer": ("trunk", "infer")}


class Row(NamedTuple):
    """One line of a profile table: `ms` is the mean time per timed step in
    milliseconds, `share` its fraction of that step, `calls` the kernel calls over
    all the timed steps (0 for the executor's row)."""

    name: str
    ms: float
    share: float
    calls: int


class ProfileTable:
    """What net.profile() measured. str(table) is a readable table.

    mode: "train" or "infer"; steps: how many steps had their kernels timed;
    place: the net's place (repr); step_ms / step_median_ms: the mean and median
    wall time of a step (ms), measured on as many steps without timers run in
    turn with the timed ones (a benchmark's measure); step_times_ms: each of
    those; timed_step_ms: the mean wall time of the timed steps, whose parts the
    rows are (the timers' own cost is the difference). by_type, by_layer: Rows
    sorted by time, with the `(executor)` row (the rest of the timed step)
    last, their shares adding up to 1; by_op: a Row per op that ran
    (`<section>:<index> <type>`), in plan order. op_share(op), ops_share(ops)
    and layer_share(name) give shares of the timed step."""

    def __init__(self, net, mode, step_times, timed_times, op_times):
        self._net = weakref.ref(net)
        self.mode, self.steps, self.place = mode, len(timed_times), repr(net.place)
        self.step_times_ms = tuple(1e3 * t for t in step_times)
        self.step_ms = statistics.fmean(self.step_times_ms)
        self.step_median_ms = statistics.median(self.step_times_ms)
        self.timed_step_ms = 1e3 * statistics.fmean(timed_times)
        lmap = LayerMap(net)
        self._op_ms, by_op, types, layers = {}, [], {}, {}
        for section in SECTIONS[mode]:
            for i, op in enumerate(net.section(section)):
                timed = op_times.get(id(op))
                if timed is None:
                    continue
                seconds, calls = timed
                ms = 1e3 * seconds / self.steps
                self._op_ms[id(op)] = ms
                by_op.append(self._row(f"{section}:{i} {op.type}", ms, calls))
                layer = lmap.layer_of(op) or (OPTIMIZER if section == "update" else NO_LAYER)
                for table, key in ((types, op.type), (layers, layer)):
                    total = table.get(key, (0.0, 0))
                    table[key] = (total[0] + ms, total[1] + calls)
        self._layer_ms = {name: ms for name, (ms, _) in layers.items()}
        rest = self._row(EXECUTOR, max(0.0, self.timed_step_ms - sum(self._op_ms.values())), 0)
        self.by_op = tuple(by_op)
        self.by_type = self._sorted(types) + (rest,)
        self.by_layer = self._sorted(layers) + (rest,)

    def _row(self, name, ms, calls):
        return Row(name, ms, self._share(ms), calls)

    def _share(self, ms):
        return ms / self.timed_step_ms if self.timed_step_ms > 0 else 0.0

    def _sorted(self, table):
        rows = (self._row(name, ms, calls) for name, (ms, calls) in table.items())
        return tuple(sorted(rows, key=lambda r: -r.ms))

    def op_share(self, op):
        """The share of the timed step that the Operator `op` took, or None when it
        was not timed."""
        ms = self._op_ms.get(id(op))
        return None if ms is None else self._share(ms)

    def ops_share(self, ops):
        """The share of the timed step the Operators `ops` took together (None when
        none of them was timed)."""
        timed = [self._op_ms[id(op)] for op in ops if id(op) in self._op_ms]
        return None if not timed else self._share(sum(timed))

    def layer_share(self, name):
        """The share of the timed step the layer `name` took (its forward ops, and in
        training its gradient and update ops), or None when none of its ops ran."""
        ms = self._layer_ms.get(name)
        return None if ms is None else self._share(ms)

    def of_net(self, net):
        """True when this table was measured on `net`."""
        return self._net() is net

    def __str__(self):
        head = [f"profile of {self.steps} {self.mode} steps on {self.place}: a step takes "
                f"{self.step_ms:.3f} ms (mean; median {self.step_median_ms:.3f} ms)",
                f"rows: the time inside each kernel and the rest, per step with the timers "
                f"({self.timed_step_ms:.3f} ms)"]
        return "\n".join([*head, "", *_table("op type", self.by_type, self.steps), "",
                          *_table("layer", self.by_layer, self.steps)])

    def __repr__(self):
        return (f"<ProfileTable {self.mode}: {self.steps} steps, {self.step_ms:.3f} ms per "
                "step>")


def _table(title, rows, steps):
    width = max([len(title)] + [len(r.name) for r in rows])
    head = f"{title:<{width}}  {'ms/step':>9}  {'share':>6}  {'calls':>6}  {'ms/call':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        per_call = f"{r.ms * steps / r.calls:.4f}" if r.calls else "-"
        lines.append(f"{r.name:<{width}}  {r.ms:>9.3f}  {100 * r.share:>5.1f}%  "
                     f"{r.calls or '-':>6}  {per_call:>8}")
    return lines


def profile(net, feed, steps=10, mode="train", fetch=None, warmup=2):
    """Time the kernels of `steps` steps of `mode` ("train" or "infer") of `net` on
    `feed`, and the wall time of as many steps without timers, in turn, after
    `warmup` steps; returns a ProfileTable (see the module doc).

    fetch: what each step fetches (default: the loss in training, the net's
    default fetches in inference). Training steps are real steps, then every
    persistable is put back, so the net is as it was. Arguments are checked
    first: a bad one is an error naming it, and nothing has run."""
    if not all(hasattr(net, a) for a in ("plan", "train", "infer", "section", "data_vars")):
        raise TypeError(f"profile: net must be a Net, got {type(net).__name__}")
    if mode not in MODES:
        raise ValueError(f"profile: mode must be 'train' or 'infer', got {mode!r}")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"profile: {name} must be an int >= {low}, got {value!r}")
    if mode == "train" and net.loss is None and fetch is None:
        raise ValueError("profile: mode='train' needs a net with a loss (call an optimizer's "
                         "minimize() first) or a fetch list")
    if fetch is None:
        fetch = (net.loss,) if mode == "train" else tuple(net.default_fetches)
    if isinstance(fetch, (str, bytes)) or not isinstance(fetch, (list, tuple)):
        raise TypeError(f"profile: fetch must be a list of Variables or names, got "
                        f"{type(fetch).__name__}")
    feed = feeds.feed_by_name(net.data_vars, feed, "profile")
    run = net.train if mode == "train" else net.infer
    merge = getattr(net, "_update_every", None) if mode == "train" else None
    block = merge[0] if merge else 1    # GradientMerge: whole cycles, updates included
    with net._lock:                     # no other thread steps while the timers are in
        targets = tuple(feeds.fetch_target(net, mode, f) for f in fetch)
        plans = [net.plan(mode, targets, update) for update in
                 ((True, False) if merge else (True,))]
        saved = _snapshot(net) if mode == "train" else []
        timers, plain, timed = [], [], []
        try:
            for _ in range(max(warmup, block)):
                run(feed=feed, fetch=list(fetch))
            for _ in range((2 * op_threads.ROUNDS + 1) * block):    # past threads measured
                if all(op_threads.settled(plan, net.place) for plan in plans):
                    break
                run(feed=feed, fetch=list(fetch))
            while len(timed) < steps:
                for times, wrap in ((plain, False), (timed, True)):
                    if wrap:
                        timers += [t for plan in plans
                                   for t in _install(plan.compiled(net.place), net.place)]
                    try:
                        for _ in range(block):
                            start = time.perf_counter()
                            run(feed=feed, fetch=list(fetch))
                            times.append(time.perf_counter() - start)
                    finally:
                        _uninstall(timers)
        finally:
            for var, value in saved:
                var.value = value
    op_times = {}
    for compiled, i, timer in timers:
        seconds, calls = op_times.get(id(compiled.steps[i].op), (0.0, 0))
        op_times[id(compiled.steps[i].op)] = (seconds + timer.seconds, calls + timer.calls)
    return ProfileTable(net, mode, plain, timed, op_times)


def check_table(table, net, who):
    """`table` checked as a ProfileTable measured on `net` (else an error naming `who`)."""
    if not isinstance(table, ProfileTable):
        raise TypeError(f"{who}: profile must be the table net.profile(...) returns, got "
                        f"{type(table).__name__}")
    if not table.of_net(net):
        raise ValueError(f"{who}: this profile table was measured on another net; profile "
                         "this net with net.profile(feed)")
    return table


class _Timer:
    """A kernel with a stopwatch: the seconds inside it and the calls, over the
    profiled steps."""

    __slots__ = ("fn", "seconds", "calls", "sync")
    timed = True            # a CUDA graph replay steps aside (minigraph/replay.py)

    def __init__(self, fn, sync):
        self.fn, self.sync, self.seconds, self.calls = fn, sync, 0.0, 0

    def __call__(self, op, ins, ctx):
        sync = self.sync
        if sync is not None:
            sync()
        start = time.perf_counter()
        try:
            return self.fn(op, ins, ctx)
        finally:
            if sync is not None:
                sync()
            self.seconds += time.perf_counter() - start
            self.calls += 1


def _install(compiled, place):
    """Wrap the kernels `compiled` picked in timers: [(compiled, step index, timer)]."""
    sync = None
    if place.kind == "gpu":
        try:
            import pycuda.driver as drv
        except ImportError:             # a place that runs kernels synchronously
            pass
        else:
            sync = drv.Context.synchronize
    found = []
    for i, fn in enumerate(compiled.kernels):
        if fn is not None and not isinstance(fn, _Timer):
            timer = _Timer(fn, sync)
            compiled.kernels[i] = timer
            found.append((compiled, i, timer))
    compiled.bound = None       # bound forms (CPU inference) would run past the timers
    return found


def _uninstall(timers):
    for compiled, i, timer in timers:
        if compiled.kernels[i] is timer:
            compiled.kernels[i] = timer.fn
    for compiled in {id(c): c for c, _, _ in timers}.values():
        compiled.bound = None   # made again for the kernels themselves


def _snapshot(net):
    return [(v, net.place.copy(v.value)) for v in net.persistables() if v.value is not None]
