"""The norms' and OneCycleLR's PyTorch options against PyTorch, in float64.

    python benchmarks/norms_torch.py

Each row is one new behaviour, run in both frameworks on the same data (the ports of
benchmarks/torch_port.py; channels-last rows give minigraph the same data with its
channels last and compare it back in PyTorch's layout):
- batch_norm with first_batch_sets_estimates=False over three batches (momentum 0.1,
  0.3 and None in PyTorch's terms), NCHW and NHWC, bias=False, sync_batch_norm in a
  world of one, ranks 2 to 5, an empty batch;
- instance_norm with track_running_stats (1d/2d/3d, NHWC, inputs without a batch axis,
  affine, bias=False, eps=0), group_norm channels last, without affine parameters or
  with the scale alone, eps=0, ranks 2 to 5, an empty batch; layer_norm with the scale
  alone and without either, ranks 3 and 5;
- OneCycleLR (two and three phases, cos and linear) with momentum cycling driving
  SGD-momentum (nesterov), Adam and AdamW: the rate, the momentum or beta1, and the
  parameters after every step.
Compared: the outputs, dx and the parameters' gradients of the last training step, the
running estimates and the counter after it, the evaluation output. The largest relative
difference must stay under 1e-9. PyTorch is a benchmark-only dependency.
"""
from __future__ import annotations

import sys

import numpy as np
from torch_port import bind, compare, run_minigraph, run_torch

R = np.random.default_rng(0)


def data(*shape, n=3, offset=1.0):
    return [R.standard_normal(shape) * 2 + offset for _ in range(n)]


NORM_ROWS = [
    # (row, torch class, constructor args, kwargs, batches, layout)
    ("batch_norm torch rule, momentum 0.1", "BatchNorm2d", (3,), {}, data(4, 3, 5, 5), "NCHW"),
    ("batch_norm torch rule, momentum 0.3, NHWC", "BatchNorm2d", (3,), {"momentum": 0.3},
     data(4, 3, 5, 5), "NHWC"),
    ("batch_norm torch rule, cumulative (None)", "BatchNorm1d", (6,), {"momentum": None},
     data(8, 6), "NCHW"),
    ("batch_norm bias=False, rank 3", "BatchNorm1d", (4,), {"bias": False}, data(5, 4, 7),
     "NCHW"),
    ("batch_norm rank 5, NHWC", "BatchNorm3d", (2,), {}, data(3, 2, 3, 4, 2), "NHWC"),
    ("sync_batch_norm (one rank), torch rule", "SyncBatchNorm", (3,), {"momentum": 0.2},
     data(4, 3, 4, 4), "NCHW"),
    ("batch_norm empty batch", "BatchNorm2d", (3,), {}, [np.zeros((0, 3, 2, 2))], "NCHW"),
    ("instance_norm tracked 1d", "InstanceNorm1d", (3,),
     {"track_running_stats": True, "momentum": 0.3}, data(4, 3, 9), "NCHW"),
    ("instance_norm tracked 2d NHWC affine", "InstanceNorm2d", (4,),
     {"track_running_stats": True, "affine": True}, data(3, 4, 5, 6), "NHWC"),
    ("instance_norm tracked 3d bias=False", "InstanceNorm3d", (2,),
     {"track_running_stats": True, "affine": True, "bias": False}, data(2, 2, 3, 3, 4),
     "NCHW"),
    ("instance_norm tracked, no batch axis", "InstanceNorm2d", (3,),
     {"track_running_stats": True}, data(3, 6, 6), "NCHW"),
    ("instance_norm no batch axis, NHWC", "InstanceNorm1d", (3,), {}, data(3, 15), "NHWC"),
    ("instance_norm eps=0, affine", "InstanceNorm2d", (3,), {"eps": 0.0, "affine": True},
     data(2, 3, 4, 4), "NCHW"),
    ("instance_norm tracked, momentum None (never updates)", "InstanceNorm1d", (3,),
     {"track_running_stats": True, "momentum": None}, data(4, 3, 9), "NCHW"),
    ("group_norm NHWC", "GroupNorm", (3, 6), {}, data(2, 6, 4, 5), "NHWC"),
    ("group_norm affine=False, rank 5 NHWC", "GroupNorm", (2, 4), {"affine": False},
     data(2, 4, 2, 3, 3), "NHWC"),
    ("group_norm bias=False, rank 2", "GroupNorm", (2, 6), {"bias": False}, data(5, 6),
     "NCHW"),
    ("group_norm eps=0, rank 3", "GroupNorm", (1, 4), {"eps": 0.0}, data(3, 4, 7), "NCHW"),
    ("group_norm empty batch", "GroupNorm", (2, 4), {}, [np.zeros((0, 4, 3))], "NHWC"),
    ("layer_norm scale only (bias=False), rank 5", "LayerNorm", ((3, 4),), {"bias": False},
     data(2, 2, 2, 3, 4), "NCHW"),
    ("layer_norm no affine, rank 3, eps=0", "LayerNorm", ((6,),),
     {"elementwise_affine": False, "eps": 0.0}, data(3, 5, 6), "NCHW"),
    ("layer_norm empty batch", "LayerNorm", ((5,),), {}, [np.zeros((0, 5))], "NCHW"),
]


def norm_rows():
    rows = []
    for row, kind, args, kwargs, xs, layout in NORM_ROWS:
        named = bind(kind, args, kwargs)
        dy = np.random.default_rng(1).standard_normal(xs[-1].shape)
        theirs = run_torch(kind, named, xs, dy, np.float64)
        ours = run_minigraph(kind, named, xs, dy, np.float64, layout=layout)
        skip = []
        if kind.startswith("InstanceNorm"):
            skip.append("counter")                # PyTorch's InstanceNorm never counts
        if not xs[-1].size:
            skip.append("counter")                # an empty batch: ours does not move
        worst, bad = compare(theirs, ours, np.float64, skip)
        rows.append((row, ", ".join(sorted(k for k in theirs if k not in skip)), worst, bad))
    return rows


# ---- OneCycleLR ------------------------------------------------------------------------------

X = np.random.default_rng(2).standard_normal((6, 4))


def one_cycle_row(opt_kind, total, three_phase, anneal):
    import torch

    import minigraph as mg
    from minigraph import layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4), dtype="float64")
    y = L.fc(net, x, 3, name="fc")
    loss = L.mean(net, L.multiply(net, y, y))
    sched = mg.optimizer.lr.OneCycleLR.with_torch_defaults(0.1, total, three_phase=three_phase,
                                                           anneal_strategy=anneal)
    make = {"momentum": lambda: mg.optimizer.Momentum(sched, nesterov=True),
            "adam": lambda: mg.optimizer.Adam(sched),
            "adamw": lambda: mg.optimizer.AdamW(sched, weight_decay=0.05)}[opt_kind]
    opt = make()
    opt.minimize(net, loss)
    w = torch.tensor(net.var("fc.w").get().copy(), requires_grad=True)
    b = torch.tensor(net.var("fc.b").get().copy(), requires_grad=True)
    topt = {"momentum": lambda: torch.optim.SGD([w, b], lr=0.1, momentum=0.9, nesterov=True),
            "adam": lambda: torch.optim.Adam([w, b], lr=0.1),
            "adamw": lambda: torch.optim.AdamW([w, b], lr=0.1, weight_decay=0.05)}[opt_kind]()
    tsched = torch.optim.lr_scheduler.OneCycleLR(topt, 0.1, total_steps=total,
                                                 three_phase=three_phase,
                                                 anneal_strategy=anneal)
    worst = 0.0
    for _ in range(total):
        group = topt.param_groups[0]
        momentum = group["momentum"] if "momentum" in group else group["betas"][0]
        rate = group["lr"]
        net.train(feed={"x": X})
        topt.zero_grad()
        out = torch.tensor(X) @ w + b
        (out * out).mean().backward()
        topt.step()
        tsched.step()
        worst = max(worst, abs(opt.learning_rate - rate) / rate,
                    abs(opt.cycled_momentum - momentum),
                    float(np.max(np.abs(net.var("fc.w").get() - w.detach().numpy()))))
    bad = [] if worst <= 1e-9 else [f"max difference {worst:.2g}"]
    phases = "three phases" if three_phase else "two phases"
    return (f"OneCycleLR.with_torch_defaults, {phases}, {anneal}, {opt_kind}",
            "rate, momentum/beta1, weights per step", worst, bad)


def main():
    rows = norm_rows()
    for args in (("momentum", 25, False, "cos"), ("momentum", 25, True, "linear"),
                 ("adam", 20, False, "linear"), ("adam", 20, True, "cos"),
                 ("adamw", 30, False, "cos")):
        rows.append(one_cycle_row(*args))
    print("| behaviour | compared | max rel. difference | verdict |\n|---|---|---|---|")
    failed = 0
    for row, what, worst, bad in rows:
        verdict = "equal" if not bad else "DIFFER: " + "; ".join(bad)
        failed += bool(bad)
        print(f"| {row} | {what} | {worst:.1e} | {verdict} |")
    print(f"\n{len(rows) - failed} of {len(rows)} equal to PyTorch (float64, 1e-9 relative)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
