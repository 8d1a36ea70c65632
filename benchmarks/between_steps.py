"""Why an inference slows down between training steps, measured again on each run:
the wide MLP's optimized inference net (all native fused_fc products) alone, right
after a training step, after a training step and a 150 ms pause, after writing 256
MiB of memory (no computation, no threads: caches emptied) and after a Python loop
that reads the clock for as long as a training step takes (no memory traffic, no
threads), with the CPU time every thread of the process spent meanwhile; the same
for the CNNs of --nets. Then the machine without minigraph: how long a few tiny
pieces of work, and a C product of 0.1-0.2 ms that times itself (its data read in
order), take right after themselves, after a Python loop of 1, 4 and 16 ms,
after 4 ms of a C loop that touches no memory (a register count and the clock, built
with the C compiler native kernels use; the column is left out without one) and after
sleeping 4 ms; and how often the machine takes the CPU from a loop that only reads
the clock (the hypervisor's or the kernel's interruptions), with what each costs a
chain of dependent loads from scattered memory that the CPU touched before the loop.

    python benchmarks/between_steps.py [--threads 2] [--rounds 15]
                                       [--nets mlp mnist digits recipe] [--no-write]

Each mode runs in a fresh process (this script with --worker): minigraph as it is
(OpenBLAS's parallel work on minigraph's own pool: kernels/cpu/blas_threads.py),
with MINIGRAPH_BLAS_POOL=0 (OpenBLAS's own worker threads, as before that pool),
the same with OPENBLAS_THREAD_TIMEOUT=4 (OpenBLAS's workers sleep as soon as a
call ends instead of spinning for 2^28 cycles), and with MINIGRAPH_NATIVE=0 (every
kernel on numpy; the inference's products on BLAS too); the other nets run as
minigraph is (their inference nets' convolutions, pools and products native). In
each, the threads
OpenBLAS started when numpy loaded are noted before minigraph is imported; then
--rounds rounds each time 10 inferences of every case, the cases in turn (so that a
drift of the machine's speed slows them alike): 5 timed, then 5 with the CPU time
of every thread read around them (reading /proc is work of its own, which would
slow a small net's inference). A thread's CPU time is the first field of
/proc/self/task/<tid>/schedstat (nanoseconds; Linux; it is brought up to date at
the kernel's ticks and switches, so a short inference may count some of what ran
before it, and a thread that spins through it may count none), its time ready but
waiting for a CPU the second. The table: the median wall time of an inference, and
the median CPU time of OpenBLAS's own workers, of the calling thread and of every
other thread (the native kernels' pools) during one, and the time all of them
waited for a CPU (where a spinning thread holds a core another needs). The machine's
tables come from a process that imports numpy only (--probe). It prints the tables
and writes them into the `between_steps` section of docs/performance.md; --no-write
only prints.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from idle_loop import SPIN_C, build_c  # noqa: E402

MODES = {"minigraph": {}, "MINIGRAPH_BLAS_POOL=0": {"MINIGRAPH_BLAS_POOL": "0"},
         "MINIGRAPH_BLAS_POOL=0 OPENBLAS_THREAD_TIMEOUT=4": {
             "MINIGRAPH_BLAS_POOL": "0", "OPENBLAS_THREAD_TIMEOUT": "4"},
         "MINIGRAPH_NATIVE=0": {"MINIGRAPH_NATIVE": "0"}}
CASES = ("alone", "after a training step", "after a step and 150 ms",
         "after writing 256 MiB", "after Python as long as a step")
PROBE_WAITS_MS = (0, 1, 4, 16)  # the Python loop before each piece of the machine's table
PROBE_OTHER_MS = 4              # the C loop's and the sleep's
PRODUCT_C = r"""
/* A product of 64x256 by 256x128 floats (224 KiB in all, read in order): work of
   0.1-0.2 ms whose data streams in, timed by itself (no Python around it; now_ns
   comes from idle_loop.SPIN_C, built before it). */
enum { PM = 64, PK = 256, PN = 128 };
float probe_a[PM * PK], probe_b[PK * PN], probe_c[PM * PN];  /* not static: kept */
void product_init(void)
{
    for (int i = 0; i < PM * PK; i++) probe_a[i] = (float)(i % 7);
    for (int i = 0; i < PK * PN; i++) probe_b[i] = (float)(i % 5);
}
uint64_t product_ns(void)
{
    uint64_t start = now_ns();
    for (int i = 0; i < PM; i++) {
        float *c = probe_c + i * PN;
        for (int j = 0; j < PN; j++) c[j] = 0.0f;
        for (int k = 0; k < PK; k++) {
            float a = probe_a[i * PK + k];
            const float *b = probe_b + k * PN;
            for (int j = 0; j < PN; j++) c[j] += a * b[j];
        }
    }
    return now_ns() - start;
}
"""
INTERRUPT_C = r"""
/* The machine's interruptions: for `ns`, read the clock and count each jump of at
   least `gap_ns` between two readings (the CPU was taken: an interrupt, the
   hypervisor, another task), their lengths into `lengths` (at most `cap`). */
uint64_t gaps_ns(uint64_t ns, uint64_t gap_ns, uint64_t *lengths, uint64_t cap)
{
    uint64_t start = now_ns(), prev = start, count = 0;
    for (;;) {
        uint64_t t = now_ns();
        if (t - prev >= gap_ns) {
            if (count < cap) lengths[count] = t - prev;
            count++;
        }
        prev = t;
        if (t - start >= ns) return count;
    }
}
/* 512 pointers a page and a line apart (so each has its own page and cache set),
   linked in a shuffled cycle: dependent loads from scattered memory, as an
   interpreter's. chain_ns() follows the cycle once and returns its time. */
enum { CHAIN_LINES = 512, CHAIN_STRIDE = 4096 + 64 };
char chain_mem[CHAIN_LINES * CHAIN_STRIDE];     /* not static: the tests follow it */
void chain_init(void)
{
    int order[CHAIN_LINES];
    uint32_t seed = 12345;
    for (int i = 0; i < CHAIN_LINES; i++) order[i] = i;
    for (int i = CHAIN_LINES - 1; i > 0; i--) {
        seed = seed * 1664525u + 1013904223u;
        int j = (int)((seed >> 8) % (uint32_t)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (int i = 0; i < CHAIN_LINES; i++)
        *(char **)(chain_mem + order[i] * CHAIN_STRIDE) =
            chain_mem + order[(i + 1) % CHAIN_LINES] * CHAIN_STRIDE;
}
uint64_t chain_ns(void)
{
    char *p = chain_mem;
    uint64_t start = now_ns();
    __asm__ volatile("" : "+r"(p) : : "memory");    /* the loads stay between the reads */
    for (int i = 0; i < CHAIN_LINES; i++) p = *(char **)p;
    __asm__ volatile("" : "+r"(p) : : "memory");
    return now_ns() - start;
}
"""
PROBE_RUNS = 60
GAP_NS = 3000                  # a jump of the clock this long: the CPU was taken
GAP_SECONDS = 2.0              # how long the interruptions are counted
CHAIN_WAIT_NS = 500_000        # the loop before each walk of the chain
CHAIN_RUNS = 600
FLUSH_FLOATS = 64 << 20        # 256 MiB written between inferences: caches emptied


def thread_cpu_ns():
    """{tid: (nanoseconds on a CPU, nanoseconds ready but waiting for one)} of every
    thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited = f.read().split()[:2]
            out[int(tid)] = (int(ran), int(waited))
        except (OSError, ValueError):
            pass
    return out


def worker(args):
    import numpy  # (OpenBLAS starts its workers as numpy loads)

    blas = set(thread_cpu_ns()) - {os.getpid()}
    from nets_models import batch, mg_net, mg_optimized
    from timing import median_ms

    import minigraph as mg

    mg.set_num_threads(args.threads)
    net, _, logits, loss = mg_net(args.net)
    x, y = batch(args.net)
    feed = {"image": x, "label": y}

    def step():
        net.train(feed=feed, fetch=[loss])

    for _ in range(20):                 # past the steps that measure threads per op
        step()
    step_seconds = median_ms(step, 10, warmup=0) / 1e3
    fast, name = mg_optimized(net), logits.name

    def infer():
        fast.infer(feed={"image": x}, fetch=[name])

    for _ in range(3):
        infer()
    flush = numpy.ones(FLUSH_FLOATS, numpy.float32)
    before = {"alone": lambda: None, "after a training step": step,
              "after a step and 150 ms": lambda: (step(), time.sleep(0.15)),
              "after writing 256 MiB": lambda: flush.fill(1.0),
              "after Python as long as a step": lambda: busy(step_seconds)}
    walls, cpus = {case: [] for case in CASES}, {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            for _ in range(5):              # wall time: nothing else around the inference
                before[case]()
                t0 = time.perf_counter()
                infer()
                walls[case].append((time.perf_counter() - t0) * 1e3)
            for _ in range(5):              # CPU times: reading them is work of its own
                before[case]()
                c0 = thread_cpu_ns()
                infer()
                c1 = thread_cpu_ns()
                spent = {t: (c1[t][0] - c0.get(t, (0, 0))[0]) / 1e6 for t in c1}
                waited = sum(c1[t][1] - c0.get(t, (0, 0))[1] for t in c1) / 1e6
                cpus[case].append((sum(v for t, v in spent.items() if t in blas),
                                   spent.get(os.getpid(), 0.0),
                                   sum(v for t, v in spent.items()
                                       if t not in blas and t != os.getpid()), waited))
    return {case: [statistics.median(walls[case])]
            + [statistics.median(r[i] for r in cpus[case]) for i in range(4)]
            for case in CASES}


def timed(fn):
    """fn()'s wall time in seconds, or the time it returns (work that times itself)."""
    t0 = time.perf_counter()
    own = fn()
    return time.perf_counter() - t0 if own is None else own


def probe():
    """The machine without minigraph: {"columns": the befores, "rows": {piece of work:
    [median us right after itself, then after each before]}, "interruptions":
    interruptions(), or None without a C compiler}."""
    import numpy

    small, src = numpy.ones(1, numpy.float32), numpy.ones(16 << 10, numpy.float32)
    small_out, out = numpy.empty_like(small), numpy.empty_like(src)

    def python_loop():
        total = 0
        for i in range(200):
            total += i

    work = {"numpy copy of 4 bytes": lambda: numpy.copyto(small_out, small),
            "numpy copy of 64 KiB": lambda: numpy.copyto(out, src),
            "Python loop of 200 additions": python_loop}
    with tempfile.TemporaryDirectory() as tmp:
        lib = c_probes(tmp)
        befores = {f"python {wait}": (lambda wait=wait: busy(wait / 1e3))
                   for wait in PROBE_WAITS_MS[1:]}
        if lib is not None:
            lib.product_init()
            work["C product of 224 KiB, its own time"] = lambda: lib.product_ns() / 1e9
            befores["c"] = lambda: lib.spin_ns(PROBE_OTHER_MS * 1_000_000)
        befores["sleep"] = lambda: time.sleep(PROBE_OTHER_MS / 1e3)
        taken = interruptions(lib) if lib is not None else None
        times = {(name, before): [] for name in work for before in ("itself", *befores)}
        for _ in range(PROBE_RUNS):     # every case in turn: a drift slows them alike
            for (name, before), runs in times.items():
                befores.get(before, work[name])()   # "itself": the same work right before
                runs.append(timed(work[name]) * 1e6)
    return {"columns": ["itself", *befores], "interruptions": taken,
            "rows": {name: [statistics.median(times[name, before])
                            for before in ("itself", *befores)] for name in work}}


def interruptions(lib):
    """How often and how long the machine takes the CPU from a loop that only reads the
    clock, and what that costs scattered loads: {"per second", "median us", "p90 us",
    "share" (of the time), "chain": [its walk's median us right after itself, then
    after CHAIN_WAIT_NS of the clock loop in which the CPU was taken 0 times, 1 time,
    2 or more times (None where no loop had that many)]}."""
    cap = 1 << 20
    lengths = (ctypes.c_uint64 * cap)()
    count = lib.gaps_ns(int(GAP_SECONDS * 1e9), GAP_NS, lengths, cap)
    taken = sorted(lengths[:min(count, cap)]) or [0]
    lib.chain_init()
    walks = {"itself": [], 0: [], 1: [], 2: []}
    for _ in range(CHAIN_RUNS):
        lib.chain_ns()
        walks["itself"].append(lib.chain_ns())
        gaps = lib.gaps_ns(CHAIN_WAIT_NS, GAP_NS, lengths, cap)
        walks[min(gaps, 2)].append(lib.chain_ns())
    return {"per second": count / GAP_SECONDS, "median us": statistics.median(taken) / 1e3,
            "p90 us": taken[int(0.9 * (len(taken) - 1))] / 1e3,
            "share": sum(taken) / (GAP_SECONDS * 1e9),
            "chain": [statistics.median(runs) / 1e3 if runs else None
                      for runs in walks.values()]}


def c_probes(tmp):
    """idle_loop.SPIN_C, PRODUCT_C and INTERRUPT_C built in the directory `tmp` and
    loaded (spin_ns(ns), product_init(), product_ns(), gaps_ns(ns, gap_ns, lengths,
    cap), chain_init(), chain_ns()), or None without a C compiler or where the build
    fails (idle_loop.build_c)."""
    lib = build_c(SPIN_C + PRODUCT_C + INTERRUPT_C, tmp)
    if lib is not None:
        lib.product_ns.argtypes, lib.product_ns.restype = [], ctypes.c_uint64
        lib.product_init.argtypes, lib.product_init.restype = [], None
        lib.gaps_ns.argtypes = [ctypes.c_uint64, ctypes.c_uint64,
                                ctypes.POINTER(ctypes.c_uint64), ctypes.c_uint64]
        lib.gaps_ns.restype = ctypes.c_uint64
        lib.chain_init.argtypes, lib.chain_init.restype = [], None
        lib.chain_ns.argtypes, lib.chain_ns.restype = [], ctypes.c_uint64
    return lib


def busy(seconds):
    """Run Python for `seconds`, reading the clock: no memory traffic, no other thread."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--nets", nargs="+", default=["mlp", "mnist", "digits", "recipe"],
                        choices=("mlp", "digits", "mnist", "recipe", "resnet"))
    parser.add_argument("--net", default="mlp", help=argparse.SUPPRESS)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker or args.probe:
        print(json.dumps(probe() if args.probe else worker(args)))
        return
    from report import machine_line, markdown_table, write_section

    header = ("net", "mode", "inference", "wall ms", "OpenBLAS's workers, CPU ms",
              "calling thread, CPU ms", "other threads, CPU ms",
              "all threads waiting for a CPU, ms")
    rows = []
    load = os.getloadavg()[0]
    print(f"load average before: {load:.2f}")
    for net in args.nets:
        for mode, env in MODES.items() if net == "mlp" else [("minigraph", {})]:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--threads",
                   str(args.threads), "--rounds", str(args.rounds), "--net", net]
            done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True,
                                  text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            for case in CASES:
                rows.append((net, mode, case, *(f"{v:.2f}" for v in result[case])))
                print(" | ".join(rows[-1]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe"],
                          capture_output=True, text=True, check=True)
    probed = json.loads(done.stdout.strip().splitlines()[-1])
    titles = {"itself": "right after itself, us",
              **{f"python {w}": f"after {w} ms of Python, us" for w in PROBE_WAITS_MS[1:]},
              "c": f"after {PROBE_OTHER_MS} ms of a C loop, us",
              "sleep": f"after sleeping {PROBE_OTHER_MS} ms, us"}
    probe_rows = [(name, *(f"{v:.1f}" for v in times))
                  for name, times in probed["rows"].items()]
    for row in probe_rows:
        print(" | ".join(row))
    taken = probed["interruptions"]
    taken_rows = [] if taken is None else [(
        f"{taken['per second']:.0f}", f"{taken['median us']:.1f}", f"{taken['p90 us']:.1f}",
        f"{100 * taken['share']:.2f} %",
        *("-" if v is None else f"{v:.2f}" for v in taken["chain"]))]
    taken_header = (f"taken for {GAP_NS / 1e3:.0f} us or more, per second", "median us",
                    "90th percentile us", "share of the time",
                    "chain right after itself, us",
                    *(f"chain after {CHAIN_WAIT_NS / 1e6:g} ms taken {n}, us"
                      for n in ("0 times", "once", "2 or more times")))
    for row in taken_rows:
        print(" | ".join(row))
    text = "\n\n".join([machine_line(
        f"The optimized inference nets of nets_cpu.py ({', '.join(args.nets)}), "
        f"{args.threads} threads, each net and mode in its own process; medians over "
        f"{args.rounds} rounds of 5 timed inferences and 5 with CPU times per case, the cases "
        f"in turn; CPU time per thread from /proc/self/task/*/schedstat; load average "
        f"{load:.2f} before."),
        markdown_table(header, rows),
        f"The machine alone (a process with numpy and no minigraph): medians of "
        f"{PROBE_RUNS} runs of each piece of work (wall time; the C product's own time, "
        "without the Python call around it), each right after the same work, a "
        "Python loop that reads the clock for the time given, a C loop that counts in a "
        "register between readings of the clock (no memory touched) or a sleep, the "
        "cases in turn:",
        markdown_table(("work", *(titles[c] for c in probed["columns"])), probe_rows),
        *([] if taken is None else [
            f"How often the machine takes the CPU from a C loop that only reads the clock "
            f"({GAP_SECONDS:g} s; a jump of {GAP_NS / 1e3:g} us or more between two readings "
            f"counts), and a walk of a chain of 512 pointers a page apart in shuffled order "
            f"(dependent loads from scattered memory), medians of {CHAIN_RUNS}: right after "
            f"itself, and after {CHAIN_WAIT_NS / 1e6:g} ms of that loop by how often the CPU "
            f"was taken during it:",
            markdown_table(taken_header, taken_rows)])])
    write_section("between_steps", text, enabled=not args.no_write)


if __name__ == "__main__":
    main()
