"""minigraph.data.datasets: MNIST's IDX files (raw and .gz), CIFAR-10's binary batches and
scikit-learn's digits, read from tiny files written here; missing and malformed files."""
from __future__ import annotations

import gzip
import os
import re
import struct
import subprocess
import sys

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
    with pytest.raises(ValueError, match=f"mnist: {labels} holds 12 bytes; its header"):
        datasets.mnist(tmp_path)
    labels.write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match=f"mnist: {labels} is not an IDX file"):
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


def test_mnist_labels_and_image_sizes_are_checked_naming_the_file(tmp_path):
    images, _ = write_mnist(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.array([1, 2, 10, 3, 255], np.uint8)))
    with pytest.raises(ValueError, match=f"mnist: {labels} has 2 label.s. outside 0..9 .the "
                                         "first: 10 at row 2."):
        datasets.mnist(tmp_path)
    labels.write_bytes(idx_bytes(np.array([1, 2, 3, 4, -1], ">i4"), 0x0C))
    with pytest.raises(ValueError, match=f"mnist: {labels} has 1 label.s. outside 0..9 .the "
                                         "first: -1 at row 4"):
        datasets.mnist(tmp_path)
    labels.write_bytes(idx_bytes(np.array([1.5, 2, 3, 4, 5], ">f4"), 0x0D))
    with pytest.raises(ValueError, match=f"mnist: {labels} holds float32 labels; expected "
                                         "integers"):
        datasets.mnist(tmp_path)
    labels.write_bytes(idx_bytes(np.zeros(5, np.uint8)))
    image_file = tmp_path / "train-images-idx3-ubyte"
    image_file.write_bytes(idx_bytes(np.zeros((5, 32, 32), np.uint8)))
    with pytest.raises(ValueError, match=rf"mnist: {image_file} holds uint8 of shape \(5, 32, "
                                         r"32\); expected uint8 images \(N, 28, 28\)"):
        datasets.mnist(tmp_path)


# ---- defences: the header bounds what is read -------------------------------------------

# The child's own peak: VmHWM of its memory map. ru_maxrss would not do: Linux carries
# it across exec, so a child forked from a big test process starts with its size.
PEAK_MIB = """def _peak_mib():
    try:
        with open('/proc/self/status') as f:
            return next(int(l.split()[1]) // 1024 for l in f if l.startswith('VmHWM:'))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024"""


def run_bounded(code, timeout=60):
    """Run `code` in a fresh interpreter with 1 GiB of address space and a hard timeout;
    return (exit status, output, its peak resident memory in MiB)."""
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
              f"{PEAK_MIB}\n"
              f"{code}\n"
              "print('peak', _peak_mib())\n")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still reading after {timeout} s (blocked?):\n{code}")
    text = out.stdout + out.stderr
    peak = re.findall(r"^peak (\d+)$", out.stdout, flags=re.M)
    return out.returncode, text, int(peak[0]) if peak else None


def refused(call, path):
    """Code that calls `call` (on `path`) and prints the ValueError it must raise."""
    return ("from minigraph.data import datasets\n"
            "try:\n"
            f"    {call}({str(path)!r})\n"
            "except ValueError as e:\n"
            "    print('REFUSED', e)\n"
            "else:\n"
            "    print('ACCEPTED')\n")


BASELINE_MIB = 200          # an interpreter with numpy and minigraph, well under this


def test_a_gzip_bomb_is_inflated_no_further_than_its_header(tmp_path):
    """A 330 KB .gz whose header says 10 images (7856 bytes) and which holds 320 MB more
    used to be inflated whole before its size was compared."""
    bomb = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as f:
        f.write(idx_bytes(np.zeros((10, 28, 28), np.uint8)))
        zeros = bytes(1 << 24)
        for _ in range(20):
            f.write(zeros)
    assert bomb.stat().st_size < 2_000_000
    code, out, peak = run_bounded(refused("datasets.read_idx", bomb))
    assert code == 0 and f"REFUSED read_idx: {bomb} holds more than 7856 bytes (inflated); " \
        "its header (shape (10, 28, 28), uint8) says 7856 bytes" in out, out
    assert peak < BASELINE_MIB, out


def test_a_header_claiming_more_than_a_small_gzip_can_hold_is_refused_before_inflating(
        tmp_path):
    path = tmp_path / "big.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 60000, 4096, 4096))
    with pytest.raises(ValueError, match=rf"read_idx: {path} is a gzip file of \d+ bytes, and "
                                         r"its header \(shape \(60000, 4096, 4096\), uint8\) "
                                         r"says 1006632960016 bytes: more than"):
        datasets.read_idx(path)


def test_a_huge_invalid_file_is_refused_by_its_first_four_bytes(tmp_path):
    """A 1.5 GB file (sparse here) that is not IDX used to be read whole first; so was
    one whose header disagrees with its size."""
    junk = tmp_path / "junk"
    with open(junk, "wb") as f:
        f.write(b"GIF8")
        f.truncate(1_500_000_000)
    code, out, peak = run_bounded(refused("datasets.read_idx", junk))
    assert code == 0 and f"REFUSED read_idx: {junk} is not an IDX file: its first bytes are " \
        "47494638" in out, out
    assert peak < BASELINE_MIB, out
    with open(junk, "r+b") as f:
        f.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10))
    code, out, peak = run_bounded(refused("datasets.read_idx", junk))
    assert code == 0 and f"REFUSED read_idx: {junk} holds 1500000000 bytes; its header " \
        "(shape (10,), uint8) says 18 bytes" in out, out
    assert peak < BASELINE_MIB, out


@pytest.mark.parametrize("reader", ["read_idx", "mnist", "cifar10"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_files_that_are_not_regular_are_refused_at_once(tmp_path, reader, kind):
    """A FIFO used to block read_idx forever and /dev/zero to be read until memory ran
    out; found under a dataset's file name (a link to /dev/zero), the same."""
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    name = {"read_idx": "a", "mnist": "train-labels-idx1-ubyte",
            "cifar10": "data_batch_1.bin"}[reader]
    target = tmp_path / name if reader != "cifar10" else folder / name
    if reader == "mnist":
        write_mnist(tmp_path)
        target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    call = {"read_idx": "datasets.read_idx", "mnist": "datasets.mnist",
            "cifar10": "datasets.cifar10"}[reader]
    arg = target if reader == "read_idx" else tmp_path
    code, out, _ = run_bounded(refused(call, arg), timeout=30)
    device = "a FIFO" if kind == "fifo" else "a character device"
    who = "read_idx" if reader == "read_idx" else reader
    assert code == 0 and f"REFUSED {who}: cannot read {target}: {device}, not a regular " \
        "file" in out, out


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
