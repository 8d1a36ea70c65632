"""GPU speed and memory of whole nets: minigraph against PyTorch eager on the same GPU.

    python benchmarks/nets_gpu.py [--rounds 3] [--repeat 20] [--cases resnet:128 mlp:1024]
                                  [--budget-s 240] [--quick] [--no-write]

The nets of benchmarks/nets_cpu.py (the same architectures, optimizers and seeded
batches) at nets_cpu's batches - digits 64, resnet 32, mnist 64, mlp 128 - the
ResNet at 128 and the wide MLP at 1024, and the GPT of examples/train_gpt.py at its
default config and batch (gpt 32: 32 windows of 128 characters; the case and its
PyTorch twin are in nets_gpu_gpt.py). For each: a training step (forward, backward,
update; the batch copied from the host and the loss fetched to the host, as
minigraph's net.train does: PyTorch gets `x.cuda()`, `y.cuda()` and `loss.item()`)
and an inference batch (minigraph: mg.passes.optimize_for_inference's net; PyTorch:
eval mode under torch.inference_mode; both copy the logits to the host), each the
median of --repeat steps after --warmup, first with TF32 off on both sides
(torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False;
minigraph's default), then TF32 on (both flags True; mg.set_tf32(True)).

Each framework runs in processes of its own (this script with --worker), all cases
in one process per round; --rounds rounds alternate which framework goes first. A
table shows the median over rounds of each side's time and the median of the
rounds' ratios (minigraph / PyTorch). Peak device memory per step: PyTorch's
torch.cuda.max_memory_allocated() over the timed training steps, minigraph's peak
of the bytes its allocations hold (the memory pool's blocks handed out, those a
CUDA graph keeps included) over the same steps; both count parameters, optimizer
state, the batch, activations and library workspaces. Then one training step of
--profile-case (default resnet:128) through net.profile on the GPU: its 10 costliest
ops (each kernel timed between device synchronisations).

It prints the tables (markdown: `| net | batch | step | minigraph ms | PyTorch ms |
ratio |`) and writes them, with the GPU and the date, into the `nets_gpu` section of
docs/performance.md (--no-write: print only). benchmarks/gpu_check.py runs it as its
`nets` step and copies the tables into benchmarks/RESULTS.md. Rounds stop early
when --budget-s seconds are spent (at least one round runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import nets_gpu_gpt as gpt  # noqa: E402  (a module beside this one)

CASES = (("digits", 64), ("resnet", 32), ("mnist", 64), ("mlp", 128), ("resnet", 128),
         ("mlp", 1024), (gpt.NAME, gpt.BATCH))
STEPS = ("train", "infer")
HEADER = ("net", "batch", "step", "minigraph ms", "PyTorch ms", "ratio")
MEMORY_HEADER = ("net", "batch", "minigraph MiB", "PyTorch MiB", "ratio")
TOP = 10


def case_name(case):
    return f"{case[0]}:{case[1]}"


def parse_case(text):
    """("resnet", 128) of "resnet:128"; ValueError for a net that is neither one of
    nets_cpu's nor the GPT."""
    from nets_models import NETS

    names = sorted((*NETS, gpt.NAME))
    name, _, n = text.partition(":")
    if name not in names or not n.isdigit() or int(n) <= 0:
        raise argparse.ArgumentTypeError(f"a case is NET:BATCH with NET one of "
                                         f"{', '.join(names)}, got {text!r}")
    return name, int(n)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cases", type=parse_case, nargs="+", default=list(CASES))
    p.add_argument("--profile-case", type=parse_case, default=("resnet", 128))
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="start no new round after this many seconds")
    p.add_argument("--quick", action="store_true",
                   help="one round, 3 steps after 2 warm-up steps (a smoke test)")
    p.add_argument("--no-write", action="store_true",
                   help="print only; do not replace docs/performance.md's nets_gpu section")
    p.add_argument("--worker", choices=("minigraph", "pytorch", "profile"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.repeat, args.warmup = 1, 3, 2
    if args.rounds < 1 or args.repeat < 1 or args.warmup < 0:
        p.error("--rounds and --repeat must be at least 1, --warmup at least 0")
    return args


# ---- the workers (one process each) ---------------------------------------------------------

def timed(fn, repeat, warmup):
    from timing import median_ms

    return median_ms(fn, repeat, warmup)


class PeakBytes:
    """Wraps a device's allocate: bytes held by live allocations, and their peak. Where
    an allocation cannot be watched (no weak references), the pool's active bytes are
    read after each step instead (`sample`)."""

    def __init__(self, state):
        import weakref

        self.take, self.live, self.peak, self.weakref = state.allocate, 0, 0, weakref
        self.pool, self.exact = state.pool, True
        state.allocate = self

    def __call__(self, nbytes):
        block = self.take(nbytes)
        if self.exact:
            try:
                self.weakref.finalize(block, self._gone, int(nbytes))
            except TypeError:
                self.exact = False
            else:
                self.live += int(nbytes)
                self.peak = max(self.peak, self.live)
        return block

    def _gone(self, nbytes):
        self.live -= nbytes

    def sample(self):
        if not self.exact and self.pool is not None:
            self.peak = max(self.peak, int(self.pool.active_bytes))

    def reset(self):
        import gc

        gc.collect()
        self.peak = self.live if self.exact else 0
        self.sample()


def mg_case(place, tracker, name, n, tf32, args):
    """{train, infer (ms), peak_mib} of one case on the GPU with TF32 `tf32`."""
    from nets_models import batch, mg_net, mg_optimized

    import minigraph as mg

    mg.set_tf32(tf32)
    if name == gpt.NAME:
        return gpt.mg_case(place, tracker, n, args, timed)
    net, _, logits, loss = mg_net(name, place=place)
    x, y = batch(name, n=n)
    feed = {"image": x, "label": y}
    for _ in range(args.warmup + 3):            # past the plan's capture (minigraph/replay.py)
        net.train(feed=feed, fetch=[loss])
    tracker.reset()

    def step():
        net.train(feed=feed, fetch=[loss])
        tracker.sample()
    train = timed(step, args.repeat, 0)
    peak = tracker.peak / 2**20
    fast = mg_optimized(net)
    out = logits.name
    infer = timed(lambda: fast.infer(feed={"image": x}, fetch=[out]), args.repeat,
                  args.warmup + 3)
    return {"train": train, "infer": infer, "peak_mib": peak}


def mg_worker(args):
    import minigraph as mg
    from minigraph import device

    place = mg.GPUPlace(0)
    with place.activate():
        tracker = PeakBytes(device.current())
    results = {}
    try:
        for name, n in args.cases:
            for tf32 in (False, True):
                results[f"{name}:{n}:{int(tf32)}"] = mg_case(place, tracker, name, n, tf32,
                                                             args)
    finally:
        mg.set_tf32(False)
    return results


def torch_case(name, n, tf32, args):
    import torch
    import torch.nn.functional as F
    from nets_models import batch
    from nets_torch import torch_model, torch_optimizer

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True
    if name == gpt.NAME:
        return gpt.torch_case(n, args, timed)
    dev = torch.device("cuda")
    model = torch_model(name).to(dev)
    xh, yh = (torch.from_numpy(a) for a in batch(name, n=n))
    opt = torch_optimizer(name, model)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xh.to(dev)), yh.to(dev))
        loss.backward()
        opt.step()
        loss.item()

    model.train()
    for _ in range(args.warmup + 3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train = timed(step, args.repeat, 0)
    peak = torch.cuda.max_memory_allocated() / 2**20
    model.eval()

    def infer():
        with torch.inference_mode():
            model(xh.to(dev)).cpu()

    return {"train": train, "infer": timed(infer, args.repeat, args.warmup + 3),
            "peak_mib": peak}


def torch_worker(args):
    import torch

    results = {}
    for name, n in args.cases:
        for tf32 in (False, True):
            results[f"{name}:{n}:{int(tf32)}"] = torch_case(name, n, tf32, args)
            torch.cuda.empty_cache()            # the last case's blocks, before the next
    return results


def profile_worker(args):
    """The TOP costliest ops of one training step of --profile-case (net.profile)."""
    from nets_models import batch, mg_net

    import minigraph as mg

    name, n = args.profile_case
    if name == gpt.NAME:
        net, feed = gpt.mg_profile_feed(n, mg.GPUPlace(0))
    else:
        net, _, _, _ = mg_net(name, place=mg.GPUPlace(0))
        x, y = batch(name, n=n)
        feed = {"image": x, "label": y}
    table = net.profile(feed, steps=2, mode="train", warmup=2)
    rows = sorted(table.by_op, key=lambda r: -r.ms)[:TOP]
    return {"step_ms": table.step_median_ms, "timed_step_ms": table.timed_step_ms,
            "ops": [[r.name, r.ms, r.share] for r in rows]}


# ---- the driver -------------------------------------------------------------------------------

def run_worker(kind, args):
    """One worker process; its JSON result (RuntimeError with its output when it fails)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--repeat",
           str(args.repeat), "--warmup", str(args.warmup), "--profile-case",
           case_name(args.profile_case), "--cases", *map(case_name, args.cases)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} worker failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rounds(args, run=run_worker, clock=time.monotonic):
    """[(minigraph results, PyTorch results)] of each round run, minigraph first in even
    rounds; no round starts once args.budget_s seconds have passed."""
    start, got = clock(), []
    for i in range(args.rounds):
        if got and clock() - start > args.budget_s:
            print(f"(stopped after {len(got)} of {args.rounds} rounds: the budget of "
                  f"{args.budget_s:g} s is spent)", flush=True)
            break
        order = ("minigraph", "pytorch") if i % 2 == 0 else ("pytorch", "minigraph")
        results = {kind: run(kind, args) for kind in order}
        got.append((results["minigraph"], results["pytorch"]))
    return got


def fmt(v, digits=2):
    return f"{v:.{digits}f}"


def tables(args, got):
    """(time rows TF32 off, time rows TF32 on, memory rows): markdown cells, medians over
    the rounds (ratios: the median of the rounds' ratios)."""
    times = {False: [], True: []}
    memory = []
    for name, n in args.cases:
        for tf32 in (False, True):
            key = f"{name}:{n}:{int(tf32)}"
            for step in STEPS:
                mine = [r[0][key][step] for r in got]
                theirs = [r[1][key][step] for r in got]
                ratio = statistics.median(m / t for m, t in zip(mine, theirs))
                times[tf32].append((name, n, step, fmt(statistics.median(mine)),
                                    fmt(statistics.median(theirs)), fmt(ratio)))
        key = f"{name}:{n}:0"
        m = statistics.median(r[0][key]["peak_mib"] for r in got)
        t = statistics.median(r[1][key]["peak_mib"] for r in got)
        memory.append((name, n, fmt(m, 1), fmt(t, 1), fmt(m / t) if t else "-"))
    return times[False], times[True], memory


def profile_lines(result, case):
    """Markdown lines: the costliest ops of one profiled training step."""
    lines = [f"Top {TOP} ops of one {case_name(case)} training step (net.profile on the GPU, "
             f"each kernel between device synchronisations; step {fmt(result['step_ms'])} ms "
             f"untimed, {fmt(result['timed_step_ms'])} ms timed):", "",
             "| op | ms | share |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.3f} | {share:.1%} |" for name, ms, share in result["ops"]]
    return lines


def markdown(args, got, profile, rounds_run):
    from report import markdown_table

    off, on, memory = tables(args, got)
    setting = (f"{rounds_run} round(s), each framework in processes of its own, alternating; "
               f"medians of {args.repeat} steps after {args.warmup} warm-up steps; ratio = "
               "minigraph / PyTorch (the median of the rounds' ratios)")
    parts = ["TF32 off on both sides (minigraph's default; PyTorch's allow_tf32 flags False). "
             + setting + ".", markdown_table(HEADER, off),
             "TF32 on on both sides (mg.set_tf32(True); PyTorch's allow_tf32 flags True).",
             markdown_table(HEADER, on),
             "Peak device memory of a training step (TF32 off; everything allocated counted).",
             markdown_table(MEMORY_HEADER, memory)]
    if profile is not None:
        parts.append("\n".join(profile_lines(profile, args.profile_case)))
    return "\n\n".join(parts)


def gpu_line():
    """'GPU: name, driver' from nvidia-smi (best effort)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=60)
        return f"GPU: {done.stdout.strip().splitlines()[0]}"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "GPU: unknown"


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        work = {"minigraph": mg_worker, "pytorch": torch_worker, "profile": profile_worker}
        print(json.dumps(work[args.worker](args)))
        return 0
    got = rounds(args)
    try:
        profile = run_worker("profile", args)
    except RuntimeError as e:
        print(f"profile not taken: {e}", file=sys.stderr)
        profile = None
    text = markdown(args, got, profile, len(got))
    print(text)
    from report import machine_line, write_section

    write_section("nets_gpu", f"{machine_line(gpu_line() + '.')}\n\n{text}",
                  enabled=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
