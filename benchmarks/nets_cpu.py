"""CPU speed and memory of whole nets: minigraph against PyTorch, each in its own process.

    python benchmarks/nets_cpu.py [--threads 2] [--repeat 30] [--nets digits resnet] [--no-write]

It prints its table and then writes it, with the machine and the date, into
the `nets_cpu` section of docs/performance.md (benchmarks/report.py), replacing
the last run's; --no-write only prints.

Nets (the same architecture, batch and optimizer in both; benchmarks/nets_models.py
builds minigraph's, nets_torch.py PyTorch's): digits, resnet, mnist, mlp, recipe
(a user's first CNN: conv32 and conv64 blocks, AdamW with two parameter groups) and
mobile (MobileNet-style depthwise separable blocks).
minigraph runs every BN-ReLU pair as one batch_norm_relu op
(mg.passes.fuse_batch_norm_relu, before minimize); a BN whose output goes to a
residual add stays a batch_norm; the Momentum nets (digits, resnet, mobile) make their
updates in one merged_momentum op (mg.passes.merge_updates), PyTorch's SGD with
foreach=True.

Every measurement runs in a fresh process of its own (this script with
--worker): numpy's OpenBLAS threads and PyTorch's OpenMP threads slow each
other down many times over when they share a process on a few cores. Each
framework gets `--threads` threads (mg.set_num_threads, which also limits BLAS
through threadpoolctl; torch.set_num_threads). Results come back as JSON.

Timings run in lockstep (benchmarks/lockstep.py): --rounds (7) rounds, each a fresh
process of either framework, both alive, taking turns in --slices (5) blocks of
training steps and of inferences (--repeat steps in all, a block at least 50 ms),
the one waiting blocked on a pipe: a shared machine's speed moves by 2x within
seconds, and blocks milliseconds apart see the same spell. A round's ratio is the
median of its blocks' paired ratios; the table shows the median over rounds of each
side's time, the median of the rounds' ratios (the verdict) and their range.

- train: a block's median wall time of one training step (forward, backward,
  update; the loss fetched / `.item()`), after --warmup (20) warm-up steps: past the
  17 first steps in which minigraph measures each op on one thread and on all
  (minigraph.op_threads).
- infer: the same of one inference batch: minigraph's net after
  `mg.passes.optimize_for_inference` (batch norms folded, ops fused), PyTorch's
  model in eval mode under torch.inference_mode(). "infer (net)" is minigraph's
  unoptimised `net.infer`, for reference.
- infer between: after the blocks, each process in turn times the same inference
  right after each of --repeat training steps (a loop that evaluates mid-epoch), in
  blocks of 5 that alternate with blocks of 5 inferences in a row (alone) and of 5
  that each follow an idle loop as long as its training step (benchmarks/
  idle_loop.py: C on registers, no memory touched, no framework called), so that a
  drift of the machine's speed slows them alike; the second table gives each
  framework's between / alone per round (the time an inference takes must not
  depend on what the process did before it), after the idle loop / alone (what the
  machine alone takes from an inference after that much time on other work: the
  floor of between / alone on this machine), between / after the idle loop (what
  the training step itself takes) and the median over rounds of between - alone.
  The note under each net gives the most CPU time a waiting process spent during
  the other's turns in a round (0 when the turns did not overlap).
- targets (minigraph / PyTorch, the median of the rounds' ratios): train <= 0.8,
  infer and infer between <= 0.6; infer between / alone <= 1.05.
- floor: benchmarks/conv_gemm_floor.py's least time of the ResNet's conv
  products and column copies in numpy, nothing else, against PyTorch's times.
- overhead: in another process every kernel is wrapped with a timer; the
  executor's overhead per op is (step time - time inside kernels) / ops run,
  the wrapper's own cost included. "tiny ops" times a net of 100 relus on a
  (2, 3) tensor against calling the kernel 100 times.
- --profile: after each net's rounds, a process of each framework prints its
  costliest op types of a training step and of an inference (benchmarks/
  op_profile.py: net.profile, torch.profiler's self CPU time), and minigraph's
  kernel choices for the net's shapes on this machine; printed, not written.
- memory: peak resident memory a training step needs above the model, its
  optimizer state and the batch. In a fresh process with glibc's mmap
  threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_=65536, so freed arrays go
  back to the system and RSS follows what is alive), after warm-up steps the
  values the framework keeps between steps are dropped (minigraph: every
  non-persistable Variable; PyTorch: the gradients, zero_grad(set_to_none);
  each drops the last step's gradients as its step starts anyway), the RSS
  is read (VmRSS), the peak is reset (writing 5 to
  /proc/self/clear_refs) and after `--mem-steps` steps the peak is read
  (VmHWM): the step's peak is VmHWM - VmRSS; the table shows the median over
  --rounds pairs of such processes (minigraph, then PyTorch) and the range
  (a lone reading varies by about 0.1 MiB). For minigraph, tracemalloc's
  peak over one step (numpy reports its allocations to it) is shown too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from conv_gemm_floor import against_pytorch
from kernel_time import kernel_share, tiny_overhead, wrap_kernels
from lockstep import serve, take_turns
from nets_models import NETS, batch, mg_net, mg_optimized
from op_profile import STEPS, mg_profile, profile_lines, recording_choices
from timing import lockstep_commands, median_ms

TARGETS = {"train": 0.8, "infer": 0.6, "infer between": 0.6}   # minigraph / PyTorch
BETWEEN_TARGET = 1.05          # minigraph's inference between training steps / alone


def mg_worker(args):
    import minigraph as mg

    mg.set_num_threads(args.threads)
    if args.what == "overhead":
        timers = wrap_kernels()
    if args.what == "tiny":
        return tiny_overhead(args.repeat)
    used = recording_choices() if args.what == "profile" else None
    net, image, logits, loss = mg_net(args.net)
    x, y = batch(args.net)
    feed = {"image": x, "label": y}

    def step():
        net.train(feed=feed, fetch=[loss])

    if args.what == "memory":
        from peak_memory import mg_memory

        return mg_memory(net, step, args.warmup, args.mem_steps)
    if args.what == "overhead":
        ops = len(net.plan("train", (loss,)).ops)
        return kernel_share(step, timers, ops, args.repeat, args.warmup)
    if args.what == "profile":              # net.profile warms the plans up itself
        return mg_profile(net, loss, mg_optimized(net), logits.name, feed, STEPS, used)
    for _ in range(args.warmup):
        step()
    fast = mg_optimized(net)
    name = logits.name

    def infer():
        fast.infer(feed={"image": x}, fetch=[name])

    def extras():
        return {"infer (net)": median_ms(lambda: net.infer(feed={"image": x}, fetch=[logits]),
                                         args.repeat, args.warmup),
                "ops": {"train": len(net.plan("train", (loss,)).ops),
                        "infer": len(fast.plan("infer", (fast.var(name),)).ops)}}

    for _ in range(args.warmup):
        infer()
    serve(lockstep_commands(step, infer, args.repeat, args.warmup, args.block,
                            extras=extras))


# ---- the driver -------------------------------------------------------------------

def worker_command(framework, net, what, args):
    """The command line of a worker process of this script."""
    return [sys.executable, os.path.abspath(__file__), "--worker", framework, "--net", net,
            "--what", what, "--threads", str(args.threads), "--repeat", str(args.repeat),
            "--warmup", str(args.warmup), "--mem-steps", str(args.mem_steps),
            "--block", str(block_size(args))]


def block_size(args):
    """Steps (or inferences) per lockstep block: --repeat in all over --slices blocks."""
    return max(1, -(-args.repeat // args.slices))


def worker_result(framework, net, what, args):
    """Run one measurement in a fresh process; its JSON result."""
    env = dict(os.environ)
    if what == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run(worker_command(framework, net, what, args), env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{framework} {net} {what} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


TIMED = ("train", "infer", "infer between")
IN_TURNS = ("train", "infer")          # what the processes time in lockstep blocks
FRAMEWORKS = ("minigraph", "pytorch")


def lockstep_round(net, args, first):
    """One round: fresh processes of both frameworks taking turns (lockstep.take_turns:
    --slices slices of IN_TURNS blocks, `first`'s first in even slices), then each one's
    "steady" times. Returns ((minigraph, pytorch) results: the median block's times for
    IN_TURNS, steady's for the rest; each slice's paired ratio; the waiting CPU ms)."""
    order = (first, *(fw for fw in FRAMEWORKS if fw != first))
    blocks, steady, waiting = take_turns(
        {fw: worker_command(fw, net, "time", args) for fw in order}, args.slices,
        IN_TURNS, ("steady",))
    results = tuple({**steady[fw]["steady"], **{what: statistics.median(blocks[fw][what])
                                                 for what in IN_TURNS}}
                    for fw in FRAMEWORKS)
    paired = {what: [m / t for m, t in zip(blocks["minigraph"][what], blocks["pytorch"][what])]
              for what in IN_TURNS}
    return results, paired, waiting


def timed_rounds(net, args):
    """(minigraph, pytorch, ratios, steady, waiting): each framework's times, the
    median over `args.rounds` lockstep rounds (minigraph's process first in even
    rounds, PyTorch's in odd ones, and so its blocks in even slices); per measurement
    every round's ratio (train, infer: the median of its slices' paired ratios; infer
    between: the steady times' ratio); steady_rounds's lists; the most CPU ms a
    waiting process spent in a round."""
    rounds, ratios, waits = [], {w: [] for w in TIMED}, []
    for i in range(args.rounds):
        results, paired, waiting = lockstep_round(net, args, FRAMEWORKS[i % 2])
        rounds.append(results)
        for what in IN_TURNS:
            ratios[what].append(statistics.median(paired[what]))
        ratios["infer between"].append(results[0]["infer between"] /
                                       results[1]["infer between"])
        waits.append(waiting)
    mine = {**rounds[0][0], **{w: statistics.median(r[0][w] for r in rounds)
                               for w in (*TIMED, "infer (net)")}}
    theirs = {w: statistics.median(r[1][w] for r in rounds) for w in TIMED}
    waited = None if None in waits else max(waits)
    return mine, theirs, ratios, steady_rounds(rounds), waited


def steady_rounds(rounds):
    """From the rounds' (minigraph, pytorch) results, every round's inference between
    training steps / alone, after the idle loop / alone, between / after the idle loop
    and between minus alone (ms) for each framework ({"between": {"minigraph": [...],
    "pytorch": [...]}, "idle": ..., "step": ..., "lost": ...}; "idle" and "step" leave
    out rounds without the idle loop: no C compiler)."""
    sides = {"between": lambda r: r["infer between"] / r["infer alone"],
             "idle": lambda r: r["infer after idle"] / r["infer alone"],
             "step": lambda r: r["infer between"] / r["infer after idle"],
             "lost": lambda r: r["infer between"] - r["infer alone"]}
    return {what: {fw: [side(r[i]) for r in rounds
                        if what in ("between", "lost") or r[i]["infer after idle"] is not None]
                   for i, fw in enumerate(FRAMEWORKS)}
            for what, side in sides.items()}


def spread(values):
    return f"{min(values):.2f}-{max(values):.2f}"


def steady_row(rounds):
    """The second table's cells for one net from steady_rounds's per-round lists: for
    minigraph, then PyTorch, between / alone, after the idle loop / alone and between /
    after the idle loop (medians over rounds, their range in brackets; "-" without the
    idle loop) and between - alone (ms); then the verdict on minigraph's between /
    alone."""
    cells = []
    for fw in FRAMEWORKS:
        for what in ("between", "idle", "step"):
            got = rounds[what][fw]
            cells.append(f"{statistics.median(got):.2f} ({spread(got)})" if got else "-")
        cells.append(f"{statistics.median(rounds['lost'][fw]):.3f}")
    b = statistics.median(rounds["between"]["minigraph"])
    return (*cells, f"<= {BETWEEN_TARGET} {'ok' if b <= BETWEEN_TARGET else 'MISSED'}")


def report(args):
    """Run every measurement, print the tables and the notes under them; returns the
    same as markdown (tables and a list) for docs/performance.md."""
    setting = (f"threads: {args.threads} per framework, each framework in its own process; "
               f"{args.rounds} rounds, each a fresh process of both frameworks, alive together "
               f"and taking turns after {args.warmup} warm-up steps: {args.slices} blocks of "
               f"{block_size(args)} training steps and of {block_size(args)} inferences each, "
               "the two frameworks' blocks alternating (the one waiting blocked on a pipe); "
               "a round's train and infer ratio: the median of its blocks' paired ratios; "
               "times: the median over rounds of the median block, ratio: the median of the "
               f"rounds' ratios; infer between: medians of {args.repeat} inferences each "
               "right after a training step (its ratio a round's two medians'); after idle: "
               "right after a C loop as long as the framework's training step that touches "
               "no memory and calls nothing (benchmarks/idle_loop.py)")
    setting += f"; load average before: {os.getloadavg()[0]:.2f}"
    print(setting)
    print(f"{'net (batch)':<22} {'':<13} {'minigraph ms':>12} {'pytorch ms':>11} {'ratio':>6} "
          f"{'per round':>11} {'target':>7}")
    rows, table, steady, notes = {}, [], [], []
    for net in args.nets:
        mine, theirs, ratios, per_round, waited = timed_rounds(net, args)
        n, chw = NETS[net]
        name = label = f"{net} ({n}x{'x'.join(map(str, chw))})"
        for what in TIMED:
            target = TARGETS[what]
            r = statistics.median(ratios[what])         # the rounds' paired ratios
            verdict = "ok" if r <= target else "MISSED"
            print(f"{label:<22} {what:<13} {mine[what]:>12.2f} {theirs[what]:>11.2f} "
                  f"{r:>6.2f} {spread(ratios[what]):>11} {'<= ' + str(target):>7} {verdict}")
            table.append((name, what, f"{mine[what]:.2f}", f"{theirs[what]:.2f}", f"{r:.2f}",
                          spread(ratios[what]), f"<= {target} {verdict}"))
            label = ""
        row = steady_row(per_round)
        print(f"{'':<22} (inference between / alone, after an idle loop / alone, between / "
              f"after the idle loop; between - alone, ms: minigraph {', '.join(row[0:4])}; "
              f"pytorch {', '.join(row[4:8])}; {row[8]})")
        steady.append((name, *row))
        unoptimised = (f"(infer, unoptimised net: {mine['infer (net)']:.2f} ms; ops run: train "
                       f"{mine['ops']['train']}, infer {mine['ops']['infer']}; CPU time of the "
                       f"waiting process during the other's turns, most in a round: "
                       f"{'unknown' if waited is None else f'{waited:.1f} ms'})")
        print(f"{'':<22} {unoptimised}")
        notes.append(f"{net}: {unoptimised[1:-1]}")
        if args.profile:
            for line in profile_lines(net, worker_result("minigraph", net, "profile", args),
                                      worker_result("pytorch", net, "profile", args)):
                print(f"{'':<22} ({line})")
        rows[net] = (mine, theirs)
    if args.times_only:
        return rows, markdown(setting, table, steady, notes)
    if "resnet" in rows:
        line = against_pytorch(args.threads, rows["resnet"][1])
        print(f"{'':<22} ({line})")
        notes.append("ResNet: " + line)
    print()
    for net in args.nets:
        o = worker_result("minigraph", net, "overhead", args)
        line = (f"time outside kernels, {net} train step: {o['overhead_us']:.1f} us per op "
                f"over {o['ops']} ops (the journal, feeds, fetches and freeing memory "
                "included; the executor's own target is executor_cpu.py's)")
        print(line)
        notes.append(line)
    t = worker_result("minigraph", "digits", "tiny", args)
    line = (f"executor overhead, 100 relus on (2, 3) via net.infer: {t['tiny_run_us']:.1f} us "
            f"per op, {t['tiny_kernel_us']:.1f} us in the kernel, overhead "
            f"{t['tiny_run_us'] - t['tiny_kernel_us']:.1f} us per op (target <= 10)")
    print(line)
    notes.append(line)
    print()
    for net in args.nets:
        runs = [(worker_result("minigraph", net, "memory", args),
                 worker_result("pytorch", net, "memory", args)) for _ in range(args.rounds)]
        mine, theirs = ([r[i]["peak_mb"] for r in runs] for i in (0, 1))
        m, p = statistics.median(mine), statistics.median(theirs)
        line = (f"peak memory of a {net} training step (RSS above model, optimizer state and "
                f"batch; median over {args.rounds} rounds): minigraph {m:.2f} MiB "
                f"({min(mine):.2f}-{max(mine):.2f}; tracemalloc "
                f"{runs[0][0]['tracemalloc_mb']:.2f} MiB), pytorch {p:.2f} MiB "
                f"({min(theirs):.2f}-{max(theirs):.2f}) {'ok' if m <= p else 'MISSED'}")
        print(line)
        notes.append(line)
    return rows, markdown(setting, table, steady, notes)


def markdown(setting, table, steady, notes):
    """The section of docs/performance.md: the machine, the setting, the tables, the
    notes."""
    from report import machine_line, markdown_table

    header = ("net (batch)", "step", "minigraph ms", "PyTorch ms", "ratio",
              "ratio per round", "target")
    header2 = ("net (batch)", "minigraph: between / alone", "minigraph: after idle / alone",
               "minigraph: between / after idle", "minigraph: between - alone, ms",
               "PyTorch: between / alone", "PyTorch: after idle / alone",
               "PyTorch: between / after idle", "PyTorch: between - alone, ms",
               "target (between / alone)")
    return "\n\n".join([machine_line(setting[0].upper() + setting[1:] + "."),
                         markdown_table(header, table), markdown_table(header2, steady),
                         "\n".join(f"- {note}" for note in notes)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=30, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed steps first (minigraph measures threads per op in "
                             "its first 17: minigraph.op_threads)")
    parser.add_argument("--mem-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7,
                        help="fresh minigraph and PyTorch processes per timing, alternated")
    parser.add_argument("--slices", type=int, default=5,
                        help="blocks per round that the two processes take in turn "
                             "(--repeat steps in all)")
    parser.add_argument("--block", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--nets", nargs="+", choices=sorted(NETS), default=list(NETS))
    parser.add_argument("--times-only", action="store_true",
                        help="time the steps only: no overhead or memory measurements")
    parser.add_argument("--profile", action="store_true",
                        help="also print each framework's costliest op types per step "
                             "and minigraph's kernel choices (processes of their own, "
                             "after each net's rounds; not written)")
    parser.add_argument("--no-write", action="store_true",
                        help="print the table only; do not replace the 'nets_cpu' section "
                             "of docs/performance.md")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--net", choices=sorted(NETS), help=argparse.SUPPRESS)
    parser.add_argument("--what", choices=("time", "overhead", "tiny", "memory", "profile"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        _, section = report(args)
        from report import write_section

        write_section("nets_cpu", section, enabled=not args.no_write)
        return
    if args.worker == "minigraph":
        result = mg_worker(args)
    else:
        from nets_torch import torch_worker

        result = torch_worker(args)
    if result is not None:              # a "time" worker has served its answers instead
        print(json.dumps(result))


if __name__ == "__main__":
    main()
