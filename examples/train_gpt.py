"""Train a character-level GPT on the text that ships with every Python.

The text is pydoc_data.topics (the help pages of the language: about 465,000
characters of English and code; nothing is downloaded). The model, by default 4 layers,
4 heads, 128 dims and a context of 128 characters:

    tokens -> embedding wte (vocab, 128) + position table wpe (128, 128)
    4 x [ h + multi_head_attention(layer_norm(h), causal)
          h + linear(gelu(linear(layer_norm(h), 512)), 128) ]
    layer_norm -> logits = h @ wte^T (the output projection tied to the embedding)

trained with AdamW in parameter groups (weight decay on the linear layers' weights
only; none on biases, norms and embeddings), a linear warm-up then a cosine schedule,
gradient clipping by global norm and GradientMerge (gradients summed over k steps), fed
by a minigraph.data.DataLoader over windows of the first 90% of the text; the last 10%
is held out. Every epoch it prints the training and held-out loss (nats per character)
against the unigram baseline (the held-out text's cross-entropy under the training
text's character frequencies: what a model that ignores context gets) and a sample
generated with the KV cache (temperature and top-k). It writes gpt.svg, the layer view
of the net.

Run it with `python -m minigraph.examples.train_gpt` or `minigraph demo --model gpt`
(a few minutes on 2 CPU threads).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import minigraph as mg
from minigraph import data, layers
from minigraph.cli import Parser, fail, int_at_least, out_folder_problem
from minigraph.generation import generate

PROG = "python -m minigraph.examples.train_gpt"
HELD_OUT_FRACTION = 0.1
PROMPT = "The "


@dataclass(frozen=True)
class Config:
    """The model and the recipe."""

    layers: int = 4
    heads: int = 4
    width: int = 128
    context: int = 128
    dropout: float = 0.1
    batch_size: int = 32
    accumulate: int = 2               # GradientMerge's k
    learning_rate: float = 3e-3       # the peak, after the warm-up
    warmup: int = 20                  # updates
    weight_decay: float = 0.1
    clip: float = 1.0
    epochs: int = 6
    steps_per_epoch: int = 0          # 0: every window of the training text
    eval_windows: int = 64
    sample_chars: int = 120           # at most context - len(PROMPT): the cache's room
    temperature: float = 0.8
    top_k: int = 20
    seed: int = 0
    threads: int = 2


DEMO = Config(batch_size=16, steps_per_epoch=40, eval_windows=48)


# ---- the text ---------------------------------------------------------------------------

def load_text():
    """The help pages of pydoc_data.topics, in key order, as one string."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class Vocab:
    """The characters of a text, sorted: encode (str -> int64 ids) and decode."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self):
        return len(self.chars)

    def encode(self, text):
        return np.array([self.index[c] for c in text], np.int64)

    def decode(self, ids):
        return "".join(self.chars[int(i)] for i in ids)


def split(ids, held_out=HELD_OUT_FRACTION):
    """(train ids, held-out ids): the text's last `held_out` fraction is held out."""
    cut = int(len(ids) * (1 - held_out))
    return ids[:cut], ids[cut:]


def windows(ids, context):
    """Non-overlapping windows of context + 1 ids as an ArrayDataset of tokens (the first
    context) and targets (the next character of each)."""
    count = (len(ids) - 1) // context
    starts = np.arange(count) * context
    w = ids[starts[:, None] + np.arange(context + 1)]
    return data.ArrayDataset(tokens=w[:, :-1], targets=w[:, 1:])


def unigram_baseline(train_ids, held_ids, vocab_size):
    """The held-out text's cross-entropy (nats per character) under the training text's
    character frequencies (add-one smoothed): a model that ignores context."""
    counts = np.bincount(train_ids, minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_ids].mean())


# ---- the model and the recipe --------------------------------------------------------------

def build_gpt(vocab_size, cfg=Config(), place=None, cache=None, dtype="float32"):
    """(net, handles) of the GPT of the module doc; handles: tokens, targets (data,
    (-1, -1) int64), logits (N, T, vocab) and loss (the mean cross-entropy). cache: a
    layers.KVCache for generation (the infer branch's)."""
    net = mg.Net(place=place, seed=cfg.seed)
    tokens = layers.data(net, "tokens", (-1, -1), "int64")
    targets = layers.data(net, "targets", (-1, -1), "int64")
    small = mg.ParamAttr(initializer=mg.initializer.Normal(0.0, 0.02))
    h = layers.embedding(net, tokens, vocab_size, cfg.width, param_attr=mg.ParamAttr(
        name="wte.w", initializer=mg.initializer.Normal(0.0, 0.02)), dtype=dtype, name="wte")
    h = layers.position_embedding(net, h, cfg.context, kv_cache=cache, param_attr=small,
                                  name="wpe")
    for i in range(cfg.layers):
        a = layers.layer_norm(net, h, begin_norm_axis=2, name=f"h{i}.ln1")
        a = layers.multi_head_attention(net, a, cfg.heads, causal=True, dropout=cfg.dropout,
                                        kv_cache=cache, name=f"h{i}.attn")
        h = layers.add(net, h, a, name=f"h{i}.res1")
        m = layers.layer_norm(net, h, begin_norm_axis=2, name=f"h{i}.ln2")
        m = layers.gelu(net, layers.linear(net, m, 4 * cfg.width, name=f"h{i}.fc"))
        m = layers.linear(net, m, cfg.width, name=f"h{i}.proj")
        h = layers.add(net, h, m, name=f"h{i}.res2")
    h = layers.layer_norm(net, h, begin_norm_axis=2, name="ln_f")
    logits = layers.matmul(net, h, net.var("wte.w"), transpose_y=True, name="logits")
    flat = layers.reshape(net, logits, (-1, vocab_size))
    loss = layers.mean(net, layers.softmax_with_cross_entropy(
        net, flat, layers.reshape(net, targets, (-1,))), name="loss")
    mg.passes.fuse_fc(net)      # the infer branch's linear layers as one op each (generation)
    return net, {"tokens": tokens, "targets": targets, "logits": logits, "loss": loss}


def param_groups(net, weight_decay):
    """AdamW's groups: decay on the linear layers' weights (`.w` of 2-D tables other than
    the embeddings), none on biases, norms and the embedding tables."""
    decay, no_decay = [], []
    for p in net.parameters():
        is_embedding = p.name.split(".")[0] in ("wte", "wpe")
        (decay if p.name.endswith(".w") and len(p.shape) == 2 and not is_embedding
         else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(cfg, updates):
    """GradientMerge(AdamW) with a linear warm-up over cfg.warmup updates, then a cosine
    down to a tenth of the peak over `updates`, and clipping by global norm."""
    warmup = min(cfg.warmup, max(updates - 1, 0))
    schedule = mg.optimizer.lr.CosineDecay(cfg.learning_rate, max(updates, 1),
                                           end_lr=cfg.learning_rate / 10, warmup_steps=warmup)
    inner = mg.optimizer.AdamW(schedule, beta2=0.99, weight_decay=cfg.weight_decay,
                               grad_clip=mg.optimizer.ClipGradByGlobalNorm(cfg.clip))
    return mg.optimizer.GradientMerge(inner, cfg.accumulate)


# ---- training ------------------------------------------------------------------------------

def held_out_loss(net, h, loader, count, cache):
    """The mean loss over the first `count` windows the held-out `loader` gives (the
    infer branch: no dropout; the cache emptied before each full pass)."""
    total, seen = 0.0, 0
    for feed in loader:
        if seen >= count:
            break
        cache.reset()
        (loss,) = net.infer(feed=feed, fetch=[h["loss"]])
        total += float(loss) * len(feed["tokens"])
        seen += len(feed["tokens"])
    return total / seen


def train(cfg=Config(), out_dir="gpt_out", progress=True, place=None, level="layer"):
    """Train and report as the module doc says; returns a history dict: train_loss and
    held_out_loss per epoch, baseline, samples, seconds, files."""
    from tqdm import tqdm

    mg.set_num_threads(cfg.threads)
    text = load_text()
    vocab = Vocab(text)
    train_ids, held_ids = split(vocab.encode(text))
    train_set, held_set = windows(train_ids, cfg.context), windows(held_ids, cfg.context)
    loader = data.DataLoader(train_set, cfg.batch_size, shuffle=True, drop_last=True,
                             seed=cfg.seed)
    held_loader = data.DataLoader(held_set, 16)
    steps = min(len(loader), cfg.steps_per_epoch) if cfg.steps_per_epoch else len(loader)
    cache = layers.KVCache(cfg.context)
    net, h = build_gpt(len(vocab), cfg, place=place, cache=cache)
    optimizer = make_optimizer(cfg, cfg.epochs * steps // cfg.accumulate)
    optimizer.minimize(net, h["loss"], parameters=param_groups(net, cfg.weight_decay))
    baseline = unigram_baseline(train_ids, held_ids, len(vocab))
    params = sum(p.get().size for p in net.parameters())
    print(f"{len(text):,} characters of pydoc_data.topics, {len(vocab)} distinct; "
          f"{len(train_set)} training windows of {cfg.context}, {len(held_set)} held out; "
          f"{params:,} parameters")
    print(f"unigram baseline (held-out cross-entropy of the character frequencies): "
          f"{baseline:.3f} nats/char")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    history = {"train_loss": [], "held_out_loss": [], "baseline": baseline, "samples": []}
    start = time.perf_counter()
    bar = tqdm(total=cfg.epochs * steps, disable=not progress, unit="step", leave=False,
               file=sys.stderr)
    prompt = vocab.encode(PROMPT)[None, :]
    for epoch in range(cfg.epochs):
        loader.set_epoch(epoch)
        losses = []
        for step, feed in enumerate(loader):
            if step == steps:
                break
            (loss,) = net.train(feed=feed, fetch=[h["loss"]])
            losses.append(float(loss))
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.3f}")
        held = held_out_loss(net, h, held_loader, cfg.eval_windows, cache)
        ids = generate(net, h["tokens"], h["logits"], prompt,
                       min(cfg.sample_chars, cfg.context - prompt.shape[1]),
                       temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed + epoch,
                       kv_cache=cache)
        sample = vocab.decode(ids[0])
        history["train_loss"].append(float(np.mean(losses)))
        history["held_out_loss"].append(held)
        history["samples"].append(sample)
        verdict = "below" if held < baseline else "above"
        bar.write(f"epoch {epoch + 1}/{cfg.epochs}  train loss {history['train_loss'][-1]:.3f}"
                  f"  held-out loss {held:.3f} ({verdict} the unigram baseline {baseline:.3f})"
                  f"  lr {optimizer.learning_rate:.2e}")
        bar.write("  sample: " + repr(sample))
    bar.close()
    history["seconds"] = time.perf_counter() - start
    history["files"] = [write_picture(net, out, level)]
    return history


def write_picture(net, out, level="layer"):
    """gpt.svg in `out`, the net at `level` ("layer": a box per layer); gpt.dot (and a
    note saying why) when nothing can render."""
    try:
        return net.render(out / "gpt.svg", level=level)
    except RuntimeError as e:
        path = out / "gpt.dot"
        path.write_text(net.to_dot(level=level))
        print(f"note: could not draw gpt.svg, so wrote {path} instead ({e})")
        return path


# ---- the command line ---------------------------------------------------------------------

def add_arguments(parser):
    """This example's options."""
    c = Config()
    parser.add_argument("--epochs", type=int_at_least(1), default=c.epochs,
                        help=f"epochs, >= 1 (default {c.epochs})")
    parser.add_argument("--steps-per-epoch", type=int_at_least(0), default=c.steps_per_epoch,
                        help="training steps per epoch, 0 for every window (default 0)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=c.batch_size,
                        help=f"windows per step, >= 1 (default {c.batch_size})")
    parser.add_argument("--context", type=int_at_least(2), default=c.context,
                        help=f"characters of context, >= 2 (default {c.context})")
    parser.add_argument("--layers", type=int_at_least(1), default=c.layers,
                        help=f"transformer blocks (default {c.layers})")
    parser.add_argument("--threads", type=int_at_least(1), default=c.threads,
                        help=f"CPU threads (default {c.threads})")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed (default 0)")
    parser.add_argument("--out", default="gpt_out", help="folder for gpt.svg (default gpt_out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run_demo(args):
    """`minigraph demo --model gpt`: DEMO's shorter run with the demo's --epochs, --seed,
    --device, --out, --level and --no-progress (the digits' --batch-size and --profile
    are not used here)."""
    cfg = Config(**{**DEMO.__dict__, "epochs": args.epochs, "seed": args.seed})
    try:
        place = mg.GPUPlace(0) if getattr(args, "device", "cpu") == "gpu" else None
    except mg.GPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return _report(train(cfg, args.out, progress=not args.no_progress, place=place,
                         level=getattr(args, "level", "layer")))


def _report(history):
    held, baseline = history["held_out_loss"][-1], history["baseline"]
    print(f"held-out loss {held:.3f} nats/char after {len(history['held_out_loss'])} epochs, "
          f"{'below' if held < baseline else 'NOT below'} the unigram baseline "
          f"{baseline:.3f} ({history['seconds']:.0f} s)")
    print("wrote " + ", ".join(str(p) for p in history["files"]))
    return 0


def main(argv=None):
    """Command-line entry point; returns the exit code."""
    parser = add_arguments(Parser(prog=PROG, description=__doc__.split("\n")[0]))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    problem = out_folder_problem(args.out)
    if problem:
        return fail(PROG, "--out", problem)
    cfg = Config(epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                 batch_size=args.batch_size, context=args.context, layers=args.layers,
                 threads=args.threads, seed=args.seed)
    return _report(train(cfg, args.out, progress=not args.no_progress))


if __name__ == "__main__":
    sys.exit(main())

