"""CPU normalisations against PyTorch: time, and float64 parity.

    python benchmarks/norms_cpu.py [--threads 2] [--repeat 20] [--no-write] [--parity-only]

Time: layer_norm, group_norm (32 groups) and instance_norm, fp32, forward and
forward + backward, on (32, 64, 56, 56), and layer_norm on (64, 768): minigraph's
op and the grad op its grad maker builds through `Executor.run`, PyTorch's
F.layer_norm / F.group_norm / F.instance_norm forward and autograd backward.
Each framework runs in a fresh process of its own (this script with --worker,
results back as JSON), `--threads` threads each; times are medians after
warm-up, and --rounds rounds alternate the two frameworks' processes (the table
shows the median over rounds, and the rounds' ratios). Target: at most 1.2x
PyTorch's time on each.

Parity: the same float64 inputs (seeded, rank 2 and rank 4, a batch of one
included) through each norm, and through batch_norm with affine=False and with
track_running_stats=False in train and eval modes (torch.nn.BatchNorm2d /
BatchNorm1d with those options); the outputs and dx, dscale, dbias for a fixed
dy, computed in each framework's own process and compared: the largest
relative difference must be under 1e-4.

It prints both tables and writes them, with the machine and the date, into the
`norms_cpu` section of docs/performance.md; --no-write only prints.
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

TIMED = [("layer_norm", (64, 768)), ("layer_norm", (32, 64, 56, 56)),
         ("group_norm", (32, 64, 56, 56)), ("instance_norm", (32, 64, 56, 56))]
GROUPS = 32
# parity cases: (op, shape, options); batch_norm cases run their train then eval forward
PARITY = [("layer_norm", (6, 10), {}), ("layer_norm", (1, 3, 4, 5), {}),
          ("layer_norm", (2, 3, 4, 5), {"begin_norm_axis": 2}),
          ("group_norm", (4, 6, 5, 3), {"groups": 3}), ("group_norm", (1, 6, 4, 4), {"groups": 2}),
          ("group_norm", (5, 8), {"groups": 4}),
          ("instance_norm", (3, 4, 5, 6), {}), ("instance_norm", (1, 3, 7, 7), {}),
          ("batch_norm", (6, 3, 4, 4), {"affine": False}),
          ("batch_norm", (6, 3, 4, 4), {"track_running_stats": False}),
          ("batch_norm", (9, 5), {"affine": False, "track_running_stats": False})]


def inputs(shape, seed=0, dtype="float32"):
    """(x, dy, scale, bias) for a norm of x (scale/bias sized for `op`'s parameters)."""
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal(shape) * 2 + 1).astype(dtype),
            rng.standard_normal(shape).astype(dtype))


def param_size(op, shape, options):
    if op == "layer_norm":
        return int(np.prod(shape[options.get("begin_norm_axis", 1):]))
    return shape[1]


# ---- minigraph ---------------------------------------------------------------------------

def mg_ops(op, x, dy, options):
    """(scope, forward op, grad ops, {name: Variable}) for `op` on x with dy."""
    import minigraph as mg

    scope = mg.Scope()

    def var(name, value=None):
        v = scope.new_var(name, persistable=value is not None)
        if value is not None:
            v.set(value)
        return v

    rng = np.random.default_rng(7)
    c = param_size(op, x.shape, options)
    vs = {"x": var("x", x), "dy": var("dy", dy)}
    if op == "batch_norm":
        attrs = {k: v for k, v in options.items() if k == "is_infer"}
        ins = {"x": vs["x"]}
        if options.get("affine", True):
            ins.update(scale=var("scale", rng.uniform(0.5, 2, c).astype(x.dtype)),
                       bias=var("bias", rng.standard_normal(c).astype(x.dtype)))
        if options.get("track_running_stats", True):
            mean, variance = var("est_mean", np.zeros(c, x.dtype)), var("est_var",
                                                                        np.ones(c, x.dtype))
            ins.update(estimated_mean=mean, estimated_var=variance, saved_mean=mean,
                       saved_var=variance)
        outs = {"y": var("y"), "batch_mean": var("bm"), "batch_var": var("bv")}
        attrs["momentum"] = 0.9        # torch's 0.1: ours weights the old estimate
    else:
        ins = {"x": vs["x"], "scale": var("scale", rng.uniform(0.5, 2, c).astype(x.dtype)),
               "bias": var("bias", rng.standard_normal(c).astype(x.dtype))}
        outs = {"y": var("y"), "mean": var("mean"), "variance": var("variance")}
        attrs = {k: v for k, v in options.items() if k in ("begin_norm_axis", "groups")}
    forward = mg.Operator(op, **ins, **outs, **attrs)
    grads = {}

    def make_grad(v):
        if v.name in ("x", "scale", "bias"):
            grads[v.name] = var(f"d{v.name}")
            return grads[v.name]
        return None

    grad_ops = [mg.Operator(d.type, **d.kwargs)
                for d in forward.schema.grad(forward, {"y": vs["dy"]}, make_grad)]
    return scope, forward, grad_ops, {**ins, **outs, **{f"d{k}": g for k, g in grads.items()}}


def mg_time(op, shape, repeat, options):
    import minigraph as mg

    x, dy = inputs(shape)
    scope, forward, grad_ops, _ = mg_ops(op, x, dy, options)
    ex = mg.Executor()
    return {"forward": median_ms(lambda: ex.run([forward], scope), repeat),
            "forward+backward": median_ms(lambda: ex.run([forward, *grad_ops], scope), repeat)}


def mg_parity(op, shape, options):
    import minigraph as mg

    x, dy = inputs(shape, seed=1, dtype="float64")
    scope, forward, grad_ops, v = mg_ops(op, x, dy, options)
    wanted = ["y"] + [k for k in ("dx", "dscale", "dbias") if k in v]
    ex = mg.Executor()
    got = ex.run([forward, *grad_ops], scope, fetch=[v[k] for k in wanted])
    prefix = "train" if op == "batch_norm" else ""
    out = {f"{prefix}{k}": g.tolist() for k, g in zip(wanted, got)}
    if op == "batch_norm":            # eval on other data, with the estimates of the step
        slots = {**forward.inputs, **forward.outputs}
        infer = mg.Operator(op, **{k: u for k, u in slots.items() if u is not None},
                            **{**forward.attrs, "is_infer": True})
        v["x"].set(x * 0.5 + 2)
        (y,) = ex.run([infer], scope, fetch=[v["y"]])
        out["evaly"] = y.tolist()
    return out


# ---- PyTorch ----------------------------------------------------------------------------

def torch_fn(op, shape, options, dtype):
    """(fn(x, scale, bias) -> y, the module or None) of PyTorch's norm."""
    import torch
    import torch.nn.functional as F

    if op == "layer_norm":
        tail = shape[options.get("begin_norm_axis", 1):]
        return (lambda x, s, b: F.layer_norm(x, tail, s.reshape(tail), b.reshape(tail), 1e-5)), \
            None
    if op == "group_norm":
        groups = options.get("groups", GROUPS)
        return (lambda x, s, b: F.group_norm(x, groups, s, b, 1e-5)), None
    if op == "instance_norm":
        return (lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-5)), None
    cls = torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d
    module = cls(shape[1], affine=options.get("affine", True),
                 track_running_stats=options.get("track_running_stats", True), dtype=dtype)
    return (lambda x, s, b: module(x)), module


def torch_time(op, shape, repeat, options, threads):
    import torch

    torch.set_num_threads(threads)
    x, dy = (torch.from_numpy(a) for a in inputs(shape))
    c = param_size(op, shape, options)
    s, b = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
    x.requires_grad_()
    fn, _ = torch_fn(op, shape, options, torch.float32)

    def forward():
        with torch.no_grad():
            fn(x, s, b)

    def both():
        x.grad = s.grad = b.grad = None
        fn(x, s, b).backward(dy)

    return {"forward": median_ms(forward, repeat), "forward+backward": median_ms(both, repeat)}


def torch_parity(op, shape, options):
    import torch

    x, dy = (torch.from_numpy(a) for a in inputs(shape, seed=1, dtype="float64"))
    rng = np.random.default_rng(7)
    c = param_size(op, shape, options)
    s = torch.from_numpy(rng.uniform(0.5, 2, c)).requires_grad_()
    b = torch.from_numpy(rng.standard_normal(c)).requires_grad_()
    fn, module = torch_fn(op, shape, options, torch.float64)
    if module is not None and module.affine:
        with torch.no_grad():
            module.weight.copy_(s)
            module.bias.copy_(b)
        s, b = module.weight, module.bias
    out = {}
    modes = [("train", True), ("eval", False)] if module is not None else [("", True)]
    for mode, training in modes:
        if module is not None:
            module.train(training)
        xg = x.clone().requires_grad_()
        y = fn(xg, s, b)
        out[f"{mode}y"] = y.tolist()
        if training:
            y.backward(dy)
            out[f"{mode}dx"] = xg.grad.tolist()
            if module is None or module.affine:
                out[f"{mode}dscale"], out[f"{mode}dbias"] = s.grad.tolist(), b.grad.tolist()
        if module is not None and training:
            x, dy = x * 0.5 + 2, dy
    return out


# ---- driving ---------------------------------------------------------------------------

def worker(args):
    options = json.loads(args.options)
    shape = tuple(args.shape)
    if args.worker == "minigraph":
        import minigraph as mg

        mg.set_num_threads(args.threads)
        fn = mg_parity if args.what == "parity" else mg_time
    else:
        fn = torch_parity if args.what == "parity" else torch_time
    if args.what == "parity":
        result = fn(args.op, shape, options)
    elif args.worker == "minigraph":
        result = fn(args.op, shape, args.repeat, options)
    else:
        result = fn(args.op, shape, args.repeat, options, args.threads)
    with open(args.out, "w") as f:
        json.dump(result, f)


def run(framework, what, op, shape, options, args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--what", what,
               "--op", op, "--shape", *map(str, shape), "--options", json.dumps(options),
               "--threads", str(args.threads), "--repeat", str(args.repeat), "--out", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{framework} {op} {what} failed:\n{done.stderr}")
        with open(out) as f:
            return json.load(f)


def timing_rows(args):
    rows = []
    for op, shape in TIMED:
        options = {"groups": GROUPS} if op == "group_norm" else {}
        rounds = [(run("minigraph", "time", op, shape, options, args),
                   run("pytorch", "time", op, shape, options, args))
                  for _ in range(args.rounds)]
        for part in ("forward", "forward+backward"):
            ours = statistics.median(r[0][part] for r in rounds)
            theirs = statistics.median(r[1][part] for r in rounds)
            ratios = [r[0][part] / r[1][part] for r in rounds]
            ok = "ok" if ours / theirs <= 1.2 else "MISSED"
            rows.append([op, "x".join(map(str, shape)), part, f"{ours:.3f}", f"{theirs:.3f}",
                         f"{ours / theirs:.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
                         f"<= 1.2 {ok}"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def parity_rows(args):
    rows = []
    for op, shape, options in PARITY:
        ours = run("minigraph", "parity", op, shape, options, args)
        theirs = run("pytorch", "parity", op, shape, options, args)
        worst = {}
        for key, want in theirs.items():
            want, got = np.asarray(want), np.asarray(ours[key])
            scale = max(float(np.abs(want).max()), 1e-12)
            worst[key] = float(np.abs(got - want).max()) / scale
        label = op + "".join(f" {k}={v}" for k, v in options.items())
        top = max(worst.values())
        rows.append([label, "x".join(map(str, shape)), ", ".join(sorted(worst)), f"{top:.1e}",
                     "ok" if top < 1e-4 else "FAILED"])
        print(" | ".join(rows[-1]), flush=True)
    return rows


def markdown(timing, parity, args):
    from report import machine_line, markdown_table

    lines = [machine_line(f"{args.threads} threads per framework, each in its own process; "
                          f"medians of {args.repeat} runs, then over {args.rounds} rounds.")]
    if timing:
        lines += ["", markdown_table(["op", "shape", "pass", "minigraph ms", "PyTorch ms",
                                      "ratio", "per round", "target"], timing)]
    lines += ["", "Parity with PyTorch in float64 (largest difference relative to the largest "
              "value; batch_norm: a train step, then eval on other data):", "",
              markdown_table(["case", "shape", "compared", "largest", "< 1e-4"], parity)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parity-only", action="store_true")
    p.add_argument("--no-write", action="store_true",
                   help="print only; do not replace the 'norms_cpu' section of "
                        "docs/performance.md")
    p.add_argument("--worker", choices=("minigraph", "pytorch"), help=argparse.SUPPRESS)
    p.add_argument("--what", choices=("time", "parity"), help=argparse.SUPPRESS)
    p.add_argument("--op", help=argparse.SUPPRESS)
    p.add_argument("--shape", type=int, nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    timing = [] if args.parity_only else timing_rows(args)
    parity = parity_rows(args)
    from report import write_section

    write_section("norms_cpu", markdown(timing, parity, args),
                  enabled=not (args.no_write or args.parity_only))
    failed = [r for r in parity if r[-1] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
