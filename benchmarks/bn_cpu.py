"""CPU batch_norm benchmark: minigraph against PyTorch and a plain memory copy.

    python benchmarks/bn_cpu.py [--threads N] [--repeat R] [--shapes 32x16x32x32 ...] [--no-write]

For fp32 NCHW inputs it times, through `Executor.run` as a user calls it,
the training forward of `batch_norm` and forward + `batch_norm_grad` (the op
the grad maker builds); PyTorch's `torch.nn.functional.batch_norm`
(training=True) forward and forward + backward at the same thread count; and
`np.copyto` of x into a preallocated array (the cost of touching the bytes
once). A second table times batch norm followed by relu: the fused op
`batch_norm_relu` (what mg.passes.fuse_batch_norm_relu builds; its backward
`batch_norm_relu_grad`) against the unfused pair batch_norm + relu (backward:
relu_grad + batch_norm_grad), forward and forward + backward, and PyTorch's
relu(batch_norm(x)) (target: fused / pair <= 0.8). Each framework runs in a fresh
process of its own (this script with
--worker, results back as JSON): numpy's OpenBLAS threads and PyTorch's OpenMP
threads slow each other down many times over when they share a process on a
few cores. Times are medians after warm-up; inside a process the cases of one
shape take turns, so a change in the machine's load hits them alike. Then it
measures the executor's overhead per op on tiny tensors (relu when
registered, and batch_norm with is_infer=True, on (2, 3)): Executor.run over
100 ops, divided by 100, minus the time of calling the kernel directly.

It prints its table and then writes it, with the machine and the date, into
the `bn_cpu` section of docs/performance.md (benchmarks/report.py), replacing
the last run's; --no-write only prints.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import minigraph as mg
from minigraph.schema import KernelContext, get_schema, registered_ops

SHAPES = ((32, 64, 56, 56), (256, 512, 7, 7))


def median_ms(fns, repeat, warmup=3):
    """{name: median wall time of fn() in ms}, after `warmup` untimed calls of each.
    The functions take turns, so a change in the machine's load hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def bn_ops_for(x, dy):
    """A scope holding x, dy and the batch-norm state, the forward op and its grad op."""
    scope = mg.Scope()
    c = x.shape[1]

    def var(name, value=None, persistable=False):
        v = scope.new_var(name, persistable=persistable)
        if value is not None:
            v.set(value)
        return v

    xv, dyv = var("x", x), var("y@GRAD", dy)
    mean = var("mean", np.zeros(c, x.dtype), True)
    variance = var("var", np.ones(c, x.dtype), True)
    count = var("num_batches", np.array(0, np.int64), True)
    scale, bias = var("scale", np.ones(c, x.dtype), True), var("bias", np.zeros(c, x.dtype), True)
    fwd = mg.Operator("batch_norm", x=xv, estimated_mean=mean, estimated_var=variance,
                      scale=scale, bias=bias, num_batches=count, y=var("y"),
                      batch_mean=var("batch_mean"), batch_var=var("batch_var"),
                      saved_mean=mean, saved_var=variance, saved_num_batches=count)
    grads = {id(xv): var("x@GRAD"), id(scale): var("scale@GRAD"), id(bias): var("bias@GRAD")}
    (desc,) = fwd.schema.grad(fwd, {"y": dyv}, lambda v: grads.get(id(v)))
    return scope, fwd, mg.Operator(desc.type, **desc.kwargs)


def bn_relu_ops_for(x, dy, fused):
    """A scope with x, dy and the batch-norm state; the forward ops of batch norm + relu
    (one batch_norm_relu when `fused`, else batch_norm then relu) and their grad ops,
    as the grad makers build them."""
    scope, fwd, _ = bn_ops_for(x, dy)
    var = scope.new_var
    dout, out = scope.find_var("y@GRAD"), var("out")
    grads = {id(scope.find_var(n)): scope.find_var(f"{n}@GRAD") for n in ("x", "scale", "bias")}
    make_grad = lambda v: grads.get(id(v))      # noqa: E731 - the grad makers' callback
    if fused:
        slots = {s: v for s, v in {**fwd.inputs, **fwd.outputs}.items() if v is not None}
        op = mg.Operator("batch_norm_relu", **{**slots, "y": out}, **fwd.attrs)
        (desc,) = op.schema.grad(op, {"y": dout}, make_grad)
        return scope, [op], [mg.Operator(desc.type, **desc.kwargs)]
    relu = mg.Operator("relu", x=fwd.outputs["y"], out=out)
    grads[id(fwd.outputs["y"])] = var("t@GRAD")
    (relu_grad,) = relu.schema.grad(relu, {"out": dout}, make_grad)
    (bn_grad,) = fwd.schema.grad(fwd, {"y": grads[id(fwd.outputs["y"])]}, make_grad)
    return scope, [fwd, relu], [mg.Operator(d.type, **d.kwargs) for d in (relu_grad, bn_grad)]


def torch_cases(x, dy, threads):
    """{"torch fwd": fn, "torch fwd+bwd": fn} timing PyTorch's batch_norm; {} without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    torch.set_num_threads(threads)
    c = x.shape[1]
    tx, tdy = torch.from_numpy(x), torch.from_numpy(dy)
    rmean, rvar = torch.zeros(c), torch.ones(c)
    w, b = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
    gx = tx.clone().requires_grad_(True)

    def forward():
        with torch.no_grad():
            F.batch_norm(tx, rmean, rvar, w, b, training=True, momentum=0.1, eps=1e-5)

    def forward_backward():
        gx.grad = w.grad = b.grad = None
        y = F.batch_norm(gx, rmean, rvar, w, b, training=True, momentum=0.1, eps=1e-5)
        y.backward(tdy)

    def relu_forward():
        with torch.no_grad():
            F.relu(F.batch_norm(tx, rmean, rvar, w, b, training=True, momentum=0.1, eps=1e-5))

    def relu_forward_backward():
        gx.grad = w.grad = b.grad = None
        F.relu(F.batch_norm(gx, rmean, rvar, w, b, training=True, momentum=0.1,
                            eps=1e-5)).backward(tdy)

    return {"torch fwd": forward, "torch fwd+bwd": forward_backward,
            "torch relu fwd": relu_forward, "torch relu fwd+bwd": relu_forward_backward}


def shape_inputs(shape):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))


def minigraph_times(shape, repeat):
    """Median ms of minigraph's cases and the copy on an fp32 NCHW input of `shape`."""
    x, dy = shape_inputs(shape)
    scope, fwd, bwd = bn_ops_for(x, dy)
    ex = mg.Executor(mg.CPUPlace())
    dst = np.empty_like(x)
    cases = {"mg fwd": lambda: ex.run([fwd], scope),
             "mg fwd+bwd": lambda: ex.run([fwd, bwd], scope),
             "copy": lambda: np.copyto(dst, x)}
    if "batch_norm_relu" in registered_ops():
        for fused, name in ((True, "fused"), (False, "pair")):
            s, forward, backward = bn_relu_ops_for(x, dy, fused)
            cases[f"mg {name} fwd"] = lambda ex=ex, s=s, ops=forward: ex.run(ops, s)
            cases[f"mg {name} fwd+bwd"] = lambda ex=ex, s=s, ops=forward + backward: ex.run(ops, s)
    return median_ms(cases, repeat)


def torch_times(shape, threads, repeat):
    """Median ms of PyTorch's cases ({} without torch)."""
    x, dy = shape_inputs(shape)
    return median_ms(torch_cases(x, dy, threads), repeat)


def worker(framework, shape, threads, repeat):
    """The times of one framework in a fresh process: {case: ms}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework,
           "--shape", ",".join(map(str, shape)), "--threads", str(threads),
           "--repeat", str(repeat)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{framework} worker for {shape} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shape_times(shape, threads, repeat):
    """Median ms of every case on an fp32 NCHW input of `shape`, each framework in
    its own process."""
    return {**worker("minigraph", shape, threads, repeat),
            **worker("pytorch", shape, threads, repeat)}


def ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def fmt(t):
    return "n/a" if t is None else f"{t:.2f}"


def bench_shapes(times):
    """Print the table of every shape's times ({shape: shape_times}); returns its rows
    (for the markdown)."""
    print(f"{'shape':<18} {'pass':<8} {'minigraph ms':>12} {'pytorch ms':>11} {'copy ms':>8} "
          f"{'mg/pytorch':>10} {'mg/copy':>8}")
    rows = []
    for shape, t in times.items():
        for name in ("fwd", "fwd+bwd"):
            mine, theirs, copy = t["mg " + name], t.get("torch " + name), t["copy"]
            label = str(shape) if name == "fwd" else ""
            print(f"{label:<18} {name:<8} {fmt(mine):>12} {fmt(theirs):>11} {fmt(copy):>8} "
                  f"{ratio(mine, theirs):>10} {ratio(mine, copy):>8}")
            rows.append((str(shape), name, fmt(mine), fmt(theirs), fmt(copy),
                         ratio(mine, theirs), ratio(mine, copy)))
    return rows


def bench_fused(times):
    """Print the fused batch_norm_relu against the unfused pair (and PyTorch's
    relu(batch_norm)) from {shape: shape_times}; returns its rows. Nothing without
    the fused op."""
    if "batch_norm_relu" not in registered_ops():
        return []
    print(f"\nbatch norm + relu: the fused op against the unfused pair\n"
          f"{'shape':<18} {'pass':<8} {'fused ms':>9} {'pair ms':>8} {'fused/pair':>10} "
          f"{'pytorch ms':>11} {'fused/pytorch':>13}")
    rows = []
    for shape, t in times.items():
        for name in ("fwd", "fwd+bwd"):
            fused, pair, theirs = t[f"mg fused {name}"], t[f"mg pair {name}"], \
                t.get(f"torch relu {name}")
            label = str(shape) if name == "fwd" else ""
            print(f"{label:<18} {name:<8} {fmt(fused):>9} {fmt(pair):>8} "
                  f"{ratio(fused, pair):>10} {fmt(theirs):>11} {ratio(fused, theirs):>13}")
            rows.append((str(shape), name, fmt(fused), fmt(pair), ratio(fused, pair), fmt(theirs),
                         ratio(fused, theirs)))
    return rows


def tiny_ops(kind, count):
    """`count` independent tiny ops on a (2, 3) float32 tensor: relu, or batch_norm
    with is_infer=True; the scope they read and a description."""
    scope = mg.Scope()
    x = scope.new_var("x")
    x.set(np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32))
    if kind == "relu":
        out_slot = get_schema("relu").outputs[0].name
        ops = [mg.Operator("relu", x=x, **{out_slot: scope.new_var(f"out{i}")})
               for i in range(count)]
        return scope, ops, "relu on (2, 3)"
    params = {}
    for name, value in (("mean", 0.0), ("var", 1.0), ("scale", 1.0), ("bias", 0.0)):
        params[name] = scope.new_var(name, persistable=True)
        params[name].set(np.full(3, value, np.float32))
    ops = [mg.Operator("batch_norm", x=x, estimated_mean=params["mean"],
                       estimated_var=params["var"], scale=params["scale"], bias=params["bias"],
                       y=scope.new_var(f"y{i}"), batch_mean=scope.new_var(f"bm{i}"),
                       batch_var=scope.new_var(f"bv{i}"), saved_mean=params["mean"],
                       saved_var=params["var"], is_infer=True)
           for i in range(count)]
    return scope, ops, "batch_norm is_infer on (2, 3)"


def bench_overhead(repeat, count=100):
    """Executor.run over `count` tiny ops, per op, against calling their kernel directly;
    returns the lines printed."""
    lines = []
    relu_ok = "relu" in registered_ops() and {s.name for s in get_schema("relu").inputs} == {"x"}
    print()
    for kind in (["relu"] if relu_ok else []) + ["batch_norm"]:
        scope, ops, what = tiny_ops(kind, count)
        ex = mg.Executor(mg.CPUPlace())
        ins = {slot: (None if v is None else v.value) for slot, v in ops[0].inputs.items()}
        kernel, ctx = ops[0].schema.kernel_for("cpu", ins), KernelContext()

        def kernels_only(ops=ops, kernel=kernel, ins=ins, ctx=ctx):
            for op in ops:
                kernel(op, ins, ctx)

        t = median_ms({"run": lambda ex=ex, ops=ops, scope=scope: ex.run(ops, scope),
                       "kernels": kernels_only}, repeat * 5)
        run_us, kernel_us = t["run"] * 1e3 / count, t["kernels"] * 1e3 / count
        lines.append(f"executor overhead, {what}, {count} ops per run: {run_us:.1f} us per op "
                     f"in Executor.run, {kernel_us:.1f} us in the kernel, overhead "
                     f"{run_us - kernel_us:.1f} us per op (target <= 10)")
        print(lines[-1])
    return lines


def markdown(setting, rows, notes, fused_rows=()):
    """The section of docs/performance.md: the machine, the setting, the tables, the notes."""
    from report import machine_line, markdown_table

    header = ("shape", "pass", "minigraph ms", "PyTorch ms", "copy ms", "minigraph / PyTorch",
              "minigraph / copy")
    parts = [machine_line(setting), markdown_table(header, rows)]
    if fused_rows:
        parts += ["Batch norm + relu: the fused op (batch_norm_relu) against the unfused pair, "
                  "and PyTorch's relu(batch_norm(x)):",
                  markdown_table(("shape", "pass", "fused ms", "pair ms", "fused / pair",
                                  "PyTorch ms", "fused / PyTorch"), fused_rows)]
    return "\n\n".join(parts + ["\n".join(f"- {note}" for note in notes)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for minigraph's batch_norm and for PyTorch "
                             "(default: every core)")
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per case")
    parser.add_argument("--shapes", nargs="+", metavar="NxCxHxW",
                        help="NCHW shapes to time (default: "
                             f"{' '.join('x'.join(map(str, s)) for s in SHAPES)})")
    parser.add_argument("--no-write", action="store_true",
                        help="print the table only; do not replace the 'bn_cpu' section "
                             "of docs/performance.md")
    parser.add_argument("--worker", choices=("minigraph", "pytorch"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        shape = tuple(int(d) for d in args.shape.split(","))
        if args.worker == "minigraph":
            mg.set_num_threads(args.threads)
            print(json.dumps(minigraph_times(shape, args.repeat)))
        else:
            print(json.dumps(torch_times(shape, args.threads, args.repeat)))
        return
    mg.set_num_threads(args.threads)
    setting = (f"Threads: {args.threads} (minigraph batch_norm and PyTorch, each in its own "
               f"process), median of {args.repeat} runs, fp32 NCHW, training mode.")
    print(f"threads: {args.threads} (minigraph batch_norm and PyTorch, each in its own "
          f"process), cores: {os.cpu_count()}, median of {args.repeat} runs, fp32 NCHW")
    shapes = (tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes)
              if args.shapes else SHAPES)
    times = {shape: shape_times(shape, args.threads, args.repeat) for shape in shapes}
    rows = bench_shapes(times)
    fused_rows = bench_fused(times)
    notes = bench_overhead(args.repeat)
    from report import write_section

    write_section("bn_cpu", markdown(setting, rows, notes, fused_rows), enabled=not args.no_write)


if __name__ == "__main__":
    main()
