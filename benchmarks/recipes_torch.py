"""The training-recipe APIs against their PyTorch equivalents: the largest difference.

    python benchmarks/recipes_torch.py [--no-write]

Every case computes the same thing in both frameworks from the same seeded numpy
inputs (float64, so differences show the formulas, not float32 rounding): the
learning rates of every step of each schedule; each loss's value and its gradient;
each math op's output and the gradients of sum(out * w) for fixed random w; the
default initialisation's range; and whole training runs (parameter groups with a
10x head and no decay on biases, GradientMerge against PyTorch's accumulation
loop, OneCycleLR, label smoothing; a single-head attention block's gradients)
from the same initial weights. minigraph and PyTorch each run in a process of
their own (this script with --worker), results back as .npz files. The table
gives, per API, the largest difference relative to the largest value compared.
It is printed and written into the `recipes_torch` section of docs/performance.md.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

STEPS = 60
PLATEAU = [1.0, 0.9, 0.95, 0.95, 0.9, 0.97, 0.8, 0.85, 0.85, 0.9, 0.91, 0.92, 0.5, 0.6, 0.7,
           0.8, 0.9, 1.0, 1.1, 0.4]
MATH = ["subtract", "divide", "exp", "log", "sqrt", "square", "abs", "pow", "clip",
        "reduce_sum", "reduce_mean", "reduce_max", "matmul", "embedding"]
LOSSES = ["mse_loss", "l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
          "cross_entropy_label_smoothing"]
# (case, minigraph API, PyTorch equivalent)
TABLE = [("ExponentialDecay", "lr.ExponentialDecay(0.1, 0.95)", "ExponentialLR"),
         ("MultiStepDecay", "lr.MultiStepDecay(0.1, [10, 25, 40], 0.3)", "MultiStepLR"),
         ("OneCycleLR", "lr.OneCycleLR(0.1, 60)", "OneCycleLR (cycle_momentum=False)"),
         ("LinearWarmup", "lr.LinearWarmup(lr.CosineDecay(0.1, 50), 10, 0.01, 0.1)",
          "SequentialLR(LinearLR, CosineAnnealingLR)"),
         ("ReduceOnPlateau", "lr.ReduceOnPlateau(0.1, patience=1, cooldown=1)",
          "ReduceLROnPlateau")] + \
    [(n, f"layers.{n}", f"F.{n}") for n in LOSSES[:4]] + \
    [("cross_entropy_label_smoothing", "layers.softmax_with_cross_entropy(label_smoothing=0.1)",
      "F.cross_entropy(label_smoothing=0.1)")] + \
    [(n, f"layers.{n}", "torch." + {"reduce_sum": "sum", "reduce_mean": "mean",
                                    "reduce_max": "amax", "clip": "clamp",
                                    "embedding": "nn.functional.embedding"}.get(n, n))
     for n in MATH] + \
    [("init_fc", "layers.fc default init", "nn.Linear default init"),
     ("init_conv", "layers.conv2d default init", "nn.Conv2d default init"),
     ("recipe", "AdamW groups + OneCycleLR + label smoothing + GradientMerge(k=2)",
      "AdamW param groups + OneCycleLR + accumulation loop"),
     ("attention", "embedding + matmul + softmax block, gradients", "autograd")]


def data(seed, *shape, low=None, high=None):
    rng = np.random.default_rng(seed)
    if low is not None:
        return rng.uniform(low, high, shape)
    return rng.standard_normal(shape)


def math_inputs(name):
    """(inputs {name: array}, attrs) of one math case; the same in both workers."""
    x = data(1, 3, 4, 5)
    if name in ("log", "sqrt", "pow", "divide"):
        x = np.abs(x) + 0.3
    ins = {"x": x}
    if name in ("subtract", "divide"):
        ins["y"] = data(2, 4, 1, low=0.5, high=2.0)
    if name == "matmul":
        ins = {"x": data(3, 2, 1, 5, 3), "y": data(4, 3, 4, 5)}           # transposed both
    if name == "embedding":
        ins = {"ids": np.random.default_rng(5).integers(0, 7, (3, 4)), "w": data(6, 7, 5)}
    return ins


# ---- minigraph ----------------------------------------------------------------------

def mg_rates(mg, name):
    from minigraph import layers as L
    from minigraph.optimizer import lr

    make = {"ExponentialDecay": lambda: lr.ExponentialDecay(0.1, 0.95),
            "MultiStepDecay": lambda: lr.MultiStepDecay(0.1, [10, 25, 40], 0.3),
            "OneCycleLR": lambda: lr.OneCycleLR(0.1, STEPS),
            "LinearWarmup": lambda: lr.LinearWarmup(lr.CosineDecay(0.1, 50), 10, 0.01, 0.1),
            "ReduceOnPlateau": lambda: lr.ReduceOnPlateau(0.1, patience=1, cooldown=1)}[name]
    schedule = make()
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 2), "float64")
    opt = mg.optimizer.SGD(schedule)
    opt.minimize(net, L.mean(net, L.fc(net, x, 1)))
    if name == "ReduceOnPlateau":
        return np.array([schedule.step(m) for m in PLATEAU])
    out = []
    for _ in range(STEPS):
        net.train(feed={"x": np.ones((1, 2))})
        out.append(opt.learning_rate)
    return np.array(out)


def mg_graph(mg, build, feeds):
    """Build with `build(net, data vars) -> out`, a loss sum(out * w) (w fixed), and
    return [out, d loss / d each float feed] through parameters added to the feeds."""
    from minigraph import layers as L

    net = mg.Net(seed=0)
    vars_, params = {}, {}
    for k, v in feeds.items():
        vars_[k] = L.data(net, k, v.shape, str(v.dtype))
        if v.dtype.kind == "f":
            params[k] = net.create_parameter(f"p_{k}", v.shape, "float64",
                                             mg.initializer.Constant(0.0))
            vars_[k] = L.add(net, vars_[k], params[k])
    if "w" in feeds and "ids" in feeds:                # the table is the parameter itself
        net = mg.Net(seed=0)
        ids = L.data(net, "ids", feeds["ids"].shape, "int64")
        out = L.embedding(net, ids, 7, 5, padding_idx=2, dtype="float64", name="e")
        net.var("e.w").set(feeds["w"])
        params, vars_ = {"w": net.var("e.w")}, {"ids": ids}
        feeds = {"ids": feeds["ids"]}
    else:
        out = build(net, vars_)
    weight = data(9, *out.shape) if out.shape else np.array(1.0)
    total = L.reduce_sum(net, L.multiply(net, out, L.data(net, "weight", weight.shape,
                                                            "float64")))
    mg.append_backward(net, total)
    got = net.train(feed={**feeds, "weight": weight},
                    fetch=[out] + [net.grad(p) for p in params.values()])
    return [np.asarray(g) for g in got]


def mg_math(mg, name):
    from minigraph import layers as L

    ins = math_inputs(name)
    ops = {"subtract": lambda n, v: L.subtract(n, v["x"], v["y"]),
           "divide": lambda n, v: L.divide(n, v["x"], v["y"]),
           "pow": lambda n, v: L.pow(n, v["x"], 1.7),
           "clip": lambda n, v: L.clip(n, v["x"], -0.5, 0.8),
           "reduce_sum": lambda n, v: L.reduce_sum(n, v["x"], axis=(0, 2)),
           "reduce_mean": lambda n, v: L.reduce_mean(n, v["x"], axis=1, keepdim=True),
           "reduce_max": lambda n, v: L.reduce_max(n, v["x"], axis=-1),
           "matmul": lambda n, v: L.matmul(n, v["x"], v["y"], transpose_x=True,
                                           transpose_y=True),
           "embedding": None}
    build = ops.get(name) or (lambda n, v: getattr(L, name)(n, v["x"]))
    return mg_graph(mg, build, ins)


def loss_inputs():
    return data(11, 6, 3) * 2, data(12, 6, 3), data(13, 6, 3, low=0.0, high=1.0), \
        np.random.default_rng(14).integers(0, 3, 6)


def mg_loss(mg, name):
    from minigraph import layers as L

    x, t, p, y = loss_inputs()
    if name == "cross_entropy_label_smoothing":
        return mg_graph(mg, lambda n, v: L.mean(n, L.softmax_with_cross_entropy(
            n, v["x"], v["y"], label_smoothing=0.1)), {"x": x, "y": y})
    label = p if name.startswith("binary") else t
    kwargs = {"delta": 0.7} if name == "huber_loss" else {}
    return mg_graph(mg, lambda n, v: getattr(L, name)(n, v["x"], v["t"], **kwargs),
                    {"x": x, "t": label})


def mg_init(mg, name):
    from minigraph import layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 64, 5, 5))
    if name == "init_fc":
        L.fc(net, x, 300, name="m")
        fan_in = 64 * 25
    else:
        L.conv2d(net, x, 128, 3, name="m")
        fan_in = 64 * 9
    return init_stats(net.var("m.w").get(), net.var("m.b").get(), fan_in)


def init_stats(w, b, fan_in):
    """max |w|, std(w), max |b|, each times sqrt(fan_in): about 1, 1/sqrt(3) and 1 for
    U(+-1/sqrt(fan_in))."""
    s = math.sqrt(fan_in)
    return [np.array([np.abs(w).max() * s, w.std() * s, np.abs(b).max() * s])]


def recipe_weights():
    return {"fc1.w": data(21, 8, 16) * 0.3, "fc1.b": data(22, 16) * 0.1,
            "head.w": data(23, 16, 3) * 0.3, "head.b": data(24, 3) * 0.1}


def recipe_batches():
    rng = np.random.default_rng(25)
    return [(rng.standard_normal((5, 8)), rng.integers(0, 3, 5)) for _ in range(12)]


def mg_recipe(mg):
    from minigraph import layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 8), "float64")
    y = L.data(net, "y", (-1,), "int64")
    h = L.tanh(net, L.fc(net, x, 16, name="fc1"))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, h, 3, name="head"), y,
                                                    label_smoothing=0.1))
    for k, v in recipe_weights().items():
        net.var(k).set(v)
    opt = mg.optimizer.GradientMerge(mg.optimizer.AdamW(
        mg.optimizer.lr.OneCycleLR(0.05, 6), weight_decay=0.1), 2)
    v = net.var
    opt.minimize(net, loss, parameters=[
        {"params": [v("fc1.w")]}, {"params": [v("fc1.b")], "weight_decay": 0.0},
        {"params": [v("head.w")], "learning_rate": 10.0},
        {"params": [v("head.b")], "learning_rate": 10.0, "weight_decay": 0.0}])
    for bx, by in recipe_batches():
        net.train(feed={"x": bx, "y": by})
    return [net.var(k).get() for k in recipe_weights()]


def attention_inputs():
    rng = np.random.default_rng(31)
    return {"emb": data(32, 11, 6), "wq": data(33, 6, 6) * 0.5, "wk": data(34, 6, 6) * 0.5,
            "wv": data(35, 6, 6) * 0.5, "head.w": data(36, 6, 3), "head.b": data(37, 3),
            "ids": rng.integers(0, 11, (4, 5)), "label": rng.integers(0, 3, 4)}


def mg_attention(mg):
    from minigraph import layers as L

    a = attention_inputs()
    net = mg.Net(seed=0)
    ids = L.data(net, "ids", (-1, 5), "int64")
    label = L.data(net, "label", (-1,), "int64")
    e = L.embedding(net, ids, 11, 6, dtype="float64", name="emb")
    proj = {}
    for part in "qkv":
        w = net.create_parameter(f"w{part}", (6, 6), "float64", mg.initializer.Constant(0.0))
        proj[part] = L.matmul(net, e, w)
    att = L.softmax(net, L.scale(net, L.matmul(net, proj["q"], proj["k"], transpose_y=True),
                                 1 / math.sqrt(6)))
    pooled = L.reduce_mean(net, L.matmul(net, att, proj["v"]), axis=1)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, pooled, 3, name="head"),
                                                    label))
    for k in ("wq", "wk", "wv", "head.w", "head.b"):
        net.var(k).set(a[k])
    net.var("emb.w").set(a["emb"])
    mg.append_backward(net, loss)
    names = ["emb.w", "wq", "wk", "wv", "head.w", "head.b"]
    return [np.asarray(g) for g in net.train(feed={"ids": a["ids"], "label": a["label"]},
                                             fetch=[loss] + [net.grad(n) for n in names])]


def mg_case(case):
    import minigraph as mg

    if case in dict((r[0], 0) for r in TABLE[:5]):
        return [mg_rates(mg, case)]
    if case in MATH:
        return mg_math(mg, case)
    if case in LOSSES:
        return mg_loss(mg, case)
    if case.startswith("init"):
        return mg_init(mg, case)
    return mg_recipe(mg) if case == "recipe" else mg_attention(mg)


# ---- the two processes and the table -------------------------------------------------

def worker(framework, out):
    if framework == "minigraph":
        fn = mg_case
    else:
        from recipes_torch_side import torch_case as fn
    results = {}
    for case, _, _ in TABLE:
        for i, a in enumerate(fn(case)):
            results[f"{case}/{i}"] = np.asarray(a, np.float64)
    np.savez(out, **results)


def run(framework, tmp):
    out = os.path.join(tmp, f"{framework}.npz")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", framework,
                           "--out", out], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{framework} worker failed:\n{done.stderr}")
    with np.load(out) as f:
        return dict(f)


def rows():
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = run("minigraph", tmp), run("pytorch", tmp)
    table = []
    for case, api, peer in TABLE:
        worst, compared = 0.0, 0
        for key in sorted(k for k in theirs if k.startswith(case + "/")):
            want, got = theirs[key], ours[key]
            if got.shape != want.shape:
                raise AssertionError(f"{key}: shape {got.shape} vs PyTorch's {want.shape}")
            scale = max(float(np.abs(want).max()), 1e-300)
            worst = max(worst, float(np.abs(got - want).max()) / scale)
            compared += want.size
        if case.startswith("init"):           # different generators: compare the ranges
            note = "max, std, bias max (x sqrt(fan_in)): " + ", ".join(
                f"{a:.3f}/{b:.3f}" for a, b in zip(ours[case + "/0"], theirs[case + "/0"]))
            table.append([api, peer, "same distribution", note])
        else:
            table.append([api, peer, f"{worst:.1e}", f"{compared} values"])
        print(" | ".join(table[-1]), flush=True)
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true",
                   help="print only; do not replace the 'recipes_torch' section of "
                        "docs/performance.md")
    p.add_argument("--worker", choices=("minigraph", "pytorch"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import machine_line, markdown_table, write_section

    table = rows()
    text = "\n".join([machine_line("float64 in both, each framework in its own process; the "
                                   "difference is relative to the largest value compared."),
                      "", markdown_table(["minigraph", "PyTorch", "largest difference",
                                          "compared"], table)])
    write_section("recipes_torch", text, enabled=not args.no_write)


if __name__ == "__main__":
    main()
