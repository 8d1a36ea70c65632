"""The inference model directory: a net's pruned infer graph as data.

    save_inference(net, "model_dir", feeds=["image"], fetches=[logits])
    m = load_inference("model_dir")          # a Net, from the directory alone
    (p,) = m.infer(feed={"image": x})        # fetch=None: the saved fetches

The directory holds `model.json` (format "minigraph-inference", version 2:
ops with their slots and attributes, variables, feeds, fetches; plain JSON,
nothing executable) and `params-<hash>.npz` (the persistables the ops read, a
minigraph checkpoint read with every check of minigraph.io.npz, named after the
first 16 hex digits of its SHA-256). The format is documented in
docs/inference_format.md. A save writes the new params file beside the old
one, then replaces model.json atomically (which names the params file and
records its SHA-256), then removes the params file the old model.json named:
until the new model.json is in place the old model stays complete and
loadable, so a save that fails or is killed between its files leaves the
previous model as it was. Version 1 directories (`params.npz`) still load.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np

from minigraph.feeds import check_no_infer_state, io_variables
from minigraph.io import checkpoint_values
from minigraph.io.files import atomic_write
from minigraph.io.model_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MODEL_FILE,
    PARAMS_FILE,
    PARAMS_PATTERN,
    InferenceModelError,
    decode_attr,
    dump,
    encode_attr,
    field,
    open_model_file,
    params_file,
    params_name,
    read_model,
    records_of,
    same_value,
)
from minigraph.io.npz import CHECKPOINT_FORMAT, Archive, header_arrays, npz_bytes
from minigraph.net import Net
from minigraph.operator import Operator
from minigraph.plan import prune
from minigraph.schema import OpError, get_schema, registered_ops
from minigraph.scope import check_reserved_name


class InferenceNet(Net):
    """A Net rebuilt by load_inference: it infers its saved fetches; it has no
    loss, gradients or optimizer, so `train` is an error."""

    infer_only = True

    def __init__(self, place, source):
        super().__init__(place=place, seed=0)
        self.source = str(source)

    @property
    def origin(self):
        """Where this inference net comes from, in words."""
        return f"loaded from {self.source!r}"

    def train(self, feed=None, fetch=None):
        """Always an error: an inference model cannot be trained."""
        outs = ", ".join(repr(v.name) for v in self.default_fetches) or "its outputs"
        raise RuntimeError(f"train: this is an inference net ({self.origin}): it computes "
                           f"{outs} and has no loss, gradients or optimizer; build the net "
                           "with layers to train it")


# ---- saving ------------------------------------------------------------------------

def save_inference(net, dirname, feeds, fetches):
    """Write the inference model of `net` to the directory `dirname` (created
    if needed; other files in it are left alone).

    feeds: data Variables of `net` or their names, the inputs the model takes.
    fetches: Variables of `net` (a train-branch Variable stands for its
    infer-branch copy) or names, the outputs it returns, in order. The infer
    graph (`net.ops("infer")`) is pruned to what the fetches need; every
    data variable it reads must be among the feeds. Returns the directory.
    """
    dirname = Path(dirname)
    what = f"save_inference {str(dirname)!r}"
    feed_vars, fetch_vars = io_variables(net, feeds, fetches, what, InferenceModelError)
    ops = prune(net.ops("infer"), fetch_vars)
    check_no_infer_state(ops, what, InferenceModelError)
    needed = {id(v) for op in ops for v in op.input_vars() if v.is_data}
    absent = [v.name for v in _unique(v for op in ops for v in op.input_vars())
              if id(v) in needed and v not in feed_vars]
    if absent:
        raise InferenceModelError(f"{what}: the fetches need the data "
                                  f"{', '.join(map(repr, absent))}, which "
                                  f"{'is' if len(absent) == 1 else 'are'} not among the feeds")
    variables = _unique([*feed_vars, *(v for op in ops for v in op.input_vars() +
                                       op.output_vars()), *fetch_vars])
    names = {}
    for var in variables:
        if names.setdefault(var.name, var) is not var:
            raise InferenceModelError(f"{what}: two different variables are named "
                                      f"{var.name!r}; the model file names each once")
    persist = [v for v in variables if v.persistable]
    parts = {p: [v.name for v in persist if checkpoint_values.part_of(v) == p]
             for p in checkpoint_values.PARTS}
    params = header_arrays(CHECKPOINT_FORMAT, {"parts": {p: n for p, n in parts.items() if n},
                                               "optimizer": None})
    with net._lock:                     # the values of one whole step
        if any(v.value is None for v in persist):
            net.initialize()
        params.update({v.name: np.asarray(v.get()) for v in persist})
    data = npz_bytes(params)
    digest = hashlib.sha256(data).hexdigest()
    model = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "feeds": [v.name for v in feed_vars],
        "fetches": [v.name for v in fetch_vars],
        "variables": [_var_record(v) for v in variables],
        "ops": [_op_record(op, i, what) for i, op in enumerate(ops)],
        "params": {"file": params_name(digest), "sha256": digest},
    }
    text = dump(model)
    dirname.mkdir(parents=True, exist_ok=True)
    previous = _named_params(dirname)
    atomic_write(dirname / params_name(digest), lambda f: f.write(data))
    atomic_write(dirname / MODEL_FILE, lambda f: f.write(text.encode("utf-8")))
    _remove_old_params(dirname, params_name(digest), previous)
    return dirname


STALE_SECONDS = 600     # a params file no model.json names, this old, is a dead save's


def _named_params(dirname):
    """The params file the model.json in `dirname` names, or None (none, unreadable)."""
    try:
        return params_file(read_model(dirname, "save_inference"), "save_inference")[0]
    except (InferenceModelError, OSError):
        return None


def _remove_old_params(dirname, keep, previous):
    """Remove the params file the replaced model.json named (`previous`), and params
    files no model.json names that are older than STALE_SECONDS (left by a save
    killed between its files; a save still running wrote its own moments ago)."""
    try:
        names = os.listdir(dirname)
    except OSError:
        return
    for name in names:
        if name == keep or not (name == PARAMS_FILE or PARAMS_PATTERN.fullmatch(name)):
            continue
        path = dirname / name
        try:
            if name == previous or time.time() - os.stat(path).st_mtime > STALE_SECONDS:
                os.unlink(path)
        except OSError:
            pass


def _unique(variables):
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _var_record(var):
    if var.persistable:
        shape, dtype = var.get().shape, var.get().dtype
    else:                       # a temporary's value may be a stale batch: use its declaration
        shape, dtype = var.decl_shape, var.decl_dtype
    return {"name": var.name, "shape": None if shape is None else [int(d) for d in shape],
            "dtype": None if dtype is None else np.dtype(dtype).name,
            "persistable": bool(var.persistable), "trainable": bool(var.trainable),
            "data": bool(var.is_data)}


def _op_record(op, index, what):
    def names(bound):
        if bound is None:
            return None
        return [v.name for v in bound] if isinstance(bound, list) else bound.name

    attrs = {}
    for key, value in op.attrs.items():
        where = f"{what}: op {index} ({op.type}) attribute {key!r}"
        attrs[key] = encode_attr(value, where)
        if not same_value(decode_attr(attrs[key], where), value):
            raise InferenceModelError(f"{where}: {value!r} does not survive the model file")
    record = {"type": op.type, "inputs": {s: names(v) for s, v in op.inputs.items()},
              "outputs": {s: names(v) for s, v in op.outputs.items()}, "attrs": attrs}
    if op.layer is not None:
        record["layer"] = op.layer
    return record


# ---- loading -----------------------------------------------------------------------

def load_inference(dirname, place=None):
    """A Net rebuilt from the model directory `dirname` alone (no building code).

    The net runs on `place` (CPUPlace() by default); `infer(feed)` with no
    fetch returns the saved fetches, in order; `train` is an error. Ops are
    built through the op registry by type name: the ops before the first
    mode-dependent op (schema.mode_attr, e.g. batch_norm) form the trunk,
    that op and the rest the infer branch, with the mode attribute True.
    A newer format version, a missing or damaged file (JSON that does not
    parse or lacks a key, parameters that are missing, damaged, do not match
    or hold values a checkpoint may not), an op type this minigraph does not
    know, or an op that would write a persistable (a parameter or estimate)
    is an InferenceModelError (a CheckpointError) saying which. A missing
    directory is a FileNotFoundError. A save replacing the model meanwhile
    is read again (the new model), never half.
    """
    dirname = Path(dirname)
    what = f"load_inference {str(dirname)!r}"
    if not dirname.is_dir():
        if dirname.exists():
            raise InferenceModelError(f"{what}: not a directory")
        raise FileNotFoundError(2, "no such inference model directory", str(dirname))
    for attempt in range(_RETRIES):
        model = read_model(dirname, what)
        records = records_of(model, what)
        name, digest = params_file(model, what)
        try:
            f = open_model_file(dirname, name, what)
        except InferenceModelError:
            if attempt + 1 < _RETRIES and not (dirname / name).exists():
                continue        # a save replaced model.json and removed this file: read again
            raise
        params = _read_params(dirname, name, digest, f, records, what)
        break
    net = InferenceNet(place, dirname)
    return _build(net, model, records, params, what)


_RETRIES = 3


def _read_params(dirname, name, digest, f, records, what):
    """The arrays of the params file `name` (open as `f`) after checking its SHA-256
    against `digest` and its entries against the persistable records."""
    try:
        sha = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
        if sha.hexdigest() != digest:
            raise InferenceModelError(f"{what}: {name} is not the one {MODEL_FILE} was "
                                      "saved with (its SHA-256 differs): damaged, or from "
                                      "another save")
    except BaseException:
        f.close()
        raise
    wanted = {n: r for n, r in records.items() if r["persistable"]}
    pwhat = f"{what}: {name}"
    with Archive(dirname / name, pwhat, CHECKPOINT_FORMAT, fileobj=f) as archive:
        problems = [f"missing {n!r}" for n in wanted if n not in archive.entries]
        problems += [f"unexpected {n!r}" for n in archive.entries if n not in wanted]
        for n, rec in wanted.items():
            entry = archive.entries.get(n)
            if entry is not None and (list(entry.shape) != rec["shape"]
                                      or entry.dtype.name != rec["dtype"]):
                problems.append(f"{n!r} is {entry.shape} {entry.dtype}, {MODEL_FILE} says "
                                f"{tuple(rec['shape'] or ())} {rec['dtype']}")
        if problems:
            raise InferenceModelError(f"{pwhat}: does not match {MODEL_FILE}: "
                                      + "; ".join(problems))
        return {n: archive.read(n) for n in wanted}


def _check_writes(net, what):
    """An InferenceModelError unless no op writes a persistable: only the in-place
    outputs of mode-dependent ops bind one, and in inference mode (which the
    loader sets) they write nothing."""
    for i, op in enumerate(net.ops("infer")):
        for slot, bound in op.outputs.items():
            for var in bound if isinstance(bound, list) else [bound]:
                if var is None or not var.persistable:
                    continue
                if op.schema.mode_attr is not None and slot in op.schema.inplace:
                    continue
                raise InferenceModelError(
                    f"{what}: op {i} ({op.type}) writes the persistable {var.name!r} (output "
                    f"slot {slot!r}); an inference model never changes its parameters or "
                    "estimates, so this model.json was not written by save_inference")


def _build(net, model, records, params, what):
    ops = field(model, "ops", list, what)
    types = [field(op, "type", str, f"{what}: op {i}") for i, op in enumerate(ops)]
    schemas = [_schema(t, i, what) for i, t in enumerate(types)]
    fork = next((i for i, s in enumerate(schemas) if s.mode_attr), len(types))
    variables = {}
    try:
        for name, rec in records.items():
            if rec["data"]:
                variables[name] = net.add_data(name, rec["shape"], rec["dtype"])
            elif rec["persistable"]:
                check_reserved_name(name)
                var = net.scope.new_var(name, persistable=True, trainable=rec["trainable"])
                var.set(net.place.to_device(params[name]))
                variables[name] = var
        for i, (op, t) in enumerate(zip(ops, types)):
            section = "trunk" if i < fork else "infer"
            net.append_op(_make_op(net, op, t, i, section, records, variables, what), section)
    except (OpError, ValueError, TypeError) as e:
        if isinstance(e, InferenceModelError):
            raise
        raise InferenceModelError(f"{what}: the model does not build: {e}") from e
    fetches = []
    for name in field(model, "fetches", list, what):
        if name not in variables:
            raise InferenceModelError(f"{what}: fetch {name!r} is not computed by the model")
        fetches.append(variables[name])
    for name in field(model, "feeds", list, what):
        if name not in net.data_vars:
            raise InferenceModelError(f"{what}: feed {name!r} is not a data variable of the "
                                      "model")
    _check_writes(net, what)
    bad = checkpoint_values.problems(net, params)
    if bad:
        raise InferenceModelError(f"{what}: the params file holds values a model may not: "
                                  + "; ".join(bad))
    net.default_fetches = fetches
    return net


def _schema(op_type, index, what):
    try:
        return get_schema(op_type)
    except OpError:
        raise InferenceModelError(f"{what}: op {index} has type {op_type!r}, which this "
                                  f"minigraph does not know (it knows "
                                  f"{', '.join(registered_ops())})") from None


def _make_op(net, op, op_type, index, section, records, variables, what):
    where = f"{what}: op {index} ({op_type})"
    schema = get_schema(op_type)
    kwargs = {}
    for slots, key in ((schema.inputs, "inputs"), (schema.outputs, "outputs")):
        bound = field(op, key, dict, where)
        for slot, names in bound.items():
            if slot not in [s.name for s in slots]:
                raise InferenceModelError(f"{where}: unknown {key[:-1]} slot {slot!r}")
            if names is None:
                continue
            many = isinstance(names, list)
            got = [_variable(net, n, section, records, variables, key, f"{where} slot {slot!r}")
                   for n in (names if many else [names])]
            kwargs[slot] = got if many else got[0]
    attrs = {k: decode_attr(v, f"{where} attribute {k!r}")
             for k, v in field(op, "attrs", dict, where).items()}
    if schema.mode_attr is not None:
        attrs[schema.mode_attr] = True
    built = Operator(op_type, **kwargs, **attrs)
    if "layer" in op:                   # optional: models saved before it have none
        built.layer = field(op, "layer", str, where)
    return built


def _variable(net, name, section, records, variables, key, where):
    var = variables.get(name) if isinstance(name, str) else None
    if var is not None:
        return var
    rec = records.get(name) if isinstance(name, str) else None
    if rec is None:
        raise InferenceModelError(f"{where}: names {name!r}, which is not among the variables")
    if key == "inputs":
        raise InferenceModelError(f"{where}: reads {name!r} before any op computes it")
    scope = net.scope if section == "trunk" else net.scopes["infer"]
    check_reserved_name(name)
    var = scope.new_var(name)
    var.declare(rec["shape"], rec["dtype"])
    variables[name] = var
    return var
