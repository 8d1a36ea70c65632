"""The inference model directory: save_inference / load_inference."""
from __future__ import annotations

import io as bytes_io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from inference_models import batch, params_path, save_trained, trained

import minigraph as mg
from minigraph import io
from minigraph.io.model_format import decode_attr, encode_attr


def npy_bytes(array):
    f = bytes_io.BytesIO()
    np.lib.format.write_array(f, array, allow_pickle=False)
    return f.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_trained(tmp_path_factory.mktemp("m"))


def test_the_directory_holds_a_documented_json_and_the_params(saved):
    import hashlib

    net, _, d = saved
    model = json.loads((d / "model.json").read_text())
    digest = hashlib.sha256(params_path(d).read_bytes()).hexdigest()
    assert model["params"] == {"file": f"params-{digest[:16]}.npz", "sha256": digest}
    assert sorted(p.name for p in d.iterdir()) == ["model.json", f"params-{digest[:16]}.npz"]
    assert model["format"] == "minigraph-inference" and model["version"] == 2
    assert model["feeds"] == ["image"] and model["fetches"] == ["fc2.out", "fc1.out"]
    types = [op["type"] for op in model["ops"]]
    assert types[0] == "conv2d" and "batch_norm" in types
    assert not any(t.endswith("_grad") or t in ("momentum", "sgd", "mean") for t in types)
    bn = next(op for op in model["ops"] if op["type"] == "batch_norm")
    assert bn["attrs"]["is_infer"] is True and bn["inputs"]["x"] == "c1.out"
    conv = model["ops"][0]
    assert conv["attrs"]["paddings"] == [1, 1] and conv["inputs"]["filter"] == "c1.w"
    records = {v["name"]: v for v in model["variables"]}
    assert records["image"] == {"name": "image", "shape": [-1, 1, 8, 8], "dtype": "float32",
                                "persistable": False, "trainable": False, "data": True}
    assert records["c1.out"]["shape"] == [-1, 4, 8, 8]
    assert records["bn1.estimated_mean"]["persistable"] and not \
        records["bn1.estimated_mean"]["trainable"]
    assert "label" not in records and not any("velocity" in n for n in records)
    with np.load(params_path(d)) as npz:
        persist = {n for n, r in records.items() if r["persistable"]}
        assert set(npz.files) == persist | {"__format__", "__manifest__"}
        parts = json.loads(str(npz["__manifest__"]))["parts"]
        assert "c1.w" in parts["parameters"] and "bn1.estimated_var" in parts["estimates"]
        assert np.array_equal(npz["bn2.estimated_var"], net.var("bn2.estimated_var").get())


def test_load_inference_infers_like_the_net(saved):
    net, h, d = saved
    m = mg.io.load_inference(d)
    assert isinstance(m, mg.Net) and m.optimizer is None
    x = batch()
    want = net.infer(feed={"image": x}, fetch=[h["logits"], "fc1.out"])
    got = m.infer(feed={"image": x})                      # fetch=None: the saved fetches
    assert len(got) == 2
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
    (logits,) = m.infer(feed={"image": x}, fetch=["fc2.out"])
    assert logits.tobytes() == want[0].tobytes()
    before = {v.name: v.get().copy() for v in m.persistables()}
    m.infer(feed={"image": batch(seed=5)})
    assert all(np.array_equal(v.get(), before[v.name]) for v in m.persistables())
    bns = [op for op in m.ops("infer") if op.type == "batch_norm"]
    assert len(bns) == 2 and all(op.attrs["is_infer"] is True for op in bns)
    assert [op.type for op in m.section("trunk")] == ["conv2d", "elementwise_add"]


def test_a_loaded_model_cannot_train(saved):
    m = mg.io.load_inference(saved[2])
    with pytest.raises(RuntimeError, match=r"this is an inference net \(loaded from"):
        m.train(feed={"image": batch()})


def test_load_inference_in_a_process_that_never_built_the_net(saved, tmp_path):
    net, h, d = saved
    x = batch(4)
    np.save(tmp_path / "x.npy", x)
    (want,) = net.infer(feed={"image": x}, fetch=[h["logits"]])
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import minigraph as mg
        m = mg.io.load_inference({str(d)!r})
        logits, hidden = m.infer(feed={{"image": np.load({str(tmp_path / "x.npy")!r})}})
        np.save({str(tmp_path / "out.npy")!r}, logits)
        assert not any(k.startswith(("tests", "test_", "minigraph.examples")) for k in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert np.load(tmp_path / "out.npy").tobytes() == want.tobytes()


def test_feeds_and_fetches_as_variables_and_a_net_that_never_forks(tmp_path):
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3))
    y = mg.layers.relu(net, mg.layers.fc(net, x, size=4, name="a"))
    out = mg.layers.fc(net, y, size=2, name="b")
    d = mg.io.save_inference(net, tmp_path / "m", feeds=[x], fetches=[out])
    m = mg.io.load_inference(d)
    assert m.section("infer") == () and len(m.section("trunk")) == 5
    v = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    (want,) = net.infer(feed={"x": v}, fetch=[out])
    (got,) = m.infer(feed={"x": v})
    assert got.tobytes() == want.tobytes()


def test_attribute_types_survive_the_file(tmp_path):
    net, h = trained(steps=1, momentum=None)           # momentum=None: a null attribute
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])
    m = mg.io.load_inference(d)
    for a, b in zip(net.ops("infer"), m.ops("infer")):
        assert a.type == b.type and dict(a.attrs) == dict(b.attrs)
        assert all(type(a.attrs[k]) is type(b.attrs[k]) for k in a.attrs)
    bn = next(op for op in m.ops("infer") if op.type == "batch_norm")
    assert bn.attrs["momentum"] is None
    pool = next(op for op in m.ops("infer") if op.type == "pool2d")
    assert pool.attrs["ksize"] == (2, 2) and pool.attrs["pool_type"] == "max"
    assert isinstance(pool.attrs["global_pooling"], bool)
    for value in (None, True, 3, -1, 2.5, 1e-5, "NCHW", (1, 2), ((1, 2), (3,)), float("inf"),
                  -float("inf")):
        encoded = encode_attr(value, "test")
        assert json.loads(json.dumps(encoded, allow_nan=False)) == encoded
        assert decode_attr(encoded, "test") == value
    assert np.isnan(decode_attr(encode_attr(float("nan"), "t"), "t"))
    with pytest.raises(io.InferenceModelError, match="cannot be written"):
        encode_attr(np.zeros(2), "op 0 (x) attribute 'y'")


def test_save_inference_misuse(tmp_path):
    net, h = trained(steps=0)
    cases = [
        (dict(feeds=["nope"], fetches=[h["logits"]]), "feed 'nope' is not a data variable"),
        (dict(feeds=[], fetches=[h["logits"]]), "need the data 'image', which is not among"),
        (dict(feeds=["image"], fetches=[]), "non-empty list"),
        (dict(feeds=["image"], fetches="fc2.out"), "non-empty list"),
        (dict(feeds=["image"], fetches=["ghost"]), "fetch 'ghost'"),
        (dict(feeds=["image", "image"], fetches=[h["logits"]]), "given twice"),
    ]
    for kwargs, message in cases:
        with pytest.raises(io.InferenceModelError, match=message):
            mg.io.save_inference(net, tmp_path / "m", **kwargs)
    assert not (tmp_path / "m" / "model.json").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        mg.io.save_inference(net, tmp_path / "file", feeds=["image"], fetches=[h["logits"]])


# ---- damaged, missing and newer directories --------------------------------------------

def edit_model(d, change):
    model = json.loads((d / "model.json").read_text())
    change(model)
    (d / "model.json").write_text(json.dumps(model))


@pytest.fixture
def model_dir(saved, tmp_path):
    net, h, _ = saved
    return mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(version=3), r"newer minigraph \(format version 3\); this minigraph "
                                    "reads version 2"),
    (lambda m: m.update(format="something-else"), "not a minigraph inference model"),
    (lambda m: m.pop("ops"), "damaged \\(missing key 'ops'\\)"),
    (lambda m: m.pop("fetches"), "missing key 'fetches'"),
    (lambda m: m["variables"][0].pop("dtype"), "variable 0: model.json is damaged \\(missing "
                                               "key 'dtype'\\)"),
    (lambda m: m["variables"][1].update(shape="big"), "'shape' must be list or null"),
    (lambda m: m["ops"][0].update(type="fancy_conv"), "op 0 has type 'fancy_conv', which this "
                                                      "minigraph does not know"),
    (lambda m: m["ops"][0]["inputs"].update(x="nowhere"), "not among the variables"),
    (lambda m: m["ops"][0]["inputs"].update(bogus="image"), "unknown input slot 'bogus'"),
    (lambda m: m["ops"][0]["attrs"].update(groups="two"), "does not build: conv2d: attribute "
                                                         "'groups'"),
    (lambda m: m["ops"][0]["attrs"].update(groups={"float": "many"}), "not an attribute value"),
    (lambda m: m.update(fetches=["nothing"]), "fetch 'nothing' is not computed"),
    (lambda m: m["params"].update(file="../../etc/passwd"), "must be 'params-[0-9a-f]{16}"),
    (lambda m: m["params"].update(sha256="0" * 64), "must be 'params-0000000000000000.npz'"),
    (lambda m: m["params"].update(sha256="../x"), "not 64 hex digits"),
    (lambda m: m.update(version=1), "must be 'params.npz' \\(format version 1\\)"),
    (lambda m: m["variables"][0].update(dtype="object"), "unknown dtype 'object'"),
])
def test_a_damaged_model_json_is_a_clear_error(model_dir, change, message):
    edit_model(model_dir, change)
    with pytest.raises(io.InferenceModelError, match=message):
        mg.io.load_inference(model_dir)


def test_missing_files_and_unparseable_json(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        mg.io.load_inference(tmp_path / "absent")
    text = (model_dir / "model.json").read_text()
    (model_dir / "model.json").write_text(text[: len(text) // 2])
    with pytest.raises(io.InferenceModelError, match="model.json is damaged \\(not valid JSON"):
        mg.io.load_inference(model_dir)
    (model_dir / "model.json").write_text(text.replace("1e-05", "NaN"))
    with pytest.raises(io.InferenceModelError, match="not valid JSON"):
        mg.io.load_inference(model_dir)
    (model_dir / "model.json").unlink()
    with pytest.raises(io.InferenceModelError, match="missing model.json"):
        mg.io.load_inference(model_dir)
    (model_dir / "model.json").write_text(text)
    params = params_path(model_dir)
    params.unlink()
    with pytest.raises(io.InferenceModelError, match=f"missing {params.name}"):
        mg.io.load_inference(model_dir)


def test_params_missing_an_entry_or_damaged(model_dir, saved):
    import hashlib
    import zipfile

    def install(data):
        """Put `data` in place as the params file model.json names (renamed by its hash)."""
        digest = hashlib.sha256(data).hexdigest()
        params_path(model_dir).unlink()
        (model_dir / f"params-{digest[:16]}.npz").write_bytes(data)
        edit_model(model_dir, lambda m: m["params"].update(
            file=f"params-{digest[:16]}.npz", sha256=digest))

    good = params_path(model_dir).read_bytes()
    params_path(model_dir).write_bytes(good[:-1] + b"!")
    with pytest.raises(io.InferenceModelError, match="SHA-256 differs"):
        mg.io.load_inference(model_dir)
    with zipfile.ZipFile(bytes_io.BytesIO(good)) as src, \
            zipfile.ZipFile(model_dir / "less.npz", "w") as dst:
        for info in src.infolist():
            if info.filename not in ("fc2.b.npy", "__manifest__.npy"):
                dst.writestr(info, src.read(info))
            elif info.filename == "__manifest__.npy":
                m = json.loads(str(np.load(bytes_io.BytesIO(src.read(info)))))
                m["parts"]["parameters"].remove("fc2.b")
                dst.writestr(info, npy_bytes(np.array(json.dumps(m))))
    install((model_dir / "less.npz").read_bytes())
    with pytest.raises(io.InferenceModelError, match="npz: does not match model.json: "
                                                     "missing 'fc2.b'"):
        mg.io.load_inference(model_dir)
    install(good[:-100])
    with pytest.raises(io.CheckpointError, match="damaged minigraph checkpoint"):
        mg.io.load_inference(model_dir)


def test_saving_again_replaces_both_files_consistently(saved, tmp_path):
    net, h, _ = saved
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[h["logits"]])
    (d / "notes.txt").write_text("kept")
    mg.io.save_inference(net, d, feeds=["image"], fetches=["fc1.out"])
    m = mg.io.load_inference(d)
    assert [v.name for v in m.default_fetches] == ["fc1.out"]
    assert sorted(p.name for p in d.iterdir()) == ["model.json", "notes.txt",
                                                   params_path(d).name]


def test_the_newer_layers_survive_the_file(tmp_path):
    """add, concat, dropout (mode-dependent, with a seed), global pooling, flatten,
    reshape (a -1), transpose (a tuple), leaky_relu (a float), softmax (an axis)."""
    L = mg.layers
    net = mg.Net(seed=0)
    image = L.data(net, "image", shape=(-1, 1, 6, 6))
    a = L.relu(net, L.batch_norm(net, L.conv2d(net, image, num_filters=3, filter_size=3,
                                               padding=1, name="c1"), name="bn1"))
    b = L.conv2d(net, image, num_filters=3, filter_size=1, name="c2")
    h = L.dropout(net, L.concat(net, [L.add(net, a, b), b], axis=1), p=0.3)
    h = L.flatten(net, L.pool2d(net, h, global_pooling=True, pool_type="avg"))
    h = L.leaky_relu(net, L.fc(net, h, size=10, name="fc"), alpha=0.2)
    out = L.softmax(net, L.transpose(net, L.reshape(net, h, (-1, 2, 5)), (0, 2, 1)), axis=-1)
    d = mg.io.save_inference(net, tmp_path / "m", feeds=["image"], fetches=[out])
    m = mg.io.load_inference(d)
    for x, y in zip(net.ops("infer"), m.ops("infer")):
        assert x.type == y.type and dict(x.attrs) == dict(y.attrs)
    assert {"add", "concat", "dropout", "flatten", "reshape", "transpose", "softmax",
            "leaky_relu"} <= {op.type for op in m.ops("infer")}
    v = np.random.default_rng(0).standard_normal((4, 1, 6, 6)).astype(np.float32)
    (want,) = net.infer(feed={"image": v}, fetch=[out])
    (got,) = m.infer(feed={"image": v})
    assert got.shape == (4, 5, 2) and got.tobytes() == want.tobytes()


# ---- a tampered graph, the layers of its ops -------------------------------------------

def test_a_model_whose_op_writes_a_parameter_is_refused(model_dir):
    """A tampered model.json whose op wrote fc2.b in place loaded, and every infer()
    then doubled fc2.b."""
    def double_the_bias(m):
        m["ops"].insert(0, {"type": "scale", "inputs": {"x": "fc2.b"},
                            "outputs": {"out": "fc2.b"}, "attrs": {"scale": 2.0}})

    edit_model(model_dir, double_the_bias)
    with pytest.raises(io.InferenceModelError, match="op 0 \\(scale\\) writes the persistable "
                                                     "'fc2.b' \\(output slot 'out'\\); an "
                                                     "inference model never changes"):
        mg.io.load_inference(model_dir)


def test_reserved_names_in_a_model_are_refused(model_dir):
    def rename(m):
        text = json.dumps(m).replace('"c1.out"', '"c1.out@GRAD"')
        m.clear()
        m.update(json.loads(text))

    edit_model(model_dir, rename)
    with pytest.raises(io.InferenceModelError, match="'c1.out@GRAD' is reserved"):
        mg.io.load_inference(model_dir)


def test_the_model_keeps_the_layer_each_op_belongs_to(saved, tmp_path):
    net, h, _ = saved
    fast = mg.passes.optimize_for_inference(net)
    d = mg.io.save_inference(fast, tmp_path / "m", feeds=["image"], fetches=[h["logits"].name])
    model = json.loads((d / "model.json").read_text())
    assert [(op["type"], op["layer"]) for op in model["ops"]] == [
        ("fused_conv2d", "c1"), ("fused_fc", "fc1"), ("fused_fc", "fc2")]    # pool fused
    loaded = mg.io.load_inference(d)
    assert [op.layer for op in loaded.ops("infer")] == ["c1", "fc1", "fc2"]
    # a model written before ops named their layer loads, its layers read off its names
    for op in model["ops"]:
        del op["layer"]
    (d / "model.json").write_text(json.dumps(model))
    old = mg.io.load_inference(d)
    assert [op.layer for op in old.ops("infer")] == [None] * 3
    assert "layer:pool2d_0" in old.to_dot(level="layer")      # its output's name
    model["ops"][0]["layer"] = 7
    (d / "model.json").write_text(json.dumps(model))
    with pytest.raises(io.InferenceModelError, match="'layer' must be str"):
        mg.io.load_inference(d)
