"""The PyTorch side of benchmarks/nets_cpu.py: the same nets, batches and optimizers,
timed and measured the same way, in a process of its own (nets_cpu.py runs this
through its --worker pytorch mode; PyTorch is a benchmark-only dependency)."""
from __future__ import annotations

from lockstep import serve
from nets_models import (
    ADAM_NETS,
    ADAMW_NETS,
    CIFAR_CONVS,
    LEARNING_RATE,
    MOBILE_BLOCKS,
    MOMENTUM,
    RECIPE_CONVS,
    STAGES,
    WEIGHT_DECAY,
    batch,
)
from peak_memory import rss_peak
from timing import lockstep_commands


def torch_model(net_name):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if net_name == "mnist":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1),
                             nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
                             nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.BatchNorm1d(128),
                             nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10))
    if net_name == "cifar":
        layers, cin = [], 3
        for filters in CIFAR_CONVS:
            layers += [nn.Conv2d(cin, filters, 3, padding=1), nn.BatchNorm2d(filters),
                       nn.SiLU(), nn.AvgPool2d(2)]
            cin = filters
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin * 4 * 4, 256),
                             nn.LeakyReLU(0.01), nn.Dropout(0.3), nn.Linear(256, 10))
    if net_name == "recipe":
        (c1, c2) = RECIPE_CONVS
        return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Conv2d(c1, c2, 3, padding=1),
                             nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(c2 * 7 * 7, 128), nn.BatchNorm1d(128), nn.ReLU(),
                             nn.Dropout(0.5), nn.Linear(128, 10))
    if net_name == "mlp":
        return nn.Sequential(nn.Linear(784, 2048), nn.BatchNorm1d(2048), nn.ReLU(),
                             nn.Linear(2048, 2048), nn.BatchNorm1d(2048), nn.ReLU(),
                             nn.Linear(2048, 10))
    if net_name == "digits":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 64),
                             nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    def conv_bn(cin, cout, size, stride, groups=1):
        return [nn.Conv2d(cin, cout, size, stride, size // 2, groups=groups, bias=False),
                nn.BatchNorm2d(cout)]

    if net_name == "mobile":
        layers, cin = [*conv_bn(3, 32, 3, 1), nn.ReLU()], 32
        for filters, stride in MOBILE_BLOCKS:
            layers += [*conv_bn(cin, cin, 3, stride, groups=cin), nn.ReLU(),
                       *conv_bn(cin, filters, 1, 1), nn.ReLU()]
            cin = filters
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, cout, 3, stride), nn.ReLU(),
                                      *conv_bn(cout, cout, 3, 1))
            same = stride == 1 and cin == cout
            self.short = nn.Identity() if same else nn.Sequential(*conv_bn(cin, cout, 1, stride))

        def forward(self, x):
            return torch.relu(self.body(x) + self.short(x))

    layers, cin = [*conv_bn(3, 16, 3, 1), nn.ReLU()], 16
    for filters, stride in STAGES:
        for block in range(2):
            layers.append(Block(cin, filters, stride if block == 0 else 1))
            cin = filters
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


def torch_optimizer(net_name, model):
    """The optimizer nets_models.py gives `net_name`: Adam, AdamW with two groups (no
    decay on biases and batch norms' parameters), or SGD with momentum (all parameters'
    updates in one foreach call, as minigraph's merged_momentum)."""
    import torch

    if net_name in ADAM_NETS:
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if net_name in ADAMW_NETS:
        params = list(model.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                                  {"params": [p for p in params if p.ndim < 2],
                                   "weight_decay": 0.0}], lr=1e-3, weight_decay=WEIGHT_DECAY)
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM,
                           foreach=True)        # minigraph's side merges its updates


def torch_worker(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    model = torch_model(args.net)
    x, y = (torch.from_numpy(a) for a in batch(args.net))
    opt = torch_optimizer(args.net, model)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()

    if args.what == "memory":
        model.train()
        for _ in range(args.warmup):
            step()
        opt.zero_grad(set_to_none=True)
        return {"peak_mb": rss_peak(step, args.mem_steps)}

    def infer():
        with torch.inference_mode():
            model(x)

    def train_step():               # a training step in train mode, then back to eval
        model.train()
        step()
        model.eval()

    if args.what == "profile":
        from op_profile import STEPS, torch_profile

        for _ in range(args.warmup):
            train_step()
            infer()
        return torch_profile(train_step, infer, STEPS)
    model.train()
    for _ in range(args.warmup):
        step()
    model.eval()
    for _ in range(args.warmup):
        infer()
    serve(lockstep_commands(step, infer, args.repeat, args.warmup, args.block,
                            between=train_step, modes=(model.train, model.eval)))
