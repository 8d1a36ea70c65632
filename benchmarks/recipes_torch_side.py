"""The PyTorch side of benchmarks/recipes_torch.py: the same schedules, losses, ops,
initialisers, recipe and attention block, run in a process of its own (recipes_torch.py
runs this through its --worker pytorch mode; PyTorch is a benchmark-only dependency)."""
from __future__ import annotations

import math

import numpy as np
from recipes_torch import (
    LOSSES,
    MATH,
    PLATEAU,
    STEPS,
    TABLE,
    attention_inputs,
    data,
    init_stats,
    loss_inputs,
    math_inputs,
    recipe_batches,
    recipe_weights,
)


def torch_rates(torch, name):
    from torch.optim import lr_scheduler as S

    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1)
    if name == "ReduceOnPlateau":
        s = S.ReduceLROnPlateau(opt, patience=1, cooldown=1)
        out = []
        for m in PLATEAU:
            s.step(m)
            out.append(opt.param_groups[0]["lr"])
        return np.array(out)
    s = {"ExponentialDecay": lambda: S.ExponentialLR(opt, 0.95),
         "MultiStepDecay": lambda: S.MultiStepLR(opt, [10, 25, 40], 0.3),
         "OneCycleLR": lambda: S.OneCycleLR(opt, 0.1, total_steps=STEPS, pct_start=0.3,
                                            div_factor=25.0, final_div_factor=0.1 / 25 / 1e-4,
                                            cycle_momentum=False),
         "LinearWarmup": lambda: S.SequentialLR(
             opt, [S.LinearLR(opt, 0.1, 1.0, total_iters=10),
                   S.CosineAnnealingLR(opt, T_max=50)], milestones=[10])}[name]()
    out = []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    return np.array(out)


def torch_graph(torch, fn, ins):
    t = {k: torch.tensor(v, requires_grad=v.dtype.kind == "f") for k, v in ins.items()}
    out = fn(t)
    weight = torch.tensor(data(9, *out.shape) if out.dim() else np.array(1.0))
    (out * weight).sum().backward()
    return [out.detach().numpy()] + [t[k].grad.numpy() for k in ins if ins[k].dtype.kind == "f"]


def torch_math(torch, name):
    ins = math_inputs(name)
    fns = {"subtract": lambda t: t["x"] - t["y"], "divide": lambda t: t["x"] / t["y"],
           "pow": lambda t: t["x"] ** 1.7, "clip": lambda t: torch.clamp(t["x"], -0.5, 0.8),
           "square": lambda t: torch.square(t["x"]),
           "reduce_sum": lambda t: t["x"].sum(dim=(0, 2)),
           "reduce_mean": lambda t: t["x"].mean(dim=1, keepdim=True),
           "reduce_max": lambda t: torch.amax(t["x"], dim=-1),
           "matmul": lambda t: torch.matmul(t["x"].transpose(-1, -2), t["y"].transpose(-1, -2)),
           "embedding": lambda t: torch.nn.functional.embedding(t["ids"], t["w"],
                                                                padding_idx=2)}
    fn = fns.get(name) or (lambda t: getattr(torch, name)(t["x"]))
    return torch_graph(torch, fn, ins)


def torch_loss(torch, name):
    import torch.nn.functional as F

    x, t, p, y = loss_inputs()
    if name == "cross_entropy_label_smoothing":
        return torch_graph(torch, lambda v: F.cross_entropy(v["x"], v["y"], label_smoothing=0.1),
                           {"x": x, "y": y})
    fn = {"mse_loss": F.mse_loss, "l1_loss": F.l1_loss,
          "huber_loss": lambda a, b: F.huber_loss(a, b, delta=0.7),
          "binary_cross_entropy_with_logits": F.binary_cross_entropy_with_logits}[name]
    label = p if name.startswith("binary") else t
    return torch_graph(torch, lambda v: fn(v["x"], v["t"]), {"x": x, "t": label})


def torch_init(torch, name):
    if name == "init_fc":
        m, fan_in = torch.nn.Linear(64 * 25, 300), 64 * 25
        w = m.weight.detach().numpy().T
    else:
        m, fan_in = torch.nn.Conv2d(64, 128, 3), 64 * 9
        w = m.weight.detach().numpy()
    return init_stats(w, m.bias.detach().numpy(), fan_in)


def torch_recipe(torch):
    import torch.nn.functional as F

    w = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in recipe_weights().items()}
    opt = torch.optim.AdamW([
        {"params": [w["fc1.w"]]}, {"params": [w["fc1.b"]], "weight_decay": 0.0},
        {"params": [w["head.w"]], "lr": 0.5}, {"params": [w["head.b"]], "lr": 0.5,
                                                "weight_decay": 0.0}], lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, [0.05, 0.05, 0.5, 0.5], total_steps=6, pct_start=0.3, div_factor=25.0,
        final_div_factor=0.05 / 25 / 1e-4, cycle_momentum=False)    # the same for 10x
    for i, (bx, by) in enumerate(recipe_batches()):
        h = torch.tanh(torch.tensor(bx) @ w["fc1.w"] + w["fc1.b"])
        loss = F.cross_entropy(h @ w["head.w"] + w["head.b"], torch.tensor(by),
                               label_smoothing=0.1)
        (loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
            sched.step()
    return [w[k].detach().numpy() for k in recipe_weights()]


def torch_attention(torch):
    import torch.nn.functional as F

    a = attention_inputs()
    p = {k: torch.tensor(a[k], requires_grad=True)
         for k in ("emb", "wq", "wk", "wv", "head.w", "head.b")}
    e = F.embedding(torch.tensor(a["ids"]), p["emb"])
    q, k, v = e @ p["wq"], e @ p["wk"], e @ p["wv"]
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(6), dim=-1)
    logits = (att @ v).mean(dim=1) @ p["head.w"] + p["head.b"]
    loss = F.cross_entropy(logits, torch.tensor(a["label"]))
    loss.backward()
    return [loss.detach().numpy()] + [p[n].grad.numpy()
                                      for n in ("emb", "wq", "wk", "wv", "head.w", "head.b")]


def torch_case(case):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if case in dict((r[0], 0) for r in TABLE[:5]):
        return [torch_rates(torch, case)]
    if case in MATH:
        return torch_math(torch, case)
    if case in LOSSES:
        return torch_loss(torch, case)
    if case.startswith("init"):
        return torch_init(torch, case)
    return torch_recipe(torch) if case == "recipe" else torch_attention(torch)
