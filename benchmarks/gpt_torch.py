"""The GPT of minigraph.examples.train_gpt against PyTorch: equal in float64, and timed.

    python benchmarks/gpt_torch.py [--check] [--quick] [--rounds 7] [--no-write]

- equality (--check runs only this, and exits 1 when it fails): the same GPT (4 layers,
  4 heads, 128 dims; context 64, 4 windows of pydoc_data.topics a step, no dropout) and
  recipe (AdamW in parameter groups, warm-up then cosine, clipping by global norm,
  accumulation over 2 steps) from the same initial weights and batches in float64,
  20 steps: every loss equal to 1e-6 relative (PyTorch's attention: the math path).
- training step: float32, the example's recipe (dropout 0.1), 16 windows, at context 64
  and 256: the median over --repeat accumulation cycles (2 steps, the second updating
  the parameters) of a cycle's time per step, after warm-up in whole cycles; --rounds
  rounds of both frameworks in fresh processes back to back (minigraph first in even
  rounds): times are medians over rounds, the ratio the median of the rounds' ratios.
- the attention op alone: causal forward + backward on (N, 4 heads, T, 32) at T = 128
  (N 16), 512 (N 4) and 2048 (N 1): time, and the peak resident memory above the inputs
  (VmHWM, in a fresh process), against PyTorch's math path.
- generation (minigraph alone): 256 new tokens after a 16-token prompt, one token a
  pass with the KV cache against a full pass per token without it; --rounds runs each
  way in a process, the order alternating, in --gen-processes fresh processes (3): the
  medians over every round, and the median of the rounds' ratios.

Each framework runs in a process of its own (this script with --worker), 2 threads by
default. The table is printed and written into the `gpt_torch` section of
docs/performance.md (--no-write: print only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
from timing import median_ms

EQUAL_STEPS, EQUAL_RTOL = 20, 1e-6
CONTEXTS = (64, 256)
ATTENTION = ((128, 16), (512, 4), (2048, 1))      # (T, N); 4 heads of 32
PROMPT, NEW_TOKENS = 16, 256


def config(what, context=64):
    from minigraph.examples.train_gpt import Config

    if what == "equal":
        return Config(context=64, batch_size=4, dropout=0.0, warmup=3)
    return Config(context=context, batch_size=16)


def text_batches(cfg, count, seed=0):
    """`count` batches (tokens, targets) of cfg.batch_size windows of the text."""
    from minigraph.examples import train_gpt as G

    text = G.load_text()
    vocab = G.Vocab(text)
    ids = vocab.encode(text)
    g = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        starts = g.integers(0, len(ids) - cfg.context - 1, cfg.batch_size)
        w = ids[starts[:, None] + np.arange(cfg.context + 1)]
        out.append((w[:, :-1].copy(), w[:, 1:].copy()))
    return out, len(vocab)


def initial_weights(cfg, vocab, path):
    """The minigraph net's initial parameters, saved to `path` (.npz) for both workers."""
    from minigraph.examples import train_gpt as G

    net, _ = G.build_gpt(vocab, cfg, dtype="float64")
    np.savez(path, **{p.name: p.get() for p in net.parameters()})


# ---- minigraph ---------------------------------------------------------------------------

def mg_net(cfg, vocab, weights, dtype, updates):
    from minigraph.examples import train_gpt as G

    net, h = G.build_gpt(vocab, cfg, dtype=dtype)
    for name, value in weights.items():
        net.var(name).set(value.astype(dtype))
    G.make_optimizer(cfg, updates).minimize(net, h["loss"],
                                            parameters=G.param_groups(net, cfg.weight_decay))
    return net, h


def mg_losses(args, cfg, weights, batches, vocab):
    import minigraph as mg

    mg.set_num_threads(args.threads)
    net, h = mg_net(cfg, vocab, weights, "float64", len(batches) // cfg.accumulate)
    return {"losses": [float(net.train(feed={"tokens": t, "targets": y},
                                       fetch=[h["loss"]])[0]) for t, y in batches]}


def mg_step_time(args, cfg, weights, batch, vocab):
    import minigraph as mg

    mg.set_num_threads(args.threads)
    net, h = mg_net(cfg, vocab, weights, "float32", 1000)
    feed = {"tokens": batch[0], "targets": batch[1]}
    return {"train": median_ms(lambda: net.train(feed=feed, fetch=[h["loss"]]), args.repeat,
                               args.warmup, cycle=cfg.accumulate)}


def mg_attention(args, shape):
    """The op and its grad op through an Executor: time, or the peak memory above the
    inputs."""
    from peak_memory import rss_peak

    import minigraph as mg

    mg.set_num_threads(args.threads)
    g = np.random.default_rng(0)
    scope = mg.Scope()
    v = {s: scope.new_var(s) for s in ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv")}
    for s in ("q", "k", "v", "dout"):
        v[s].set(g.standard_normal(shape, dtype=np.float32))
    attrs = {"is_causal": True}
    ops = [mg.Operator("scaled_dot_product_attention", q=v["q"], k=v["k"], v=v["v"],
                       out=v["out"], lse=v["lse"], **attrs),
           mg.Operator("scaled_dot_product_attention_grad", q=v["q"], k=v["k"], v=v["v"],
                       out=v["out"], lse=v["lse"], dout=v["dout"], dq=v["dq"], dk=v["dk"],
                       dv=v["dv"], **attrs)]
    ex = mg.Executor()

    def run():
        for s in ("out", "lse", "dq", "dk", "dv"):
            v[s].value = None
        ex.run(ops, scope)

    if args.what == "memory":
        run()
        for s in ("out", "lse", "dq", "dk", "dv"):
            v[s].value = None
        return {"peak_mb": rss_peak(run, 1)}
    return {"ms": median_ms(run, args.repeat, args.warmup)}


def mg_generation(args):
    """ms per new token with the cache and without (a full pass per token): --rounds
    rounds of one generation each way, the order alternating ({"cached": [ms a round],
    "uncached": [...]})."""
    import time

    import minigraph as mg
    from minigraph import layers
    from minigraph.examples import train_gpt as G
    from minigraph.generation import generate

    mg.set_num_threads(args.threads)
    cfg = G.Config(context=PROMPT + NEW_TOKENS)
    cache = layers.KVCache(cfg.context)
    net, h = G.build_gpt(97, cfg, cache=cache)
    prompt = np.random.default_rng(0).integers(0, 97, (1, PROMPT))
    new = args.new_tokens
    times = {"cached": [], "uncached": []}
    for use in (True, False):
        generate(net, h["tokens"], h["logits"], prompt, 4, kv_cache=cache, use_cache=use)
    for r in range(args.rounds):
        for name in (("cached", "uncached") if r % 2 == 0 else ("uncached", "cached")):
            start = time.perf_counter()
            generate(net, h["tokens"], h["logits"], prompt, new, kv_cache=cache,
                     use_cache=name == "cached")
            times[name].append((time.perf_counter() - start) * 1e3 / new)
    return times


# ---- the workers and the driver ------------------------------------------------------------

def worker(args):
    side = __import__("gpt_torch_side") if args.worker == "pytorch" else None
    weights = {}
    if args.weights:
        with np.load(args.weights) as f:
            weights = dict(f)
    if args.job == "equal":
        cfg = config("equal")
        batches, vocab = text_batches(cfg, EQUAL_STEPS)
        fn = side.torch_losses if side else mg_losses
        return fn(args, cfg, weights, batches, vocab)
    if args.job == "step":
        cfg = config("step", args.context)
        batches, vocab = text_batches(cfg, 1)
        fn = side.torch_step_time if side else mg_step_time
        return fn(args, cfg, weights, batches[0], vocab)
    if args.job == "attention":
        t, n = args.context, args.batch
        fn = side.torch_attention if side else mg_attention
        return fn(args, (n, 4, t, 32))
    return mg_generation(args)


def run_worker(framework, job, args, weights="", context=0, batch=0, what="time"):
    env = dict(os.environ)
    if what == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--job", job,
           "--weights", weights, "--context", str(context), "--batch", str(batch),
           "--what", what, "--threads", str(args.threads), "--repeat", str(args.repeat),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds),
           "--new-tokens", str(args.new_tokens)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{framework} {job} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def weights_file(tmp, cfg):
    _, vocab = text_batches(cfg, 0)
    path = os.path.join(tmp, f"weights_{cfg.context}.npz")
    if not os.path.exists(path):
        initial_weights(cfg, vocab, path)
    return path


def equality(args, tmp):
    """(worst relative difference, minigraph's losses, PyTorch's)."""
    path = weights_file(tmp, config("equal"))
    ours = run_worker("minigraph", "equal", args, path)["losses"]
    theirs = run_worker("pytorch", "equal", args, path)["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    return worst, ours, theirs


def alternating(args, job, paths, **kw):
    rounds = []
    for i in range(args.rounds):
        order = ("minigraph", "pytorch") if i % 2 == 0 else ("pytorch", "minigraph")
        got = {fw: run_worker(fw, job, args, paths, **kw) for fw in order}
        rounds.append((got["minigraph"], got["pytorch"]))
    return rounds


def report(args):
    from report import machine_line, markdown_table

    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        worst, ours, theirs = equality(args, tmp)
        verdict = "ok" if worst <= EQUAL_RTOL else "MISSED"
        line = (f"float64, {EQUAL_STEPS} steps (context 64, 4 windows, accumulation 2, "
                f"clipping, warm-up + cosine): largest loss difference {worst:.1e} relative "
                f"(losses {ours[0]:.4f} -> {ours[-1]:.4f}) <= {EQUAL_RTOL} {verdict}")
        print(line, flush=True)
        notes.append(line)
        if args.check:
            return worst <= EQUAL_RTOL, None
        for context in args.contexts if "step" in args.parts else ():
            path = weights_file(tmp, config("step", context))
            rounds = alternating(args, "step", path, context=context)
            mine = statistics.median(m["train"] for m, _ in rounds)
            peer = statistics.median(p["train"] for _, p in rounds)
            ratios = [m["train"] / p["train"] for m, p in rounds]
            r = statistics.median(ratios)
            rows.append((f"training step, context {context} (16 windows)", f"{mine:.1f}",
                         f"{peer:.1f}", f"{r:.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
                         f"<= 1.0 {'ok' if r <= 1.0 else 'MISSED'}"))
            print(" | ".join(rows[-1]), flush=True)
        for t, n in args.attention if "attention" in args.parts else ():
            rounds = alternating(args, "attention", "", context=t, batch=n)
            mine = statistics.median(m["ms"] for m, _ in rounds)
            peer = statistics.median(p["ms"] for _, p in rounds)
            r = statistics.median(m["ms"] / p["ms"] for m, p in rounds)
            mem = [(run_worker("minigraph", "attention", args, "", t, n, "memory")["peak_mb"],
                    run_worker("pytorch", "attention", args, "", t, n, "memory")["peak_mb"])
                   for _ in range(max(1, args.rounds // 2))]
            mm, pm = (statistics.median(x[i] for x in mem) for i in (0, 1))
            target = "<= 1.0, memory below" if t == 2048 else ""
            met = r <= 1.0 and mm < pm
            rows.append((f"attention fwd+bwd, T={t} ({n}x4 heads x 32, causal)",
                         f"{mine:.2f}", f"{peer:.2f}", f"{r:.2f}",
                         f"peak MiB {mm:.1f} vs {pm:.1f}",
                         f"{target} {'ok' if met else 'MISSED'}" if target else ""))
            print(" | ".join(rows[-1]), flush=True)
        if "generation" in args.parts:
            line = generation_line(args)
            print(line, flush=True)
            notes.append(line)
    setting = (f"{args.threads} threads per framework, each in its own process; step times: "
               f"medians of {args.repeat} accumulation cycles of {config('step').accumulate} "
               "steps (a cycle's time per "
               f"step) after {args.warmup} steps or more (whole cycles), the attention's of "
               f"{args.repeat} calls; over {args.rounds} "
               "alternating rounds; ratio: the median of the rounds' ratios")
    table = markdown_table(("measurement", "minigraph ms", "PyTorch ms", "ratio",
                            "per round / memory", "target"), rows)
    return True, "\n\n".join([machine_line(setting + "."), table,
                              "\n".join(f"- {n}" for n in notes)])


def generation_line(args):
    """Cached against uncached generation in --gen-processes fresh processes of --rounds
    alternating rounds each (a process's speed on this kind of pass varies by more than
    its rounds do): medians over every round, the ratio the median of the rounds'
    ratios, with each process's."""
    runs = [run_worker("minigraph", "generation", args) for _ in range(args.gen_processes)]
    ratios = [[u / c for c, u in zip(r["cached"], r["uncached"])] for r in runs]
    every = [x for each in ratios for x in each]
    speedup = statistics.median(every)
    cached, uncached = (statistics.median(x for r in runs for x in r[k])
                        for k in ("cached", "uncached"))
    each = "/".join(f"{statistics.median(x):.1f}" for x in ratios)
    return (f"generation, {args.new_tokens} new tokens after a {PROMPT}-token prompt (batch "
            f"1; {args.gen_processes} process{'es' if args.gen_processes != 1 else ''} of "
            f"{args.rounds} alternating runs each way): "
            f"{cached:.2f} ms a token with the KV cache, {uncached:.2f} ms with a full pass "
            f"a token: {speedup:.1f}x (per process {each}; rounds {min(every):.1f}-"
            f"{max(every):.1f}; target >= 10 {'ok' if speedup >= 10 else 'MISSED'})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="the float64 equality only; exit 1 "
                   "when a loss differs by more than 1e-6 relative")
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7,
                   help="alternating rounds of each timing (default 7, as nets_cpu.py's)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--gen-processes", type=int, default=3,
                   help="fresh processes the generation is timed in (default 3)")
    p.add_argument("--parts", nargs="+", choices=("step", "attention", "generation"),
                   default=["step", "attention", "generation"],
                   help="what to measure after the equality check (default: all; a run "
                        "with fewer does not write docs/performance.md)")
    p.add_argument("--no-write", action="store_true",
                   help="print only; do not replace the 'gpt_torch' section of "
                        "docs/performance.md")
    p.add_argument("--worker", choices=("minigraph", "pytorch"), help=argparse.SUPPRESS)
    p.add_argument("--job", choices=("equal", "step", "attention", "generation"),
                   help=argparse.SUPPRESS)
    p.add_argument("--weights", default="", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--what", choices=("time", "memory"), default="time", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    args.contexts, args.attention = CONTEXTS, ATTENTION
    if args.quick:
        args.rounds, args.repeat, args.warmup, args.new_tokens = 1, 2, 1, 32
        args.gen_processes = 1
        args.attention = ((128, 2), (512, 1))
    ok, section = report(args)
    if section is not None:
        from report import write_section

        whole = len(args.parts) == 3
        write_section("gpt_torch", section, enabled=not (args.no_write or args.quick) and whole)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

