"""minigraph.data.datasets: MNIST's IDX files (raw and .gz), CIFAR-10's binary batches and
scikit-learn's digits, read from tiny files written here; missing and malformed files."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from minigraph.data import datasets


def idx_bytes(array, code=0x08):
    array = np.asarray(array)
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def write(path, payload, gz=False):
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def write_mnist(folder, split="train", n=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    names = datasets.MNIST_FILES[split]
    write(folder / names[0], idx_bytes(images), gz)
    write(folder / names[1], idx_bytes(labels), gz)
    return images, labels


# ---- MNIST ------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("split", ["train", "test"])
def test_mnist_reads_the_idx_files(tmp_path, gz, split):
    images, labels = write_mnist(tmp_path, split, gz=gz)
    ds = datasets.mnist(tmp_path, split)
    x, y = ds.arrays["image"], ds.arrays["label"]
    assert x.shape == (5, 1, 28, 28) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, 0], images / 255.0, rtol=1e-6)
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert y.dtype == np.int64 and y.tolist() == labels.tolist()


def test_mnist_in_torchvisions_folders(tmp_path):
    _, labels = write_mnist(tmp_path / "MNIST" / "raw", gz=True)
    assert datasets.mnist(str(tmp_path)).arrays["label"].tolist() == labels.tolist()


def test_a_missing_mnist_file_is_named(tmp_path):
    write_mnist(tmp_path, "train")
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"mnist: no train-labels-idx1-ubyte \(or \.gz\) "
                                                f"in {tmp_path}"):
        datasets.mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte.*nothing is downloaded"):
        datasets.mnist(tmp_path, "test")


def test_malformed_mnist_files_are_named(tmp_path):
    images, _ = write_mnist(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.zeros(4, np.uint8)))               # 4 labels, 5 images
    with pytest.raises(ValueError, match=f"mnist: {labels} holds shape .4,.; expected one label "
                                         "for each of the 5 images"):
        datasets.mnist(tmp_path)
    labels.write_bytes(idx_bytes(np.zeros(5, np.uint8))[:-1])          # cut short
    with pytest.raises(ValueError, match=f"read_idx: {labels} holds 12 bytes; its header"):
        datasets.mnist(tmp_path)
    labels.write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match=f"read_idx: {labels} is not an IDX file"):
        datasets.mnist(tmp_path)
    labels.write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(images[:, 0]))   # rank 2
    with pytest.raises(ValueError, match="expected uint8 images"):
        datasets.mnist(tmp_path)
    with pytest.raises(ValueError, match="mnist: split must be one of 'train', 'test'"):
        datasets.mnist(tmp_path, "val")


def test_read_idx_other_element_types_and_broken_gzip(tmp_path):
    for code, dtype in ((0x0C, ">i4"), (0x0D, ">f4"), (0x0B, ">i2"), (0x0E, ">f8")):
        values = np.arange(6).reshape(2, 3).astype(dtype)
        (tmp_path / "a").write_bytes(idx_bytes(values, code))
        np.testing.assert_array_equal(datasets.read_idx(tmp_path / "a"), values)
    (tmp_path / "b.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="read_idx: cannot read .*b.gz"):
        datasets.read_idx(tmp_path / "b.gz")


# ---- CIFAR-10 ---------------------------------------------------------------------------

def write_cifar(folder, names, n=3, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name in names:
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        records = np.concatenate([labels[:, None], images.reshape(n, -1)], axis=1)
        (folder / name).write_bytes(records.tobytes())
        out.append((images, labels))
    return out


@pytest.mark.parametrize("split", ["train", "test"])
def test_cifar10_reads_the_binary_batches(tmp_path, split):
    names = datasets.CIFAR10_FILES[split]
    written = write_cifar(tmp_path / "cifar-10-batches-bin", names)
    ds = datasets.cifar10(tmp_path, split)
    x, y = ds.arrays["image"], ds.arrays["label"]
    assert x.shape == (3 * len(names), 3, 32, 32) and x.dtype == np.float32
    images = np.concatenate([w[0] for w in written])
    np.testing.assert_allclose(x, images / 255.0, rtol=1e-6)        # R, G, B planes in order
    assert y.dtype == np.int64 and y.tolist() == np.concatenate([w[1] for w in written]).tolist()
    assert len(datasets.cifar10(tmp_path / "cifar-10-batches-bin", split)) == len(y)


def test_cifar10_missing_and_malformed_files_are_named(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar(folder, datasets.CIFAR10_FILES["train"][:4])
    with pytest.raises(FileNotFoundError, match=f"cifar10: no data_batch_5.bin in {folder}"):
        datasets.cifar10(tmp_path)
    write_cifar(folder, ["data_batch_5.bin"])
    (folder / "data_batch_2.bin").write_bytes(b"\x00" * 3072)
    with pytest.raises(ValueError, match="cifar10: .*data_batch_2.bin holds 3072 bytes, not a "
                                         "whole number of 3073-byte records"):
        datasets.cifar10(tmp_path)
    record = np.zeros(3073, np.uint8)
    record[0] = 57
    (folder / "data_batch_2.bin").write_bytes(record.tobytes())
    with pytest.raises(ValueError, match="labels above 9"):
        datasets.cifar10(tmp_path)


# ---- digits -----------------------------------------------------------------------------

def test_digits_is_the_examples_split():
    pytest.importorskip("sklearn")
    from minigraph.examples.train_digits import load_digits_split

    every = datasets.digits()
    train, test = datasets.digits("train"), datasets.digits("test")
    assert len(every) == 1797 == len(train) + len(test)
    x = every.arrays["image"]
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32 and x.max() == 1.0
    for got, want in zip((train.arrays["image"], train.arrays["label"], test.arrays["image"],
                          test.arrays["label"]), load_digits_split()):
        np.testing.assert_array_equal(got, want)
    counts = np.bincount(test.arrays["label"]) / np.bincount(every.arrays["label"])
    assert np.all(np.abs(counts - 0.2) < 0.02)                       # 20% of each class
    with pytest.raises(ValueError, match="digits: split must be one of 'all', 'train', 'test'"):
        datasets.digits("val")
    with pytest.raises(ValueError, match="digits: held_out must be a fraction in"):
        datasets.digits("train", held_out=1.0)
