"""Train a small residual CNN on scikit-learn's 8x8 digits.

    stem:   conv 16 3x3 -> batch_norm -> relu                           (16, 8, 8)
    block:  conv-bn-relu-conv-bn + identity shortcut (add) -> relu      (16, 8, 8)
    mixed:  concat(conv 1x1, conv 3x3) -> batch_norm -> relu            (32, 8, 8)
    down:   conv-bn-relu-conv-bn (stride 2) + 1x1 projection (add)     (32, 4, 4)
    head:   global average pool -> flatten -> dropout 0.2 -> fc 10

trained with AdamW (decoupled weight decay), a cosine learning-rate schedule
with warm-up and gradient clipping by global norm, in a plain `net.train`
loop fed by a minigraph.data.DataLoader (shuffled by seed and epoch, batches
made on a background thread); `net.infer` measures held-out accuracy after
every epoch (the same fixed split as the plain demo). Run it with `minigraph
demo --model resnet` or `python -m minigraph.examples.train_resnet_digits`.

`--augment` adds batch augmentation to the loader: a random shift of up to a
pixel (RandomCrop(8, padding=1)) and a random mirror (RandomHorizontalFlip(0.5)),
the pipeline natural images such as CIFAR-10 want. It is off by default: on
these centred 8x8 digits it lowers held-out accuracy in short runs (a
mirrored 2 is no 2, and a pixel is an eighth of the image; docs/data.md).
"""
from __future__ import annotations

import sys
import time

import numpy as np

import minigraph as mg
from minigraph import data
from minigraph import layers as L
from minigraph.examples.train_digits import accuracy, load_digits_split

DEFAULT_EPOCHS = 12
DEFAULT_BATCH_SIZE = 64
LEARNING_RATE = 0.01
WEIGHT_DECAY = 1e-4
WARMUP_EPOCHS = 1
CLIP_NORM = 2.0
CROP_PADDING = 1
FLIP_P = 0.5


NORMS = ("batch_norm", "group_norm", "sync_batch_norm")
CHANNELS_PER_GROUP = 4          # group_norm's groups: 4 and 8 for the 16- and 32-channel layers


def normalize(net, h, name, norm="batch_norm"):
    """batch_norm (`name.bn`), sync_batch_norm (the same, synchronised over ranks) or
    group_norm with groups of CHANNELS_PER_GROUP channels (`name.gn`)."""
    if norm == "group_norm":
        return L.group_norm(net, h, h.shape[1] // CHANNELS_PER_GROUP, name=f"{name}.gn")
    return L.batch_norm(net, h, name=f"{name}.bn", sync=norm == "sync_batch_norm")


def conv_bn(net, x, filters, size, name, stride=1, relu=True, norm="batch_norm"):
    """conv (no bias: the normalisation has one) -> normalisation (-> relu)."""
    h = L.conv2d(net, x, filters, size, stride=stride, padding=size // 2, bias=False,
                 name=f"{name}.conv")
    h = normalize(net, h, name, norm)
    return L.relu(net, h) if relu else h


def residual(net, x, filters, name, stride=1, norm="batch_norm"):
    """A basic residual block; a 1x1 projection shortcut where the shape changes."""
    h = conv_bn(net, x, filters, 3, f"{name}.a", stride, norm=norm)
    h = conv_bn(net, h, filters, 3, f"{name}.b", relu=False, norm=norm)
    shortcut = x
    if stride != 1 or x.shape[1] != filters:
        shortcut = conv_bn(net, x, filters, 1, f"{name}.proj", stride, relu=False, norm=norm)
    return L.relu(net, L.add(net, h, shortcut, name=f"{name}.add"))


def build_net(place=None, seed=0, epochs=DEFAULT_EPOCHS, steps_per_epoch=23,
              norm="batch_norm", fuse=True):
    """(net, handles): the residual digits net, minimised with AdamW on a cosine
    schedule (warm-up one epoch) with clipping. norm: one of NORMS, the layers'
    normalisation; fuse: each batch norm and its relu run as one op
    (mg.passes.fuse_batch_norm_relu). handles: image, label, logits, loss."""
    if norm not in NORMS:
        raise ValueError(f"build_net: norm must be one of {', '.join(NORMS)}, got {norm!r}")
    net = mg.Net(place=place, seed=seed)
    image = L.data(net, "image", shape=(-1, 1, 8, 8))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = conv_bn(net, image, 16, 3, "stem", norm=norm)
    h = residual(net, h, 16, "block1", norm=norm)
    mixed = L.concat(net, [L.conv2d(net, h, 16, 1, name="mixed.1x1"),
                           L.conv2d(net, h, 16, 3, padding=1, name="mixed.3x3")], axis=1)
    h = L.relu(net, normalize(net, mixed, "mixed", norm))
    h = residual(net, h, 32, "down", stride=2, norm=norm)
    h = L.flatten(net, L.pool2d(net, h, global_pooling=True, pool_type="avg"))
    h = L.dropout(net, h, p=0.2, name="drop")
    logits = L.fc(net, h, 10, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    if fuse:
        mg.passes.fuse_batch_norm_relu(net)
    schedule = mg.optimizer.lr.CosineDecay(LEARNING_RATE, total_steps=epochs * steps_per_epoch,
                                           warmup_steps=WARMUP_EPOCHS * steps_per_epoch)
    mg.optimizer.AdamW(schedule, weight_decay=WEIGHT_DECAY,
                       grad_clip=mg.optimizer.ClipGradByGlobalNorm(CLIP_NORM)).minimize(net, loss)
    return net, {"image": image, "label": label, "logits": logits, "loss": loss}


def make_loader(train_x, train_y, batch_size, seed, augment=False):
    """The training loader: shuffled by (seed, epoch), whole batches only, with a
    random shift (RandomCrop(8, padding=CROP_PADDING)) and a mirror (FLIP_P) of
    each digit when `augment`; sharded across ranks after mg.distributed.init()."""
    augmentation = data.transforms.Compose([
        data.transforms.RandomCrop(train_x.shape[-1], padding=CROP_PADDING),
        data.transforms.RandomHorizontalFlip(FLIP_P)]) if augment else None
    return data.DataLoader(data.ArrayDataset(image=train_x, label=train_y), batch_size,
                           shuffle=True, drop_last=True, seed=seed, transform=augmentation)


def train(epochs=DEFAULT_EPOCHS, device="cpu", batch_size=DEFAULT_BATCH_SIZE, seed=0,
          progress=True, place=None, log=print, norm="batch_norm", augment=False):
    """Train and evaluate after each epoch; returns (net, handles, history) with
    history: loss and accuracy per epoch, seconds of training. augment: shift and
    mirror the training digits at random (make_loader)."""
    from tqdm import tqdm

    if place is None:
        place = mg.GPUPlace(0) if device == "gpu" else mg.CPUPlace()
    train_x, train_y, test_x, test_y = load_digits_split()
    loader = make_loader(train_x, train_y, batch_size, seed, augment)
    steps = len(loader)                              # whole batches only
    net, h = build_net(place, seed, epochs, steps, norm)
    history = {"loss": [], "accuracy": [], "seconds": 0.0}
    start = time.perf_counter()
    bar = tqdm(total=epochs * steps, disable=not progress, unit="batch", leave=False,
               file=sys.stderr)
    for epoch in range(1, epochs + 1):
        loader.set_epoch(epoch - 1)
        losses = []
        for feed in loader:
            (loss,) = net.train(feed=feed, fetch=[h["loss"]])
            losses.append(float(loss))
            bar.update(1)
        acc = accuracy(net, h["logits"], test_x, test_y)
        history["loss"].append(float(np.mean(losses)))
        history["accuracy"].append(acc)
        (bar.write if progress else log)(
            f"epoch {epoch}/{epochs}  loss {history['loss'][-1]:.4f}  lr "
            f"{net.optimizer.learning_rate:.5f}  held-out accuracy {100 * acc:.1f}% "
            f"({len(test_y)} digits)")
    bar.close()
    history["seconds"] = time.perf_counter() - start
    return net, h, history


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--augment", action="store_true",
                        help="random shifts (RandomCrop) and mirrors (RandomHorizontalFlip)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"argument --epochs: must be >= 1, got {args.epochs}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be >= 0, got {args.seed}")
    net, _, history = train(args.epochs, args.device, seed=args.seed,
                            progress=not args.no_progress, augment=args.augment)
    print(net.summary())
    print(f"held-out accuracy {100 * history['accuracy'][-1]:.1f}% after {args.epochs} epochs, "
          f"{history['seconds']:.1f} s of training")
    return 0


if __name__ == "__main__":
    sys.exit(main())

