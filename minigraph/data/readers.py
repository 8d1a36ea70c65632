"""Reading dataset files defensively: the file's own header bounds what is read.

A file is opened without blocking and checked to be a regular file before a
byte is read (a FIFO would block forever, /dev/zero would be read until memory
runs out). An IDX file's 4-byte magic and its dimensions are read and checked
first; the data is then read to exactly the size its header declares, and one
byte more must not exist. A raw file's size is checked against the header
before any data is read; a gzip-compressed one is inflated no further than
the header's size (and a header claiming more than a gzip file of its size
can hold is refused before inflating). A CIFAR-10 batch's size is checked to
be whole records before it is read. Every error is a ValueError (a missing
file a FileNotFoundError) naming the reader and the file.
"""
from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from minigraph.io.files import NotRegularFile, open_regular

# the IDX format's element types (big-endian)
IDX_TYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
             0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
GZIP_MAX_RATIO = 1100           # deflate cannot compress better than about 1032:1
_CHUNK = 1 << 24                # read in pieces of 16 MiB


class _Refused(ValueError):
    """Raised inside a read; re-raised as a ValueError naming the reader and file."""


def open_file(who, path):
    """`path` opened for binary reading once it is known to be a regular file; a
    FileNotFoundError, or a ValueError naming `who` and the file for anything else
    (a folder, a FIFO, a device, a socket, no permission)."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise
    except NotRegularFile as e:
        raise ValueError(f"{who}: cannot read {path}: {e.strerror} (a dataset file must be "
                         "a regular file)") from None
    except OSError as e:
        raise ValueError(f"{who}: cannot read {path}: {e.strerror or e}") from None


def read_idx(path, who="read_idx"):
    """The array in an IDX file (MNIST's format; gzip-compressed when the name ends
    in .gz), read as the module doc says; a ValueError naming `who` and the file
    when its magic, header or size is wrong or it cannot be read."""
    path = Path(path)
    with open_file(who, path) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            if path.suffix == ".gz":
                with gzip.GzipFile(fileobj=f, mode="rb") as stream:
                    return _read_idx(stream, size, compressed=True)
            return _read_idx(f, size, compressed=False)
        except _Refused as e:
            raise ValueError(f"{who}: {path} {e}") from None
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{who}: cannot read {path}: {e}") from None


def _read_idx(stream, size, compressed):
    inflated = " (inflated)" if compressed else ""
    magic = _read(stream, 4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in IDX_TYPES:
        raise _Refused(f"is not an IDX file: its first bytes{inflated} are "
                       f"{magic.hex() or 'missing'}; an IDX file starts with 00 00, a type "
                       f"byte ({', '.join(f'{t:02x}' for t in IDX_TYPES)}) and the number of "
                       "dimensions")
    dtype, ndim = IDX_TYPES[magic[2]], magic[3]
    header = 4 + 4 * ndim
    dims = _read(stream, 4 * ndim)
    if len(dims) < 4 * ndim:
        raise _Refused(f"ends inside its header ({ndim} dimensions need {header} bytes)")
    shape = tuple(int.from_bytes(dims[4 * i:4 * i + 4], "big") for i in range(ndim))
    want = header + math.prod(shape) * dtype.itemsize
    said = f"its header (shape {shape}, {dtype.name}) says {want} bytes"
    if not compressed and size != want:
        raise _Refused(f"holds {size} bytes; {said}")
    if compressed and want > GZIP_MAX_RATIO * max(size, 1):
        raise _Refused(f"is a gzip file of {size} bytes, and {said}: more than a gzip "
                       "file of that size can hold")
    data = np.empty(want - header, dtype=np.uint8)
    got = _read_into(stream, data)
    if got < data.size:
        raise _Refused(f"holds {header + got} bytes{inflated}; {said}")
    if _read(stream, 1):
        raise _Refused(f"holds more than {want} bytes{inflated}; {said}")
    return data.view(dtype).reshape(shape)


def _read(stream, n):
    """Up to n bytes: fewer only at the end of the stream."""
    out = bytearray()
    while len(out) < n:
        piece = stream.read(n - len(out))
        if not piece:
            break
        out += piece
    return bytes(out)


def _read_into(stream, array):
    """Fill the uint8 `array` from `stream` in chunks; the bytes read (fewer at its end)."""
    view = memoryview(array)
    done = 0
    while done < array.size:
        n = stream.readinto(view[done:done + _CHUNK])
        if not n:
            break
        done += n
    return done


def read_records(who, path, record):
    """The file at `path` as a (N, record) uint8 array of fixed-size records, its size
    checked (whole records, at least one) before a byte is read; a ValueError naming
    `who` and the file otherwise."""
    path = Path(path)
    with open_file(who, path) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0 or size % record:
            raise ValueError(f"{who}: {path} holds {size} bytes, not a whole number of "
                             f"{record}-byte records (is it the binary version?)")
        data = np.empty(size, dtype=np.uint8)
        try:
            got = _read_into(f, data)
        except OSError as e:
            raise ValueError(f"{who}: cannot read {path}: {e}") from None
        if got != size:
            raise ValueError(f"{who}: {path} changed while it was read ({got} of {size} "
                             "bytes)")
    return data.reshape(-1, record)
