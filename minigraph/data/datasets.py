"""Readers of the standard datasets' files a user already has: nothing is downloaded.

    mnist(root, split="train")     the four IDX files (raw or .gz) in root or root/MNIST/raw
    cifar10(root, split="train")   the binary version: root/cifar-10-batches-bin/*.bin
    digits(split="all")            scikit-learn's bundled 8x8 digits

Each returns an ArrayDataset with "image" (float32, NCHW, in [0, 1]) and
"label" (int64). A missing file is a FileNotFoundError naming it and where it
was looked for; a file that is not what its name says (or not a regular file)
is a ValueError naming it. The files are read defensively (minigraph.data.readers):
headers and sizes are checked before the data is read, and nothing is read or
inflated past what the header declares.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minigraph.data.dataset import ArrayDataset
from minigraph.data.readers import IDX_TYPES, read_idx, read_records

__all__ = ["IDX_TYPES", "cifar10", "digits", "mnist", "read_idx"]

MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
CIFAR10_FOLDER = "cifar-10-batches-bin"
CIFAR10_FILES = {"train": tuple(f"data_batch_{k}.bin" for k in range(1, 6)),
                 "test": ("test_batch.bin",)}
CIFAR10_SHAPE = (3, 32, 32)
MNIST_SHAPE = (28, 28)
CLASSES = 10                   # MNIST's, Fashion-MNIST's and CIFAR-10's labels: 0..9
DIGITS_HELD_OUT = 0.2


def _split(who, split, allowed):
    if split not in allowed:
        raise ValueError(f"{who}: split must be one of {', '.join(map(repr, allowed))}, "
                         f"got {split!r}")


def _find(who, name, folders, suffixes=("", ".gz")):
    for folder in folders:
        for suffix in suffixes:
            path = Path(folder) / (name + suffix)
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                return path            # the reader refuses what is not a regular file
    where = " or ".join(str(Path(f)) for f in folders)
    also = " (or .gz)" if ".gz" in suffixes else ""
    raise FileNotFoundError(f"{who}: no {name}{also} in {where}; nothing is downloaded: put "
                            "the dataset's files there")


def mnist(root, split="train"):
    """MNIST (or Fashion-MNIST, same files) from its four IDX files, raw or .gz, in
    `root` or root/MNIST/raw (torchvision's layout). split: "train" (60000) or
    "test" (10000). image: float32 (N, 1, 28, 28) in [0, 1]; label: int64."""
    _split("mnist", split, tuple(MNIST_FILES))
    root = Path(root).expanduser()
    folders = [root, root / "MNIST" / "raw"]
    images_name, labels_name = MNIST_FILES[split]
    images_path = _find("mnist", images_name, folders)
    labels_path = _find("mnist", labels_name, folders)
    images, labels = read_idx(images_path, "mnist"), read_idx(labels_path, "mnist")
    if images.ndim != 3 or images.dtype != np.uint8 or images.shape[1:] != MNIST_SHAPE:
        raise ValueError(f"mnist: {images_path} holds {images.dtype.name} of shape "
                         f"{images.shape}; expected uint8 images (N, 28, 28)")
    if labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(f"mnist: {labels_path} holds shape {labels.shape}; expected one label "
                         f"for each of the {len(images)} images of {images_path}")
    _check_labels("mnist", labels_path, labels)
    image = (images.astype(np.float32) / np.float32(255.0))[:, None]
    return ArrayDataset(image=image, label=labels.astype(np.int64))


def _check_labels(who, path, labels):
    """A ValueError naming the file unless `labels` are integers in 0..CLASSES-1."""
    if labels.dtype.kind not in "iu":
        raise ValueError(f"{who}: {path} holds {labels.dtype.name} labels; expected integers "
                         f"(class numbers 0..{CLASSES - 1}, uint8 in the original files)")
    bad = np.flatnonzero((labels < 0) | (labels >= CLASSES))
    if bad.size:
        raise ValueError(f"{who}: {path} has {bad.size} label(s) outside 0..{CLASSES - 1} "
                         f"(the first: {labels[bad[0]]} at row {bad[0]})")


def cifar10(root, split="train"):
    """CIFAR-10's binary version: `root` holds cifar-10-batches-bin/ (or is it).
    split: "train" (data_batch_1..5.bin, 50000) or "test" (test_batch.bin, 10000).
    Each record is a label byte and 3072 bytes of a 32x32 image, R, G, B planes.
    image: float32 (N, 3, 32, 32) in [0, 1]; label: int64 in 0..9."""
    _split("cifar10", split, tuple(CIFAR10_FILES))
    root = Path(root).expanduser()
    folders = [root / CIFAR10_FOLDER, root]
    record = 1 + int(np.prod(CIFAR10_SHAPE))
    images, labels = [], []
    for name in CIFAR10_FILES[split]:
        path = _find("cifar10", name, folders, suffixes=("",))
        rows = read_records("cifar10", path, record)
        if rows[:, 0].max() >= CLASSES:
            raise ValueError(f"cifar10: {path} has labels above {CLASSES - 1} (is it "
                             "CIFAR-100?)")
        labels.append(rows[:, 0].astype(np.int64))
        images.append(rows[:, 1:].reshape((-1,) + CIFAR10_SHAPE))
    image = np.concatenate(images).astype(np.float32) / np.float32(255.0)
    return ArrayDataset(image=image, label=np.concatenate(labels))


def digits(split="all", held_out=DIGITS_HELD_OUT, seed=0):
    """scikit-learn's bundled 8x8 digits (1797; no download): image float32
    (N, 1, 8, 8) in [0, 1] (the 17 grey levels / 16), label int64. split: "all",
    or "train" / "test" of a fixed split that keeps `held_out` of each class
    apart (chosen by `seed`; the examples' split)."""
    _split("digits", split, ("all", "train", "test"))
    if not 0.0 <= held_out < 1.0:
        raise ValueError(f"digits: held_out must be a fraction in [0, 1), got {held_out!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("digits: needs scikit-learn (pip install 'minigraph[demo]')") from e
    bundled = load_digits()
    x = (bundled.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bundled.target.astype(np.int64)
    if split == "all":
        return ArrayDataset(image=x, label=y)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        test[idx[:round(len(idx) * held_out)]] = True
    keep = test if split == "test" else ~test
    return ArrayDataset(image=x[keep], label=y[keep])
