"""Freezing a parameter after the optimizer was made, against PyTorch: the largest difference.

    python benchmarks/freeze_torch.py

minigraph's `var.trainable = False` after `minimize` against PyTorch's
`p.requires_grad_(False)` after the optimizer was built (with
`zero_grad(set_to_none=True)`, so the frozen parameter has no `.grad` and the
optimizer skips it). A two-layer net in float64 trains 4 steps, then 4 with the
body's weight frozen, then 4 with it trainable again, from the same initial
weights and batches, with: SGD with momentum, weight decay and global-norm
clipping (clip_grad_norm_ skips a parameter without a gradient); and AdamW
(decoupled decay, per-parameter step counts). minigraph and PyTorch each run in
a process of their own (this script with --worker), results back as .npz files.
The table gives, per case, the largest difference of any parameter after any
step, relative to the largest value, and whether the frozen weight stayed
bit for bit the same while frozen.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

CASES = ("momentum_clip", "adamw")
PHASES = (4, 4, 4)                     # trainable, frozen, trainable again
IN, HIDDEN, OUT, ROWS = 6, 8, 3, 16


def weights():
    rng = np.random.default_rng(0)
    return {"body.w": rng.standard_normal((IN, HIDDEN)) * 0.5,
            "body.b": rng.standard_normal(HIDDEN) * 0.1,
            "head.w": rng.standard_normal((HIDDEN, OUT)) * 0.5,
            "head.b": rng.standard_normal(OUT) * 0.1}


def batch(step):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((ROWS, IN)), rng.integers(0, OUT, ROWS)


def mg_run(case):
    import minigraph as mg
    from minigraph import layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, IN), dtype="float64")
    y = L.data(net, "y", shape=(-1,), dtype="int64")
    h = L.tanh(net, L.fc(net, x, HIDDEN, name="body"))
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, h, OUT, name="head"), y))
    if case == "momentum_clip":
        opt = mg.optimizer.Momentum(0.1, momentum=0.9, weight_decay=0.01,
                                    grad_clip=mg.optimizer.ClipGradByGlobalNorm(0.5))
    else:
        opt = mg.optimizer.AdamW(0.01, weight_decay=0.1)
    opt.minimize(net, loss)
    mg.io.load_parameters(net, weights())
    states, step = [], 0
    for phase, steps in enumerate(PHASES):
        net.var("body.w").trainable = phase != 1
        for _ in range(steps):
            xb, yb = batch(step)
            net.train(feed={"x": xb, "y": yb})
            states.append({n: net.var(n).get() for n in weights()})
            step += 1
    return states


def torch_run(case):
    import torch

    torch.set_default_dtype(torch.float64)
    body, head = torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT)
    w = weights()
    with torch.no_grad():
        body.weight.copy_(torch.from_numpy(w["body.w"].T))
        body.bias.copy_(torch.from_numpy(w["body.b"]))
        head.weight.copy_(torch.from_numpy(w["head.w"].T))
        head.bias.copy_(torch.from_numpy(w["head.b"]))
    params = [body.weight, body.bias, head.weight, head.bias]
    if case == "momentum_clip":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    states, step = [], 0
    for phase, steps in enumerate(PHASES):
        body.weight.requires_grad_(phase != 1)
        for _ in range(steps):
            xb, yb = batch(step)
            opt.zero_grad(set_to_none=True)
            logits = head(torch.tanh(body(torch.from_numpy(xb))))
            torch.nn.functional.cross_entropy(logits, torch.from_numpy(yb)).backward()
            if case == "momentum_clip":
                torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            states.append({"body.w": body.weight.detach().numpy().T.copy(),
                           "body.b": body.bias.detach().numpy().copy(),
                           "head.w": head.weight.detach().numpy().T.copy(),
                           "head.b": head.bias.detach().numpy().copy()})
            step += 1
    return states


def worker(framework, out):
    run = mg_run if framework == "minigraph" else torch_run
    arrays = {}
    for case in CASES:
        for i, state in enumerate(run(case)):
            arrays.update({f"{case}/{i}/{n}": v for n, v in state.items()})
    np.savez(out, **arrays)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("minigraph", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for framework in ("minigraph", "torch"):
            files[framework] = os.path.join(tmp, f"{framework}.npz")
            subprocess.run([sys.executable, __file__, "--worker", framework, "--out",
                            files[framework]], check=True)
        ours, theirs = np.load(files["minigraph"]), np.load(files["torch"])
        print(f"{'case':<15} {'max rel diff':>12}  frozen weight unchanged while frozen")
        for case in CASES:
            keys = [k for k in ours.files if k.startswith(case + "/")]
            scale = max(np.abs(theirs[k]).max() for k in keys)
            diff = max(np.abs(ours[k] - theirs[k]).max() for k in keys) / scale
            start, end = PHASES[0] - 1, PHASES[0] + PHASES[1] - 1
            kept = all(np.array_equal(ours[f"{case}/{i}/body.w"], ours[f"{case}/{start}/body.w"])
                       for i in range(start, end + 1))
            print(f"{case:<15} {diff:>12.2e}  {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
