"""mg.io.load_parameters (io/checkpoint.py): parameters and buffers from a mapping
renamed as PyTorch names them, from np.savez files; each mismatch named and nothing
changed; strict=False and what it never sets (optimizer state)."""
from __future__ import annotations

import numpy as np
import pytest
from checkpoint_cases import build, same, snapshot, trained

import minigraph as mg
from minigraph import io


def torch_names(net):
    """A state_dict as PyTorch would name this net's parameters and buffers (Linear
    weights transposed, as torch stores them (out, in))."""
    sd = {}
    for v in net.persistables():
        if v.name.startswith("adam_"):
            continue
        layer, what = v.name.split(".", 1)
        key = {"w": "weight", "b": "bias", "scale": "weight", "bias": "bias",
               "estimated_mean": "running_mean", "estimated_var": "running_var",
               "num_batches": "num_batches_tracked"}[what]
        value = v.get()
        sd[f"model.{layer}.{key}"] = value.T.copy() if layer in ("fc1", "head") and \
            what == "w" else value
    return sd


def from_torch(name):
    layer, key = name.split(".")[1:]
    what = {"running_mean": "estimated_mean", "running_var": "estimated_var",
            "num_batches_tracked": "num_batches"}.get(key)
    if what is None:
        what = ("scale" if layer.startswith("bn") else "w") if key == "weight" else \
            ("bias" if layer.startswith("bn") else "b")
    return f"{layer}.{what}"


def test_load_parameters_from_a_renamed_state_dict(tmp_path):
    a, _ = trained(tmp_path)
    sd = torch_names(a)
    for key in ("model.fc1.weight", "model.head.weight"):
        sd[key] = sd[key].T.copy()              # what a porting script does
    b, _ = build(opt=mg.optimizer.Adam(0.003), seed=5)
    state = {n: v for n, v in snapshot(b).items() if n.startswith("adam_")}
    names = mg.io.load_parameters(b, sd, rename=from_torch)
    assert sorted(names) == sorted(n for n in snapshot(a) if not n.startswith("adam_"))
    assert same(snapshot(b), snapshot(a), names)
    assert same(snapshot(b), state, state) and b.optimizer.learning_rate == 0.003


def test_load_parameters_names_each_mismatch_and_changes_nothing(tmp_path):
    a, _ = trained(tmp_path)
    sd = {n: v.get() for n, v in ((v.name, v) for v in a.persistables())
          if not n.startswith("adam_")}
    sd["fc1.w"] = sd["fc1.w"].T.copy()                       # torch's layout, not ours
    sd["c1.b"] = sd["c1.b"].astype(np.float64)
    sd["head.b"] = sd["head.b"][:1]
    sd["bn1.estimated_var"] = -sd["bn1.estimated_var"]
    b, _ = build(opt=mg.optimizer.Adam(0.01), seed=5)
    before = snapshot(b)
    with pytest.raises(io.CheckpointError) as err:
        io.load_parameters(b, sd)
    msg = str(err.value)
    assert "3 problem(s); nothing was loaded" in msg
    assert "wrong shape for 'fc1.w': the net has (64, 16), the file (16, 64)" in msg
    assert "wrong dtype for 'c1.b': the net has float32, the file float64" in msg
    assert "wrong shape for 'head.b'" in msg
    assert same(snapshot(b), before, before)
    sd["fc1.w"], sd["c1.b"], sd["head.b"] = (a.var(n).get() for n in ("fc1.w", "c1.b", "head.b"))
    with pytest.raises(io.CheckpointError, match="variance estimate 'bn1.estimated_var'"):
        io.load_parameters(b, sd)
    assert same(snapshot(b), before, before)


def test_load_parameters_strict_false_and_what_it_never_sets(tmp_path):
    a, _ = trained(tmp_path)
    b, _ = build(head="head2", opt=mg.optimizer.Adam(0.01), seed=5)
    sd = {"fc1.w": a.var("fc1.w").get(), "ghost": np.zeros(3, np.float32),
          "adam_0.fc1.w.moment1": np.ones((64, 16), np.float32), "skip.me": np.zeros(1)}
    moment = b.var("adam_0.fc1.w.moment1").get()
    missing, unexpected = io.load_parameters(
        b, sd, strict=False, rename=lambda n: None if n.startswith("skip") else n)
    assert "c1.w" in missing and "fc1.w" not in missing and "adam_0.fc1.w.moment1" not in missing
    assert sorted(unexpected) == ["adam_0.fc1.w.moment1", "ghost"]
    assert np.array_equal(b.var("fc1.w").get(), a.var("fc1.w").get())
    assert np.array_equal(b.var("adam_0.fc1.w.moment1").get(), moment)
    with pytest.raises(io.CheckpointError, match="unexpected 'adam_0.fc1.w.moment1': optimizer "
                                                 "state, which load_parameters never sets"):
        io.load_parameters(b, sd, rename={"skip.me": None})
    with pytest.raises(io.CheckpointError, match="rename gives 'fc1.w' for both"):
        io.load_parameters(b, sd, strict=False, rename={"ghost": "fc1.w"})


def test_load_parameters_from_a_plain_savez_file(tmp_path):
    a, ck = trained(tmp_path)
    model = {n: v for n, v in snapshot(a).items() if not n.startswith("adam_")}
    np.savez(tmp_path / "plain.npz", **model)
    np.savez_compressed(tmp_path / "packed.npz", **model)
    for path in (tmp_path / "plain.npz", tmp_path / "packed.npz"):
        b, _ = build(opt=mg.optimizer.Adam(0.01), seed=5)
        assert sorted(io.load_parameters(b, path)) == sorted(model)
        assert same(snapshot(b), model, model)
    with pytest.raises(io.CheckpointError, match="a minigraph checkpoint .* load its parameters "
                                                 "with mg.io.load\\(net, path, "
                                                 "parts=\\['parameters'\\]\\)"):
        io.load_parameters(b, ck)
    np.savez(tmp_path / "objects.npz", fc1=np.array([{"a": 1}], dtype=object))
    with pytest.raises(io.CheckpointError, match="object arrays are not allowed"):
        io.load_parameters(b, tmp_path / "objects.npz", strict=False)
    with pytest.raises(TypeError, match="source must be a mapping of names to arrays"):
        io.load_parameters(b, [1, 2])
    with pytest.raises(io.CheckpointError, match="'fc1.w' holds object, not numbers"):
        io.load_parameters(b, {"fc1.w": np.array([None])}, strict=False)
