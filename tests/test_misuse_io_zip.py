"""Checkpoints that must not be trusted, continued from test_misuse_io.py (whose
helpers build the files): zip directories that lie about sizes, zip features minigraph
never writes, special files (devices, FIFOs) and damaged version-2 manifests."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from test_misuse_io import V1, _header_for, npy_bytes, small_net, unchanged, values, write_zip

from minigraph import io

# ---- directories that lie about sizes, unsupported zip features, special files ----------

def handmade_zip(path, entries):
    """A stored zip of (name, data, claimed size) entries, written by hand: an entry
    whose claimed size differs from len(data) gets zip64 sizes saying the claim."""
    import struct
    import zlib

    body, central = b"", b""
    for name, data, claimed in entries:
        raw = name.encode()
        crc = zlib.crc32(data)
        if claimed == len(data):
            sizes, extra = struct.pack("<II", claimed, claimed), b""
        else:
            sizes = struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF)
            extra = struct.pack("<HHQQ", 1, 16, claimed, claimed)
        offset = len(body)
        body += (b"PK\x03\x04" + struct.pack("<HHHHHI", 45, 0, 0, 0, 0, crc) + sizes
                 + struct.pack("<HH", len(raw), len(extra)) + raw + extra + data)
        central += (b"PK\x01\x02" + struct.pack("<HHHHHHI", 45, 45, 0, 0, 0, 0, crc) + sizes
                    + struct.pack("<HHHHHII", len(raw), len(extra), 0, 0, 0, 0, offset)
                    + raw + extra)
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(entries), len(entries),
                                       len(central), len(body), 0)
    path.write_bytes(body + central + end)
    return path


def zip_entry_claiming(path, name, claimed_data_bytes):
    """A checkpoint whose entry `name` has a .npy header for a float32 array of
    claimed_data_bytes, and a directory claiming that much data, while the file
    holds only the header and 40 bytes."""
    header = _header_for((claimed_data_bytes // 4,), np.float32)
    fmt = npy_bytes(np.array(V1))
    return handmade_zip(path, [("__format__.npy", fmt, len(fmt)),
                               (f"{name}.npy", header + bytes(40),
                                len(header) + claimed_data_bytes)])


def test_an_entry_claiming_a_terabyte_is_damaged_not_a_memory_error(tmp_path):
    path = zip_entry_claiming(tmp_path / "tib.npz", "fc2.b", 1 << 40)
    for call in (lambda: io.read_checkpoint(path), lambda: io.load(small_net(), path),
                 lambda: io.load(small_net(), path, strict=False)):
        with pytest.raises(io.CheckpointError) as err:
            call()
        msg = str(err.value)
        assert "damaged minigraph checkpoint" in msg and str(path) in msg, msg


def test_a_flipped_version_needed_byte_is_a_checkpoint_error(tmp_path):
    net = small_net()
    data = bytearray(io.save(net, tmp_path / "good.npz").read_bytes())
    central = data.find(b"PK\x01\x02")
    data[central + 6] = 0xFF                       # version needed to extract: 25.5
    (tmp_path / "version.npz").write_bytes(bytes(data))
    with pytest.raises(io.CheckpointError) as err:
        io.load(net, tmp_path / "version.npz")
    assert str(tmp_path / "version.npz") in str(err.value)


def test_zip_features_minigraph_never_writes_are_checkpoint_errors(tmp_path):
    net = small_net()
    data = bytearray(io.save(net, tmp_path / "good.npz").read_bytes())
    local = data.find(b"PK\x03\x04", data.find(b"PK\x03\x04") + 4)   # fc2.w's local header
    central = data.find(b"PK\x01\x02", data.find(b"PK\x01\x02") + 4)
    for bit in (0x20, 0x40):                       # patched data, strong encryption
        patched = bytearray(data)
        patched[local + 6] |= bit
        patched[central + 8] |= bit
        (tmp_path / "flag.npz").write_bytes(bytes(patched))
        with pytest.raises(io.CheckpointError) as err:
            io.load(net, tmp_path / "flag.npz")
        assert str(tmp_path / "flag.npz") in str(err.value)


LOAD_SPECIAL = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import minigraph as mg
net = mg.Net(seed=0)
mg.layers.fc(net, mg.layers.data(net, "x", shape=(-1, 4)), size=10, name="fc2")
try:
    mg.io.load(net, sys.argv[1])
except mg.io.CheckpointError as e:
    print("CheckpointError:", e)
"""


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_file_is_refused_without_reading_it(device):
    """/dev/zero used to be read until the memory ran out."""
    import subprocess
    import sys

    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    done = subprocess.run([sys.executable, "-c", LOAD_SPECIAL, device], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CheckpointError:" in done.stdout and "not a regular file" in done.stdout
    assert device in done.stdout


def test_a_fifo_is_refused_at_once(tmp_path):
    """open() of a FIFO with no writer used to wait forever."""
    import threading

    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    errors = []
    t = threading.Thread(target=lambda: errors.append(
        pytest.raises(io.CheckpointError, io.load, small_net(), fifo).value), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        with open(fifo, "wb"):            # release the reader before failing
            pass
        t.join(10)
        pytest.fail("io.load waited on a FIFO")
    assert "not a regular file" in str(errors[0]) and str(fifo) in str(errors[0])


def test_the_inference_loader_refuses_special_files_too(tmp_path):
    import shutil

    net = small_net()
    x = net.data_vars["x"]
    model = io.save_inference(net, tmp_path / "model", feeds=[x],
                              fetches=[net.ops("infer")[-1].output_vars()[0]])
    params = model / json.loads((model / "model.json").read_text())["params"]["file"]
    shutil.move(params, tmp_path / "params.npz")
    os.mkfifo(params)
    with pytest.raises(io.InferenceModelError, match="not a regular file"):
        io.load_inference(model)


# ---- the version 2 manifest ------------------------------------------------------------

def v2_file(path, manifest, arrays=None):
    arrays = {"fc2.w": np.zeros((4, 10), np.float32), "fc2.b": np.zeros(10, np.float32)} \
        if arrays is None else arrays
    entries = {"__format__.npy": npy_bytes(np.array(io.FORMAT))}
    if manifest is not None:
        entries["__manifest__.npy"] = npy_bytes(manifest if isinstance(manifest, np.ndarray)
                                                else np.array(manifest))
    entries.update({f"{n}.npy": npy_bytes(a) for n, a in arrays.items()})
    return write_zip(path, entries)


@pytest.mark.parametrize("manifest, message", [
    ('{"parts": {"parameters": ["fc2.w", "fc2.b"]}, "optimizer": null}', None),
    ("not json", "is not JSON"),
    ('["fc2.w"]', "is not an object whose 'parts' map part names to lists"),
    ('{"parts": {"parameters": "fc2.w"}}', "is not an object whose 'parts'"),
    ('{"parts": {"parameters": ["fc2.w", "fc2.b", "ghost"]}}', "lists entries the file lacks: "
                                                               "'ghost'"),
    ('{"parts": {"parameters": ["fc2.w", "fc2.b"], "estimates": ["fc2.b"]}}',
     "lists entries in two parts: 'fc2.b'"),
    ('{"parts": {"parameters": ["fc2.w"]}}', "leaves entries out of every part: 'fc2.b'"),
    (np.zeros(3, np.float32), "is not a string"),
    (None, "is missing"),
    ("x" * (1 << 20), "far too large"),
])
def test_a_damaged_manifest_is_refused_before_any_array_is_read(tmp_path, manifest, message):
    path = v2_file(tmp_path / "ck.npz", manifest)
    net = small_net()
    before = values(net)
    if message is None:
        assert sorted(io.load(net, path)) == ["fc2.b", "fc2.w"]
        return
    with pytest.raises(io.CheckpointError) as err:
        io.load(net, path, strict=False)
    assert "damaged minigraph checkpoint: entry '__manifest__" in str(err.value)
    assert re.search(message, str(err.value)), str(err.value)
    assert unchanged(net, before)
