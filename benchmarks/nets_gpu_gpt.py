"""The GPT case of benchmarks/nets_gpu.py, on both sides.

The net is minigraph.examples.train_gpt's GPT at the example's default config (4
layers, 4 heads, 128 dims, context 128, dropout 0.1) trained with its recipe (AdamW in
parameter groups, warm-up then cosine, clipping by global norm, GradientMerge over 2
steps: an update every second step), on `n` windows of pydoc_data.topics
(gpt_torch.text_batches, seeded). The PyTorch twin is gpt_torch_side.torch_gpt with
gpt_torch_side.recipe, from the same initial weights (the minigraph net's, built on
the CPU) and the same batch; its attention is PyTorch's default dispatch on the GPU
(its fused kernels), the strongest eager peer.

A training step is one net.train fetching the loss (PyTorch: the recipe's step, the
batch copied with `.to(dev)` and the loss read with `.item()`). Inference is the
batch's logits (N, T, vocab) copied to the host: minigraph's infer branch (dropout
off) through net.infer, PyTorch's model in eval mode under torch.inference_mode.
"""
from __future__ import annotations

import dataclasses

NAME = "gpt"
BATCH = 32                   # the example's batch_size
UPDATES = 1000               # the schedule's length (the timed steps stay in its warm-up)


def config():
    """The example's default Config."""
    from minigraph.examples.train_gpt import Config

    return Config()


def gpt_batch(n, seed=0):
    """(tokens, targets, vocabulary size): n windows of the default context, int64."""
    from gpt_torch import text_batches

    cfg = dataclasses.replace(config(), batch_size=n)
    batches, vocab = text_batches(cfg, 1, seed)
    tokens, targets = batches[0]
    return tokens, targets, vocab


def mg_train_net(vocab, place=None):
    """(net, handles) of the GPT with the example's optimizer, on `place`."""
    from minigraph.examples import train_gpt as G

    cfg = config()
    net, h = G.build_gpt(vocab, cfg, place=place)
    G.make_optimizer(cfg, UPDATES).minimize(net, h["loss"],
                                            parameters=G.param_groups(net, cfg.weight_decay))
    return net, h


def mg_case(place, tracker, n, args, timed):
    """{train, infer (ms), peak_mib} of the GPT at batch n on `place` (TF32 as set)."""
    tokens, targets, vocab = gpt_batch(n)
    net, h = mg_train_net(vocab, place)
    feed = {"tokens": tokens, "targets": targets}
    for _ in range(args.warmup + 3):            # past the plan's capture (minigraph/replay.py)
        net.train(feed=feed, fetch=[h["loss"]])
    tracker.reset()

    def step():
        net.train(feed=feed, fetch=[h["loss"]])
        tracker.sample()
    train = timed(step, args.repeat, 0)
    peak = tracker.peak / 2**20
    infer = timed(lambda: net.infer(feed={"tokens": tokens}, fetch=[h["logits"]]),
                  args.repeat, args.warmup + 3)
    return {"train": train, "infer": infer, "peak_mib": peak}


def mg_profile_feed(n, place):
    """(net, feed) of one GPT training step at batch n, for net.profile."""
    tokens, targets, vocab = gpt_batch(n)
    net, _ = mg_train_net(vocab, place)
    return net, {"tokens": tokens, "targets": targets}


def initial_weights(vocab):
    """The minigraph net's initial parameters ({name: float32 array}), built on the CPU."""
    from minigraph.examples import train_gpt as G

    net, _ = G.build_gpt(vocab, config())
    return {p.name: p.get() for p in net.parameters()}


def torch_case(n, args, timed, device="cuda"):
    """{train, infer (ms), peak_mib} of the PyTorch twin at batch n on `device` (TF32 as
    the caller set it; peak_mib 0 off a GPU)."""
    import torch
    from gpt_torch_side import recipe, torch_gpt

    cfg = config()
    tokens, targets, vocab = gpt_batch(n)
    dev = torch.device(device)
    model = torch_gpt(torch, initial_weights(vocab), cfg, vocab, torch.float32).to(dev)
    update = recipe(torch, model, cfg, UPDATES)
    xh, yh = torch.from_numpy(tokens), torch.from_numpy(targets)
    on_gpu = dev.type == "cuda"

    def step():
        update(xh.to(dev), yh.to(dev)).item()

    model.train()
    for _ in range(args.warmup + 3):
        step()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    train = timed(step, args.repeat, 0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if on_gpu else 0.0
    model.eval()

    def infer():
        with torch.inference_mode():
            model.logits(xh.to(dev)).cpu()

    return {"train": train, "infer": timed(infer, args.repeat, args.warmup + 3),
            "peak_mib": peak}
