"""The inference model file, model.json: its constants, its JSON layout, and
the checks a reader makes (docs/inference_format.md describes the format).

Attribute values are JSON data: None, bool, int, float and str as
themselves, tuples as lists, a non-finite float as {"float": "nan" | "inf"
| "-inf"}; `decode_attr` turns lists back into tuples, and the op's schema
then canonicalises them as it does for any built op.
"""
from __future__ import annotations

import errno
import json
import math
import re

import numpy as np

from minigraph.io.files import NotRegularFile, open_regular
from minigraph.io.npz import CheckpointError

FORMAT_NAME = "minigraph-inference"
FORMAT_VERSION = 2
MODEL_FILE = "model.json"
PARAMS_FILE = "params.npz"                 # version 1: the one params file's name
PARAMS_PATTERN = re.compile(r"params-([0-9a-f]{16})\.npz")   # version 2: params-<sha256[:16]>
MAX_MODEL_BYTES = 64 << 20
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class InferenceModelError(CheckpointError):
    """A model directory that cannot be written or loaded; the message says why."""


def dump(model):
    """JSON text of `model` with one variable or op per line."""
    parts = []
    for key, value in model.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            body = ",\n".join("  " + json.dumps(v, allow_nan=False) for v in value)
            parts.append(f" {json.dumps(key)}: [\n{body}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def encode_attr(value, where):
    """An attribute value as JSON data: None, bool, int, float and str as
    themselves, tuples (and lists) as lists, a non-finite float as
    {"float": "nan" | "inf" | "-inf"}; anything else is an InferenceModelError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else {"float": "nan" if v != v else repr(v)}
    if isinstance(value, (tuple, list)):
        return [encode_attr(v, where) for v in value]
    raise InferenceModelError(f"{where}: a {type(value).__name__} value cannot be written to "
                              "the model file")


def decode_attr(value, where):
    """The attribute value that `encode_attr` turned into `value` (lists become tuples)."""
    if isinstance(value, list):
        return tuple(decode_attr(v, where) for v in value)
    if isinstance(value, dict):
        if set(value) != {"float"} or value["float"] not in _NON_FINITE:
            raise InferenceModelError(f"{where}: {value!r} is not an attribute value")
        return _NON_FINITE[value["float"]]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InferenceModelError(f"{where}: {value!r} is not an attribute value")


def same_value(a, b):
    """True when two attribute values are equal and of the same types (NaN equals NaN)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


def read_model(dirname, what):
    """The parsed model.json of `dirname` (a dict) after checking its size, that it
    is JSON, its format name, and a version this minigraph reads."""
    try:
        with open_model_file(dirname, MODEL_FILE, what, MAX_MODEL_BYTES) as f:
            data = f.read(MAX_MODEL_BYTES + 1)
    except NotRegularFile as e:
        if e.errno != errno.EFBIG:
            raise
        raise InferenceModelError(f"{what}: {MODEL_FILE} is larger than "
                                  f"{MAX_MODEL_BYTES >> 20} MiB; not a model file") from None

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")

    try:
        model = json.loads(data.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InferenceModelError(f"{what}: {MODEL_FILE} is damaged (not valid JSON: {e})") \
            from None
    if not isinstance(model, dict) or model.get("format") != FORMAT_NAME:
        found = model.get("format") if isinstance(model, dict) else None
        raise InferenceModelError(f"{what}: {MODEL_FILE} is not a minigraph inference model "
                                  f"(format {found!r}, expected {FORMAT_NAME!r})")
    version = field(model, "version", int, what)
    if version > FORMAT_VERSION:
        raise InferenceModelError(f"{what}: written by a newer minigraph (format version "
                                  f"{version}); this minigraph reads version {FORMAT_VERSION}: "
                                  "upgrade minigraph to load it")
    if version < 1:
        raise InferenceModelError(f"{what}: {MODEL_FILE} is damaged (format version {version})")
    return model


def open_model_file(dirname, name, what, max_bytes=None):
    """The file `name` of the model directory opened for reading (files.open_regular):
    an InferenceModelError when it is missing or not a regular file; NotRegularFile
    (errno EFBIG) when it holds more than `max_bytes`."""
    try:
        return open_regular(dirname / name, max_bytes)
    except FileNotFoundError:
        raise InferenceModelError(f"{what}: missing {name}") from None
    except IsADirectoryError:
        raise InferenceModelError(f"{what}: {name} is a folder, not a file") from None
    except NotRegularFile as e:
        if e.errno == errno.EFBIG:
            raise
        raise InferenceModelError(f"{what}: {name} is {e.strerror}: model files are read "
                                  "from regular files only") from None


def field(record, key, kind, where):
    """record[key], which must exist and be of type `kind` (a type or a tuple);
    otherwise an InferenceModelError saying the file is damaged."""
    if not isinstance(record, dict):
        raise InferenceModelError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        raise InferenceModelError(f"{where}: {MODEL_FILE} is damaged (missing key {key!r})")
    value = record[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in kinds)
        raise InferenceModelError(f"{where}: {MODEL_FILE} is damaged ({key!r} must be "
                                  f"{names}, got {value!r:.60})")
    return value


def records_of(model, what):
    """{name: variable record} after checking every record's fields."""
    records = {}
    for i, rec in enumerate(field(model, "variables", list, what)):
        where = f"{what}: variable {i}"
        name = field(rec, "name", str, where)
        shape = field(rec, "shape", (list, type(None)), where)
        if shape is not None and not all(isinstance(d, int) and not isinstance(d, bool)
                                         and d >= -1 for d in shape):
            raise InferenceModelError(f"{where} ({name!r}): {MODEL_FILE} is damaged (bad "
                                      f"shape {shape!r})")
        dtype = field(rec, "dtype", (str, type(None)), where)
        try:
            kind = np.dtype(dtype).kind if dtype is not None else "f"
        except TypeError:
            kind = None
        if kind is None or kind not in "biuf":
            raise InferenceModelError(f"{where} ({name!r}): {MODEL_FILE} is damaged "
                                      f"(unknown dtype {dtype!r})")
        for flag in ("persistable", "trainable", "data"):
            field(rec, flag, bool, where)
        if name in records:
            raise InferenceModelError(f"{where}: {MODEL_FILE} is damaged ({name!r} is "
                                      "declared twice)")
        records[name] = rec
    return records


def params_name(digest):
    """The name of the params file whose SHA-256 is `digest` (version 2)."""
    return f"params-{digest[:16]}.npz"


def params_file(model, what):
    """The params file model.json names, checked: "params.npz" in version 1, in
    version 2 `params-<the first 16 hex digits of its SHA-256>.npz`; and the
    recorded SHA-256 (64 hex digits). Returns (name, digest)."""
    info = field(model, "params", dict, what)
    name = field(info, "file", str, f"{what}: params")
    digest = field(info, "sha256", str, f"{what}: params")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise InferenceModelError(f"{what}: {MODEL_FILE} is damaged (params sha256 "
                                  f"{digest!r:.80} is not 64 hex digits)")
    want = PARAMS_FILE if model["version"] == 1 else params_name(digest)
    if name != want:
        raise InferenceModelError(f"{what}: the params file must be {want!r} (format version "
                                  f"{model['version']}), got {name!r:.80}")
    return name, digest
