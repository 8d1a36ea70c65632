"""The PyTorch side of benchmarks/gpt_torch.py: the same GPT (minigraph.examples.train_gpt),
recipe, initial weights and batches, timed and measured the same way, in a process of
its own (gpt_torch.py runs this through its --worker pytorch mode; PyTorch is a
benchmark-only dependency). Attention runs on PyTorch's math path (sdpa_kernel(MATH)):
the same algorithm the decomposed export spells out, the whole score matrix in memory."""
from __future__ import annotations

import numpy as np
from peak_memory import rss_peak
from timing import median_ms


def torch_gpt(torch, weights, cfg, vocab, dtype):
    """An nn.Module computing train_gpt.build_gpt's net, its parameters set from the
    minigraph parameter values `weights` ({name: array}; a linear's w is (in, out)):
    model(tokens, targets) is the loss, model.logits(tokens) the logits (N, T, vocab)."""
    import torch.nn.functional as F
    from torch import nn

    def param(name, transpose=False):
        a = weights[name].T if transpose else weights[name]
        return nn.Parameter(torch.tensor(np.ascontiguousarray(a), dtype=dtype))

    class Linear(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.weight, self.bias = param(f"{name}.w", True), param(f"{name}.b")

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    class Norm(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.weight, self.bias = param(f"{name}.scale"), param(f"{name}.bias")

        def forward(self, x):
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-5)

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.ln1, self.ln2 = Norm(f"h{i}.ln1"), Norm(f"h{i}.ln2")
            self.q, self.k, self.v = (Linear(f"h{i}.attn.{s}") for s in "qkv")
            self.out = Linear(f"h{i}.attn.out")
            self.fc, self.proj = Linear(f"h{i}.fc"), Linear(f"h{i}.proj")

        def forward(self, h):
            n, t, d = h.shape
            a = self.ln1(h)
            q, k, v = (m(a).view(n, t, cfg.heads, d // cfg.heads).transpose(1, 2)
                       for m in (self.q, self.k, self.v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=cfg.dropout if self.training else 0.0)
            h = h + self.out(o.transpose(1, 2).reshape(n, t, d))
            return h + self.proj(F.gelu(self.fc(self.ln2(h))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = param("wte.w"), param("wpe.w")
            self.blocks = nn.ModuleList(Block(i) for i in range(cfg.layers))
            self.ln_f = Norm("ln_f")

        def logits(self, tokens):
            h = F.embedding(tokens, self.wte) + self.wpe[:tokens.shape[1]]
            for block in self.blocks:
                h = block(h)
            return self.ln_f(h) @ self.wte.T

        def forward(self, tokens, targets):
            logits = self.logits(tokens)
            return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    return GPT()


def param_groups(model, weight_decay):
    """train_gpt.param_groups' split: decay on the linear layers' weights only."""
    decay = [p for n, p in model.named_parameters()
             if n.endswith("weight") and p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    ids = {id(p) for p in decay}
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if id(p) not in ids],
             "weight_decay": 0.0}]


def recipe(torch, model, cfg, updates):
    """AdamW in groups, the warm-up + cosine of train_gpt.make_optimizer (as a LambdaLR of
    minigraph's closed form), clipping, accumulation over cfg.accumulate steps."""
    from minigraph.optimizer import lr as mg_lr

    warmup = min(cfg.warmup, max(updates - 1, 0))
    schedule = mg_lr.CosineDecay(cfg.learning_rate, max(updates, 1),
                                 end_lr=cfg.learning_rate / 10, warmup_steps=warmup)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.learning_rate,
                            betas=(0.9, 0.99), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: schedule.value(t) / cfg.learning_rate)
    count = [0]

    def step(tokens, targets):
        loss = model(tokens, targets)
        (loss / cfg.accumulate).backward()
        count[0] += 1
        if count[0] % cfg.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        return loss.detach()
    return step


def torch_losses(args, cfg, weights, batches, vocab):
    """The float64 losses of len(batches) steps of the recipe."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(args.threads)
    model = torch_gpt(torch, weights, cfg, vocab, torch.float64)
    step = recipe(torch, model, cfg, len(batches) // cfg.accumulate)
    losses = []
    with sdpa_kernel(SDPBackend.MATH):
        for tokens, targets in batches:
            losses.append(float(step(torch.from_numpy(tokens), torch.from_numpy(targets))))
    return {"losses": losses}


def torch_step_time(args, cfg, weights, batch, vocab):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(args.threads)
    model = torch_gpt(torch, weights, cfg, vocab, torch.float32)
    step = recipe(torch, model, cfg, 1000)
    tokens, targets = (torch.from_numpy(a) for a in batch)
    with sdpa_kernel(SDPBackend.MATH):
        return {"train": median_ms(lambda: float(step(tokens, targets)), args.repeat,
                                   args.warmup, cycle=cfg.accumulate)}


def torch_attention(args, shape):
    """Forward + backward of the math path's attention (causal) on (N, H, T, d): the
    median time, and the peak resident memory above the inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, generator=g)

    def run():
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

    if args.what == "memory":
        run()
        q.grad = k.grad = v.grad = None
        return {"peak_mb": rss_peak(run, 1)}
    return {"ms": median_ms(run, args.repeat, args.warmup)}

