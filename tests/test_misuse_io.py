"""Checkpoints that must not be trusted: zip bombs, damaged files, object arrays,
entries whose sizes lie, names that are not names, and failed saves."""
from __future__ import annotations

import io as bytes_io
import re
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest
from helpers import save_fails_mid_write

import minigraph as mg
from minigraph import io

BOMB_BYTES = 1536 << 20            # 1.5 GiB of zeros after the header
# the handmade archives below use format version 1 (no manifest), which loads still:
# every defence of the reader acts on both versions
V1 = "minigraph-persistables/1"
KNOWN, UNKNOWN = "fc2.b", "ghost"  # same length: the bomb is renamed by patching bytes


def small_net(seed=0):
    """x (-1, 4) -> fc2 (10): persistables fc2.w (4, 10) and fc2.b (10,)."""
    net = mg.Net(seed=seed)
    x = mg.layers.data(net, "x", shape=(-1, 4))
    mg.layers.fc(net, x, size=10, name="fc2")
    return net


def npy_bytes(array, allow_pickle=False):
    f = bytes_io.BytesIO()
    np.lib.format.write_array(f, array, allow_pickle=allow_pickle)
    return f.getvalue()


def write_zip(path, entries, compression=zipfile.ZIP_STORED):
    """A zip of {entry name: bytes}; the format entry first unless given."""
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


def fmt_entry():
    return {"__format__.npy": npy_bytes(np.array(V1))}


def values(net):
    return {v.name: v.get().copy() for v in net.persistables()}


def unchanged(net, before):
    return all(np.array_equal(v.get(), before[v.name]) for v in net.persistables())


class RepeatedChunkDeflater:
    """Deflates like zlib at level 9, each write ending in a full flush (which forgets
    the history), so the same chunk written again deflates to the same bytes: those
    are kept and given again instead of deflating 1.5 GiB of zeros (tens of seconds)."""

    def __init__(self, chunk):
        self._zlib = zlib.compressobj(9, zlib.DEFLATED, -15)
        self._chunk, self._deflated = chunk, None

    def compress(self, data):
        if data is not self._chunk:
            return self._deflate(data)
        if self._deflated is None:
            self._deflated = self._deflate(data)
        return self._deflated

    def _deflate(self, data):
        return self._zlib.compress(data) + self._zlib.flush(zlib.Z_FULL_FLUSH)

    def flush(self):
        return self._zlib.flush()


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    """A 1.5 MB checkpoint whose entry UNKNOWN holds a .npy header claiming
    shape (10,) float32 followed by 1.5 GiB of zeros, deflated."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.npz"
    header = _header_for((10,), np.float32)
    chunk = bytes(16 << 20)
    with pytest.MonkeyPatch.context() as patch, \
            zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        deflater = lambda kind, *_: (RepeatedChunkDeflater(chunk)      # noqa: E731
                                     if kind == zipfile.ZIP_DEFLATED else None)
        patch.setattr(zipfile, "_get_compressor", deflater,
                      raising=False)    # where zipfile has no such hook: slower, the same data
        zf.writestr(zipfile.ZipInfo("__format__.npy"), npy_bytes(np.array(V1)))
        with zf.open(f"{UNKNOWN}.npy", "w", force_zip64=True) as f:
            f.write(header)
            for _ in range(BOMB_BYTES // len(chunk)):
                f.write(chunk)
    assert path.stat().st_size < 2 << 20
    return path


def renamed(src, dst, old, new):
    data = src.read_bytes()
    assert data.count(f"{old}.npy".encode()) == 2 and len(old) == len(new)
    dst.write_bytes(data.replace(f"{old}.npy".encode(), f"{new}.npy".encode()))
    return dst


def peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", [UNKNOWN, KNOWN])
def test_a_zip_bomb_is_rejected_without_inflating_it(bomb, tmp_path, name):
    path = renamed(bomb, tmp_path / "bomb.npz", UNKNOWN, name) if name != UNKNOWN else bomb
    net = small_net()
    before = values(net)
    errors = []

    def load():
        try:
            io.load(net, path)
        except io.CheckpointError as e:
            errors.append(str(e))

    peak = peak_bytes(load)
    assert peak < 32 << 20, f"peak {peak} bytes"
    assert len(errors) == 1
    if name == KNOWN:       # the entry's size disagrees with its own header
        assert "damaged minigraph checkpoint" in errors[0] and "'fc2.b'" in errors[0]
        assert "header (shape (10,), float32) says 40" in errors[0]
    else:
        assert "damaged minigraph checkpoint" in errors[0] and "'ghost'" in errors[0]
    assert unchanged(net, before)


def test_a_bomb_whose_directory_lies_about_its_size_is_rejected(bomb, tmp_path):
    """The zip directory claims the small size the header implies (168 bytes);
    the deflated stream behind it would inflate to 1.5 GiB."""
    data = bytearray(renamed(bomb, tmp_path / "b.npz", UNKNOWN, KNOWN).read_bytes())
    central = data.rfind(b"PK\x01\x02")                  # the bomb's directory entry
    assert data[central + 46:central + 46 + 9] == b"fc2.b.npy"
    data[central + 24:central + 28] = (128 + 40).to_bytes(4, "little")
    (tmp_path / "liar.npz").write_bytes(bytes(data))
    net = small_net()
    before = values(net)
    errors = []

    def load():
        with pytest.raises(io.CheckpointError) as err:
            io.load(net, tmp_path / "liar.npz")
        errors.append(str(err.value))

    assert peak_bytes(load) < 32 << 20
    assert "damaged minigraph checkpoint" in errors[0] and "'fc2.b'" in errors[0]
    assert unchanged(net, before)


def test_a_non_strict_load_refuses_the_bomb_too(bomb):
    net = small_net()
    with pytest.raises(io.CheckpointError, match="damaged minigraph checkpoint: entry 'ghost'"):
        io.load(net, bomb, strict=False)


def test_a_non_strict_load_never_reads_unexpected_entries(tmp_path):
    """A consistent 64 MiB entry the net does not have is listed, not read."""
    path = tmp_path / "big.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo("__format__.npy"), npy_bytes(np.array(V1)))
        zf.writestr("fc2.b.npy", npy_bytes(np.full(10, 3, np.float32)))
        with zf.open("ghost.npy", "w", force_zip64=True) as f:
            f.write(_header_for((1 << 26,), np.uint8))
            for _ in range(4):
                f.write(bytes(16 << 20))
    net = small_net()
    result = []
    assert peak_bytes(lambda: result.append(io.load(net, path, strict=False))) < 32 << 20
    assert result == [(["fc2.w"], ["ghost"])]
    assert np.array_equal(net.var("fc2.b").get(), np.full(10, 3, np.float32))
    with pytest.raises(io.CheckpointError, match="unexpected 'ghost' \\(shape \\(67108864,\\)"):
        io.load(net, path)


def test_an_entry_bigger_than_the_variable_is_refused_before_it_is_read(tmp_path):
    """fc2.b needs 40 bytes; the file's consistent entry claims 64 MiB."""
    path = tmp_path / "big.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(zipfile.ZipInfo("__format__.npy"), npy_bytes(np.array(V1)))
        zf.writestr("fc2.w.npy", npy_bytes(np.zeros((4, 10), np.float32)))
        with zf.open("fc2.b.npy", "w", force_zip64=True) as f:
            f.write(_header_for((1 << 24,), np.float32))
            for _ in range(4):
                f.write(bytes(16 << 20))
    net = small_net()
    before = values(net)
    errors = []

    def load(strict):
        with pytest.raises(io.CheckpointError) as err:
            io.load(net, path, strict=strict)
        errors.append(str(err.value))

    assert peak_bytes(lambda: load(True)) < 32 << 20
    assert peak_bytes(lambda: load(False)) < 32 << 20
    assert all("wrong shape for 'fc2.b': the net has (10,), the file (16777216,)" in e
               for e in errors)
    assert unchanged(net, before)
    # the measure sees such reads: np.load, which trusts the header, allocates all 64 MiB
    assert peak_bytes(lambda: np.load(path)["fc2.b"]) > 60 << 20


def _header_for(shape, dtype):
    """The .npy header alone of an array of `shape` and `dtype`."""
    f = bytes_io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(dtype).str,
                                            "fortran_order": False, "shape": shape})
    return f.getvalue()


def test_an_absurd_compression_ratio_is_refused_before_reading(tmp_path):
    path = write_zip(tmp_path / "z.npz", {**fmt_entry(), "fc2.b.npy": npy_bytes(
        np.zeros(300_000, np.float32))}, compression=zipfile.ZIP_DEFLATED)
    # claim 2000x what was compressed (deflate never exceeds about 1032x)
    data = bytearray(path.read_bytes())
    central = data.rfind(b"PK\x01\x02")
    csize = int.from_bytes(data[central + 20:central + 24], "little")
    data[central + 24:central + 28] = (2000 * csize).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(io.CheckpointError, match="absurd compression ratio"):
        io.load(small_net(), path)


class Trap:
    """Unpickling this records that it happened."""

    sprung = []

    def __reduce__(self):
        return (Trap.sprung.append, ("unpickled",))


def test_object_arrays_are_refused_and_never_unpickled(tmp_path):
    trap = np.empty(10, dtype=object)
    trap[:] = [Trap() for _ in range(10)]
    path = write_zip(tmp_path / "obj.npz",
                     {**fmt_entry(), "fc2.b.npy": npy_bytes(trap, allow_pickle=True)})
    net = small_net()
    for strict in (True, False):
        with pytest.raises(io.CheckpointError) as err:
            io.load(net, path, strict=strict)
        msg = str(err.value)
        assert "object arrays are not allowed" in msg and "'fc2.b'" in msg
        assert "allow_pickle" not in msg
    assert Trap.sprung == []


def test_a_damaged_file_says_damaged(tmp_path):
    net = small_net()
    good = io.save(net, tmp_path / "good.npz")
    data = good.read_bytes()
    cases = {
        "garbage.npz": b"this is not a zip archive at all" * 10,
        "empty.npz": b"",
        "truncated.npz": data[: len(data) // 2],
        "tail_cut.npz": data[:-30],
    }
    # flip one byte of fc2.w's data: the CRC no longer matches
    at = data.index(b"\x93NUMPY", data.index(b"fc2.w.npy")) + 128 + 5
    cases["bad_crc.npz"] = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    before = values(net)
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(io.CheckpointError) as err:
            io.load(net, tmp_path / name)
        msg = str(err.value)
        assert "damaged minigraph checkpoint" in msg, (name, msg)
        assert "not a minigraph checkpoint" not in msg, (name, msg)
        assert str(tmp_path / name) in msg
    assert "Bad CRC" in str(pytest.raises(io.CheckpointError, io.load, net,
                                          tmp_path / "bad_crc.npz").value)
    assert unchanged(net, before)


def test_a_valid_zip_without_the_format_entry_is_not_a_checkpoint(tmp_path):
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    write_zip(tmp_path / "other.zip", {"readme.txt": b"hello"})
    with pytest.raises(io.CheckpointError, match="not a minigraph checkpoint"):
        io.load(small_net(), tmp_path / "plain.npz")
    with pytest.raises(io.CheckpointError, match="damaged minigraph checkpoint: entry "
                                                 "'readme.txt' is not a .npy array"):
        io.load(small_net(), tmp_path / "other.zip")


def test_entries_that_lie_about_their_size_or_repeat(tmp_path):
    w = npy_bytes(np.zeros((4, 10), np.float32))
    cases = {
        "short": (w[:-4], re.escape("holds 156 bytes of data but its header (shape (4, 10), "
                                    "float32) says 160")),
        "long": (w + b"\0" * 64, "says 160"),
        "badheader": (b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'", "no readable .npy header"),
        "negative": (npy_bytes(np.zeros(0, np.float32)).replace(b"(0,)", b"(-4,)"),
                     "no readable .npy header|negative dimension"),
    }
    for case, (blob, message) in cases.items():
        path = write_zip(tmp_path / f"{case}.npz", {**fmt_entry(), "fc2.w.npy": blob,
                                                    "fc2.b.npy": npy_bytes(np.zeros(10, "f4"))})
        with pytest.raises(io.CheckpointError, match=message):
            io.load(small_net(), path)
    path = tmp_path / "twice.npz"
    with pytest.warns(UserWarning, match="Duplicate name"):
        write_zip(path, fmt_entry())
        with zipfile.ZipFile(path, "a") as zf:
            zf.writestr("fc2.b.npy", npy_bytes(np.zeros(10, "f4")))
            zf.writestr("fc2.b.npy", npy_bytes(np.zeros(10, "f4")))
    with pytest.raises(io.CheckpointError, match="'fc2.b' appears twice"):
        io.load(small_net(), path)


def test_big_endian_and_fortran_entries_still_load(tmp_path):
    net = small_net()
    w = np.arange(40, dtype=np.float32).reshape(4, 10)
    path = write_zip(tmp_path / "ok.npz", {
        **fmt_entry(), "fc2.w.npy": npy_bytes(np.asfortranarray(w.astype(">f4"))),
        "fc2.b.npy": npy_bytes(np.ones(10, "<f4"))})
    io.load(net, path)
    got = net.var("fc2.w").get()
    assert got.dtype == np.float32 and got.flags.c_contiguous and np.array_equal(got, w)


def test_a_failed_save_names_the_users_path_not_the_temporary_file(tmp_path):
    net = small_net()
    (tmp_path / "file").write_text("x")
    for target, kind in ((tmp_path / "absent" / "ck.npz", FileNotFoundError),
                         (tmp_path / "file" / "ck.npz", NotADirectoryError)):
        with pytest.raises(kind) as err:
            io.save(net, target)
        assert err.value.filename == str(target)
        assert str(target) in str(err.value) and ".tmp" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_full_disk_error_names_the_users_path(tmp_path, monkeypatch):
    import errno

    save_fails_mid_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError) as err:
        io.save(small_net(), tmp_path / "ck.npz")
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(tmp_path / "ck.npz")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(io.CheckpointError, match="is a directory"):
        io.load(small_net(), tmp_path)
