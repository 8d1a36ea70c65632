"""The .npz files minigraph writes and reads (checkpoints, inference params),
read defensively.

A file is a zip archive of `.npy` entries plus a `__format__` entry naming
its format and version, and from version 2 on a `__manifest__` entry (a JSON
string: {"parts": {part: [entry names]}, ...}, each entry in exactly one
part). Reading never trusts the file: the zip directory and each entry's .npy
header (dtype, shape) are read and checked first, with `allow_pickle=False`
everywhere; an entry is decompressed only once its header says what the
caller expects, and never past the size that header implies. Object arrays
(which would need unpickling) are refused. A plain `np.savez` file (no
`__format__`) is read the same way by an Archive that expects no format.
"""
from __future__ import annotations

import io
import json
import math
import os
import zipfile
from collections import Counter
from dataclasses import dataclass

import numpy as np

from minigraph.io.files import NotRegularFile, open_regular

FORMAT_KEY = "__format__"
MANIFEST_KEY = "__manifest__"
CHECKPOINT_FORMAT = "minigraph-persistables/2"     # what minigraph.io writes
MAX_HEADER = 10_000         # bytes of .npy header numpy itself accepts by default
MAX_RATIO = 1100            # deflate cannot compress better than about 1032:1
MAX_ENTRIES = 100_000
MAX_FORMAT_BYTES = MAX_HEADER + 1024
MAX_NAME_BYTES = 255 * 4    # a variable name's characters as a numpy str (UTF-32)
LOCAL_HEADER = 30           # bytes of a zip local file header before its name
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that does not fit the net, is damaged, or is not a minigraph checkpoint."""


@dataclass(frozen=True)
class Entry:
    """One array of an archive, known from its .npy header: `dtype` (native
    byte order; `stored` is the file's), `shape`, and where its data starts."""

    name: str
    shape: tuple
    dtype: np.dtype
    stored: np.dtype
    fortran_order: bool
    header_bytes: int
    info: zipfile.ZipInfo

    @property
    def nbytes(self):
        return math.prod(self.shape) * self.dtype.itemsize


def write_npz(f, arrays):
    """Write {name: array} to the open binary file `f` in numpy's .npz layout
    (stored, uncompressed; any name works, unlike the keyword arguments of np.savez)."""
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in arrays.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def npz_bytes(arrays):
    """The file write_npz writes for {name: array}, built in memory, as bytes.

    Writing it then takes one system call instead of several per entry (zipfile
    seeks back to each entry's header): each such call lets the interpreter run
    another thread, and a save waited several milliseconds for every one of them
    while a training loop ran in another thread."""
    blob = io.BytesIO()
    write_npz(blob, arrays)
    return blob.getvalue()


def header_arrays(fmt, manifest):
    """The `__format__` and `__manifest__` entries (as arrays) of a file of format
    `fmt` ("name/version") whose manifest is the dict `manifest`."""
    return {FORMAT_KEY: np.array(fmt),
            MANIFEST_KEY: np.array(json.dumps(manifest, separators=(",", ":")))}


class Archive:
    """An .npz file opened for checked reading.

    Opening reads the zip directory and every .npy header, and checks: the
    file is a readable zip; entries are unique, unencrypted, stored or
    deflated `.npy` files of sane compression; `__format__` holds `expect`'s
    format name and a version from 1 to `expect`'s ("name/version"; the
    version read is `version`); from version 2 on, `__manifest__` is a JSON
    object whose "parts" list every entry once (`manifest`; None before);
    every header parses, holds a plain numeric (or string) dtype, and implies
    exactly the entry's uncompressed size. With expect=None any file passes
    the format checks (`format` is its `__format__`, or None: a plain
    np.savez file). Any failure is a CheckpointError starting with `what`
    ("load 'ck.npz'"). `entries` then maps array names to Entry (not the
    format and manifest); `read(name)` returns the data.

    Only a regular file is read (a device, FIFO or socket is refused before
    any read, and opening never blocks); `fileobj`, when given, is such a file
    already open (read from its start; closed with the archive). Every entry's
    data must lie inside the file, so no array is sized from a directory that
    claims more data than the file holds.
    """

    def __init__(self, path, what, expect, fileobj=None):
        self.path, self.what = path, what
        try:
            self.file = fileobj if fileobj is not None else open_regular(path)
        except IsADirectoryError:
            raise self.error("is a directory, not a checkpoint file") from None
        except NotRegularFile as e:
            raise self.error(f"is {e.strerror}: checkpoints are read from regular files "
                             "only") from None
        try:
            self._open(expect)
        except BaseException:
            self.file.close()
            raise

    def _open(self, expect):
        self.size = os.fstat(self.file.fileno()).st_size
        self.file.seek(0)
        if self.file.read(6) == b"\x93NUMPY":
            raise self.error("not a minigraph checkpoint (a single array, not an .npz archive)")
        self.file.seek(0)
        try:
            self.zip = zipfile.ZipFile(self.file)
        except Exception as e:     # noqa: BLE001 - whatever zipfile makes of a bad directory
            raise self.error(f"damaged minigraph checkpoint: not a readable zip archive "
                             f"({type(e).__name__}: {e})") from e
        try:
            infos = self._directory()
            fmt = infos.pop(FORMAT_KEY, None)
            manifest = infos.pop(MANIFEST_KEY, None)
            self.format, self.version, self.manifest = None, None, None
            if fmt is None and expect is not None:
                raise self.error(f"not a minigraph checkpoint (no {FORMAT_KEY!r} entry; "
                                 f"expected {expect!r})")
            if fmt is not None:
                self.format = self._read_string(FORMAT_KEY, fmt, MAX_FORMAT_BYTES)
            if expect is not None:
                self._check_format(expect)
                if self.version >= 2 and manifest is None:
                    raise self.damaged(MANIFEST_KEY, "is missing (every version 2 file has one)")
            if manifest is not None:
                limit = MAX_FORMAT_BYTES + 4 * (MAX_NAME_BYTES + 8) * len(infos)
                self.manifest = self._read_manifest(
                    self._read_string(MANIFEST_KEY, manifest, limit), infos)
            self.entries = {name: self._header(name, info) for name, info in infos.items()}
        except BaseException:
            self.zip.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the archive and its file."""
        try:
            self.zip.close()
        finally:
            self.file.close()

    def error(self, message):
        return CheckpointError(f"{self.what}: {message}")

    def damaged(self, name, problem):
        return self.error(f"damaged minigraph checkpoint: entry {name!r} {problem}")

    # ---- reading ---------------------------------------------------------------

    def read(self, name):
        """The array `name` (C order, native byte order), read within the size its
        header declares; a damaged entry (bad CRC, truncated data) is a CheckpointError."""
        entry = self.entries[name]
        try:
            array = np.empty(math.prod(entry.shape), dtype=entry.stored)
        except MemoryError:
            raise self.error(f"entry {name!r} needs {entry.nbytes} bytes of memory, which "
                             "this process cannot allocate") from None
        view = memoryview(array).cast("B") if array.size else memoryview(b"")
        try:
            with self.zip.open(entry.info) as f:
                _read_exactly(f, entry.header_bytes)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:got + _CHUNK])
                    if not n:
                        break
                    got += n
                if got < len(view) or f.read(1):    # the final read checks the CRC
                    raise self.damaged(name, "holds a different amount of data than its "
                                             "header says")
        except CheckpointError:
            raise
        except Exception as e:     # noqa: BLE001 - zipfile's and zlib's errors, whichever
            raise self.damaged(name, f"could not be read ({type(e).__name__}: {e})") from e
        order = "F" if entry.fortran_order else "C"
        array = array.reshape(entry.shape, order=order).astype(entry.dtype, copy=False)
        return array if array.flags.c_contiguous else np.array(array, order="C")

    # ---- checks ------------------------------------------------------------------

    def _directory(self):
        infos = self.zip.infolist()
        if len(infos) > MAX_ENTRIES:
            raise self.error(f"damaged minigraph checkpoint: {len(infos)} entries (at most "
                             f"{MAX_ENTRIES})")
        named = {}
        stored = 0
        for info in infos:
            raw = info.filename
            if not raw.endswith(".npy"):
                raise self.damaged(raw, "is not a .npy array")
            name = raw[:-4]
            if name in named:
                raise self.damaged(name, "appears twice")
            if info.flag_bits & 0x1:
                raise self.damaged(name, "is encrypted")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise self.damaged(name, f"uses compression method {info.compress_type} "
                                         "(only stored or deflated entries are read)")
            if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                raise self.damaged(name, f"is stored uncompressed but its sizes differ "
                                         f"({info.compress_size} and {info.file_size} bytes)")
            if info.compress_size > info.file_size + info.file_size // 100 + 1024:
                raise self.damaged(name, f"has {info.compress_size} bytes of compressed data "
                                         f"for {info.file_size} bytes (more than deflate ever "
                                         "needs)")
            if info.file_size > MAX_RATIO * max(info.compress_size, 1):
                raise self.damaged(name, f"claims to inflate {info.compress_size} bytes to "
                                         f"{info.file_size} (an absurd compression ratio)")
            end = info.header_offset + LOCAL_HEADER + len(info.orig_filename.encode()) + \
                info.compress_size
            stored += info.compress_size
            if end > self.size or stored > self.size:
                raise self.damaged(name, f"claims {info.compress_size} bytes of data at offset "
                                         f"{info.header_offset}, but the file holds only "
                                         f"{self.size} bytes")
            named[name] = info
        return named

    def _read_string(self, key, info, limit):
        if info.file_size > limit:
            raise self.damaged(key, f"is {info.file_size} bytes, far too large")
        entry = self._header(key, info)
        if entry.dtype.kind != "U" or entry.shape != ():
            if key == FORMAT_KEY:
                raise self.error(f"not a minigraph checkpoint ({FORMAT_KEY!r} is not a string)")
            raise self.damaged(key, "is not a string")
        self.entries = {key: entry}
        return str(self.read(key)[()])

    def _check_format(self, expect):
        name, _, version = self.format.partition("/")
        want_name, _, want_version = expect.partition("/")
        if name != want_name:
            raise self.error(f"unknown format {self.format!r}; expected {expect!r}")
        newest = int(want_version)
        if not (version.isdigit() and version.isascii()) or not 1 <= int(version) <= newest:
            newer = version.isdigit() and version.isascii() and int(version) > newest
            raise self.error(f"format version {version!r} is not one this minigraph reads (it "
                             f"reads versions 1 to {newest} of {want_name!r})"
                             + ("; it was written by a newer minigraph: upgrade to load it"
                                if newer else ""))
        self.version = int(version)

    def _read_manifest(self, text, infos):
        try:
            manifest = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise self.damaged(MANIFEST_KEY, f"is not JSON ({e})") from None
        parts = manifest.get("parts") if isinstance(manifest, dict) else None
        if not isinstance(parts, dict) or not all(
                isinstance(names, list) and all(isinstance(n, str) for n in names)
                for names in parts.values()):
            raise self.damaged(MANIFEST_KEY, "is not an object whose 'parts' map part names "
                                             "to lists of entry names")
        listed = [n for names in parts.values() for n in names]
        unknown = sorted(set(listed) - set(infos))
        twice = sorted(n for n, k in Counter(listed).items() if k > 1)
        unlisted = sorted(set(infos) - set(listed))
        for names, problem in ((unknown, "lists entries the file lacks"),
                               (twice, "lists entries in two parts"),
                               (unlisted, "leaves entries out of every part")):
            if names:
                raise self.damaged(MANIFEST_KEY, f"{problem}: {', '.join(map(repr, names[:5]))}"
                                                 + (" ..." if len(names) > 5 else ""))
        return manifest

    def _header(self, name, info):
        try:
            with self.zip.open(info) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    header = np.lib.format.read_array_header_1_0(f, max_header_size=MAX_HEADER)
                elif version == (2, 0):
                    header = np.lib.format.read_array_header_2_0(f, max_header_size=MAX_HEADER)
                else:
                    raise self.damaged(name, f"has .npy format version {version}, which "
                                             "minigraph does not read")
                header_bytes = f.tell()
        except CheckpointError:
            raise
        except Exception as e:     # noqa: BLE001 - zipfile's and numpy's errors, whichever
            if "allow_pickle" in str(e):
                raise self.damaged(name, "is an object array: object arrays are not allowed "
                                         "(minigraph never unpickles)") from None
            raise self.damaged(name, f"has no readable .npy header ({e})") from e
        shape, fortran_order, dtype = header
        if dtype.hasobject:
            raise self.damaged(name, "is an object array: object arrays are not allowed "
                                     "(minigraph never unpickles)")
        if dtype.fields is not None or dtype.subdtype is not None or \
                dtype.kind not in "biufcSU":
            raise self.damaged(name, f"has dtype {dtype}, not a plain numeric dtype")
        if any(d < 0 for d in shape):
            raise self.damaged(name, f"has a negative dimension in its shape {shape}")
        native = dtype.newbyteorder("=") if dtype.byteorder not in ("|", "=") else dtype
        entry = Entry(name, tuple(int(d) for d in shape), np.dtype(native), dtype,
                      bool(fortran_order), header_bytes, info)
        if info.file_size != header_bytes + entry.nbytes:
            raise self.damaged(name, f"holds {info.file_size - header_bytes} bytes of data but "
                                     f"its header (shape {entry.shape}, {entry.dtype}) says "
                                     f"{entry.nbytes}")
        return entry


def _read_exactly(f, n):
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"expected {n} bytes, got {len(data)}")
    return data
