"""Train a small conv net with batch norm on scikit-learn's 8x8 digits.

conv(16, 3x3, pad 1) -> batch_norm -> relu -> max pool 2 -> fc(64) -> batch_norm
-> relu -> fc(10), trained with momentum SGD (learning rate on a cosine decay)
in a plain `net.train` loop; after every epoch `net.infer` measures the
held-out accuracy. Writes a picture of the
net (net.svg, one box per layer, or every op with `--level op`; drawn by
Graphviz's dot or the pip-installed graphviz-pure) and a loss/accuracy plot;
`--profile` also times training steps of the trained net, prints where the
time goes and writes profile.svg (the layers coloured by their share).

Run it with `minigraph demo` or `python -m minigraph.examples.train_digits`;
`--model resnet` trains the residual net of train_resnet_digits instead.
Besides the picture and the plot, the demo writes the trained net with its
batch norms folded as an inference model directory (model/) and as
model.onnx.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np

import minigraph as mg
from minigraph import data, layers
from minigraph.cli import Parser, fail, int_at_least, out_folder_problem

DEFAULT_EPOCHS = 6
DEFAULT_BATCH_SIZE = 32
DEFAULT_OUT = "demo_out"
PROFILE_STEPS = 10
PROG = "python -m minigraph.examples.train_digits"
LEARNING_RATE = 0.05
HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 0


def load_digits_split(held_out=HELD_OUT_FRACTION):
    """(train_x, train_y, test_x, test_y): the 1797 digits bundled with
    scikit-learn (no download), scaled to [0, 1] float32 of shape (-1, 1, 8, 8)
    with int64 labels; a fixed split keeps `held_out` of each class apart."""
    train, test = (data.datasets.digits(split, held_out, SPLIT_SEED).arrays
                   for split in ("train", "test"))
    return train["image"], train["label"], test["image"], test["label"]


def build_net(place=None, seed=0, learning_rate=LEARNING_RATE, momentum=0.9, optimizer=None,
              fuse=True):
    """(net, handles): the digits net on `place`, its parameters seeded by
    `seed`, minimised with `optimizer` (default Momentum(learning_rate, momentum)).
    fuse: each batch norm and its relu run as one batch_norm_relu op
    (mg.passes.fuse_batch_norm_relu; the same values, one pass over the tensor
    fewer each way). handles: image, label, logits, loss."""
    net = mg.Net(place=place, seed=seed)
    image = layers.data(net, "image", shape=(-1, 1, 8, 8))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, image, num_filters=16, filter_size=3, padding=1, name="conv1")
    h = layers.relu(net, layers.batch_norm(net, h, name="bn1"))
    h = layers.pool2d(net, h, pool_size=2, pool_type="max")
    h = layers.fc(net, h, size=64, name="fc1")
    h = layers.relu(net, layers.batch_norm(net, h, name="bn2"))
    logits = layers.fc(net, h, size=10, name="fc2")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    if fuse:
        mg.passes.fuse_batch_norm_relu(net)
    if optimizer is None:
        optimizer = mg.optimizer.Momentum(learning_rate=learning_rate, momentum=momentum)
    optimizer.minimize(net, loss)
    return net, {"image": image, "label": label, "logits": logits, "loss": loss}


def accuracy(net, logits, x, y, batch_size=512):
    """Fraction of `x` that the infer branch classifies as `y`."""
    correct = 0
    for start in range(0, len(x), batch_size):
        (out,) = net.infer(feed={"image": x[start:start + batch_size]}, fetch=[logits])
        correct += int((out.argmax(axis=1) == y[start:start + batch_size]).sum())
    return correct / len(x)


def train(epochs=DEFAULT_EPOCHS, device="cpu", out_dir=DEFAULT_OUT,
          batch_size=DEFAULT_BATCH_SIZE, seed=0, progress=True, place=None, model="digits",
          level="layer", profile=False):
    """Train, evaluate after each epoch, write the picture, the plot and the
    deployable models (write_outputs); level: the picture's, "layer" or "op";
    profile=True: also profile training steps on a batch (write_profile).

    model: "digits" (this module's net) or "resnet" (the residual net of
    minigraph.examples.train_resnet_digits). device: "cpu" or "gpu"
    (mg.GPUPlace(0)); `place` overrides it. Returns a history dict: loss (mean
    training loss per epoch), accuracy (held-out, per epoch), seconds (training
    wall time) and files (what was written).
    """
    if place is None:
        place = mg.GPUPlace(0) if device == "gpu" else mg.CPUPlace()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if model == "resnet":
        from minigraph.examples import train_resnet_digits

        net, h, history = train_resnet_digits.train(epochs, place=place, batch_size=batch_size,
                                                    seed=seed, progress=progress)
    else:
        net, h, history = train_loop(epochs, place, batch_size, seed, progress)
    feed = None
    if profile:
        train_x, train_y = load_digits_split()[:2]
        feed = {h["image"]: train_x[:batch_size], h["label"]: train_y[:batch_size]}
    history["files"] = write_outputs(net, h, history, out, level, feed)
    return history


def train_loop(epochs, place, batch_size, seed, progress):
    """The digits net's training loop: (net, handles, history)."""
    from tqdm import tqdm

    train_x, train_y, test_x, test_y = load_digits_split()
    net, h = build_net(place, seed)
    loader = data.DataLoader(data.ArrayDataset(image=train_x, label=train_y), batch_size,
                             shuffle=True, seed=seed)
    steps = len(loader)
    history = {"loss": [], "accuracy": [], "seconds": 0.0}
    start = time.perf_counter()
    bar = tqdm(total=epochs * steps, disable=not progress, unit="batch", leave=False,
               file=sys.stderr)
    for epoch in range(1, epochs + 1):
        # cosine decay over the run, one step per epoch
        net.optimizer.set_learning_rate(
            LEARNING_RATE * 0.5 * (1 + math.cos(math.pi * (epoch - 1) / epochs)))
        loader.set_epoch(epoch - 1)
        losses = []
        for feed in loader:
            if len(feed["label"]) < 2:            # batch norm needs two rows to train
                continue
            (loss,) = net.train(feed=feed, fetch=[h["loss"]])
            losses.append(float(loss))
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}")
        acc = accuracy(net, h["logits"], test_x, test_y)
        history["loss"].append(float(np.mean(losses)))
        history["accuracy"].append(acc)
        bar.write(f"epoch {epoch}/{epochs}  loss {history['loss'][-1]:.4f}  "
                  f"held-out accuracy {100 * acc:.1f}% ({len(test_y)} digits)")
    bar.close()
    history["seconds"] = time.perf_counter() - start
    return net, h, history


def write_outputs(net, h, history, out, level="layer", profile_feed=None):
    """net.svg (at `level`), training.png, profile.svg when `profile_feed` is given
    (write_profile), and the deployable models of the trained net with its batch
    norms folded: the inference model directory `model/` (mg.io) and
    `model.onnx` (when the onnx package is installed). Returns the paths."""
    files = [write_picture(net, out, level), write_plot(history, out / "training.png")]
    if profile_feed is not None:
        files += write_profile(net, h, profile_feed, out)
    folded = mg.passes.fold_batch_norm(net)
    logits = h["logits"].name
    files.append(mg.io.save_inference(folded, out / "model", feeds=["image"], fetches=[logits]))
    try:
        files.append(mg.onnx.export(folded, out / "model.onnx", feeds=["image"],
                                    fetches=[logits]))
    except ImportError as e:
        print(f"note: no model.onnx ({e})")
    count = sum(note.folded for note in folded.reports["fold_batch_norm"])
    print(f"deployable: {count} batch norms folded and the loss left out "
          f"({len(net.ops('infer'))} -> {len(folded.ops('infer'))} inference ops). Open "
          "model.onnx in Netron "
          f"(https://netron.app) or run it with onnxruntime; load {out / 'model'} with "
          f"mg.io.load_inference(...).infer(feed={{'image': x}})")
    return files


def write_picture(net, out, level="layer"):
    """net.svg in `out` at `level` ("layer": a box per layer, "op": every op), drawn
    by Graphviz's `dot` or, without it, by the pip-installed graphviz-pure; net.dot
    (and a note saying why) only when neither can render."""
    try:
        return net.render(out / "net.svg", level=level)
    except RuntimeError as e:
        path = out / "net.dot"
        path.write_text(net.to_dot(level=level))
        print(f"note: could not draw net.svg, so wrote {path} instead ({e})")
        return path


def write_profile(net, h, feed, out):
    """Profile PROFILE_STEPS training steps of `net` on `feed` (the net is left as
    it was): print the table of time per op type and per layer, and write
    profile.svg, the layer view coloured by each layer's share of the step.
    Returns [profile.svg], or [] (with a note) when nothing can render."""
    table = net.profile(feed, steps=PROFILE_STEPS, fetch=[h["loss"]])
    print(table)
    try:
        return [net.render(out / "profile.svg", level="layer", profile=table)]
    except RuntimeError as e:
        print(f"note: could not draw profile.svg ({e})")
        return []


def write_plot(history, path):
    """A two-panel plot of the training loss and held-out accuracy per epoch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = range(1, len(history["loss"]) + 1)
    fig = Figure(figsize=(8, 3.2))
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, history["loss"], marker="o")
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", title="loss")
    ax_acc.plot(epochs, [100 * a for a in history["accuracy"]], marker="o", color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="held-out accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def add_arguments(parser):
    """The demo's options (shared with `minigraph demo`); each value is checked
    as it is parsed (see check_arguments for the --out folder)."""
    parser.add_argument("--epochs", type=int_at_least(1), default=DEFAULT_EPOCHS,
                        help=f"training epochs, >= 1 (default {DEFAULT_EPOCHS})")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="where to run: cpu (default) or gpu (GPU 0)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for what the demo writes, created if missing (default "
                             f"{DEFAULT_OUT}): net.svg, training.png, model/ (an inference "
                             "model), model.onnx, and profile.svg with --profile")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the "
                        "parameters and the batch order, >= 0 (default 0)")
    parser.add_argument("--batch-size", type=int_at_least(2, " (batch norm needs two rows)"),
                        default=DEFAULT_BATCH_SIZE,
                        help=f"training batch size, >= 2 (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--model", choices=("digits", "resnet", "gpt"), default="digits",
                        help="digits: conv-bn-relu-pool-fc-bn-relu-fc with Momentum (default); "
                             "resnet: a residual CNN with add, concat, global pooling, dropout, "
                             "AdamW, a cosine schedule and clipping; gpt: a character-level "
                             "GPT on Python's own help text (minigraph.examples.train_gpt; "
                             "--epochs, --seed, --out, --level)")
    parser.add_argument("--level", choices=("layer", "op"), default="layer",
                        help="net.svg shows one box per layer (default) or every op and "
                             "variable (op)")
    parser.add_argument("--profile", action="store_true",
                        help=f"after training, time {PROFILE_STEPS} training steps: print the "
                             "time per op type and per layer, write profile.svg")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def check_arguments(args):
    """[(option, problem)] for parsed `args`: the ranges of add_arguments (for
    args made by hand) and whether files can be written into --out."""
    problems = []
    for option, value, minimum in (("--epochs", args.epochs, 1), ("--seed", args.seed, 0),
                                   ("--batch-size", args.batch_size, 2)):
        if not isinstance(value, int) or value < minimum:
            problems.append((option, f"must be an integer >= {minimum}, got {value!r}"))
    if args.device not in ("cpu", "gpu"):
        problems.append(("--device", f"must be cpu or gpu, got {args.device!r}"))
    gpt = getattr(args, "model", "digits") == "gpt"
    rows = training_rows() if isinstance(args.batch_size, int) and not gpt else None
    if rows is not None and args.batch_size > rows:
        problems.append(("--batch-size", f"must be at most the {rows} training images (one "
                                         f"batch per epoch), got {args.batch_size}"))
    problem = out_folder_problem(args.out)
    if problem:
        problems.append(("--out", problem))
    return problems


def training_rows():
    """The number of training images (None without scikit-learn, which the demo needs)."""
    if importlib.util.find_spec("sklearn") is None:
        return None
    return len(load_digits_split()[1])


def run(args):
    """Run the demo for parsed `args`; prints the result; returns an exit code
    (2 with a one-line error for a bad argument, 1 when the demo cannot run here)."""
    problems = check_arguments(args)
    if problems:
        return fail(PROG, *problems[0])
    if getattr(args, "model", "digits") == "gpt":
        from minigraph.examples import train_gpt

        return train_gpt.run_demo(args)
    missing = [m for m in ("sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: the demo needs {' and '.join(missing)}: pip install 'minigraph[demo]'",
              file=sys.stderr)
        return 1
    try:
        place = mg.GPUPlace(0) if args.device == "gpu" else mg.CPUPlace()
    except mg.GPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    history = train(epochs=args.epochs, out_dir=args.out, batch_size=args.batch_size,
                    seed=args.seed, progress=not args.no_progress, place=place,
                    model=getattr(args, "model", "digits"),
                    level=getattr(args, "level", "layer"),
                    profile=getattr(args, "profile", False))
    print(f"held-out accuracy {100 * history['accuracy'][-1]:.1f}% after {args.epochs} "
          f"epochs ({history['seconds']:.1f} s on {place!r})")
    print("wrote " + ", ".join(str(p) for p in history["files"]))
    return 0


def parse(parser, argv):
    """Parse `argv` with a parser built by add_arguments, then check --out the
    same way (parser.error: one line, exit code 2)."""
    args = parser.parse_args(argv)
    problems = check_arguments(args)
    if problems:
        option, problem = problems[0]
        parser.error(f"argument {option}: {problem}")
    return args


def main(argv=None):
    """Command-line entry point; returns the exit code."""
    parser = add_arguments(Parser(prog=PROG, description=__doc__.split("\n")[0]))
    try:
        args = parse(parser, argv)
    except SystemExit as e:
        return e.code
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
