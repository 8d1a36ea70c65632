"""What the checkpoint tests share: a small net (build() makes it: conv c1, batch norm
bn1, fc fc1, a head; trained() trains and saves it), snapshot() / same() to compare
persistables bit for bit, and rewrite() to change a checkpoint file."""
from __future__ import annotations

import json

import numpy as np

import minigraph as mg
from minigraph import io
from minigraph import layers as L

rng = np.random.default_rng(0)
IMAGES = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
LABELS = (IMAGES[:, 0, :4, :4].mean(axis=(1, 2)) > IMAGES[:, 0, 4:, 4:].mean(axis=(1, 2)))


def build(head="head", classes=2, opt=None, seed=0):
    """image -> conv c1 -> batch norm bn1 -> relu -> max pool -> fc fc1 (16) -> relu
    -> fc `head` (classes); minimised by `opt` when given: (net, loss)."""
    net = mg.Net(seed=seed)
    image = L.data(net, "image", shape=(-1, 1, 8, 8))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.conv2d(net, image, num_filters=4, filter_size=3, padding=1, name="c1")
    h = L.pool2d(net, L.relu(net, L.batch_norm(net, h, name="bn1")), 2)
    h = L.relu(net, L.fc(net, h, 16, name="fc1"))
    logits = L.fc(net, h, classes, name=head)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    if opt is not None:
        opt.minimize(net, loss)
    return net, loss


def feed(labels=LABELS):
    """The fixed batch of 32 images, with `labels`."""
    return {"image": IMAGES, "label": labels.astype(np.int64)}


def trained(tmp_path, steps=5, opt=None):
    """build() minimised by `opt` (Adam 0.01), trained `steps` steps on feed() and saved
    whole in tmp_path / ck.npz: (net, the checkpoint's path)."""
    net, loss = build(opt=opt or mg.optimizer.Adam(0.01))
    for _ in range(steps):
        net.train(feed=feed(), fetch=[loss])
    return net, io.save(net, tmp_path / "ck.npz")


def snapshot(net):
    """Every persistable's value, by name."""
    return {v.name: v.get() for v in net.persistables()}


def same(a, b, names):
    """Whether snapshots `a` and `b` hold the same bytes for each of `names`."""
    return all(a[n].tobytes() == b[n].tobytes() for n in names)


def rewrite(src, dst, change):
    """Copy the checkpoint `src` to `dst` with change(arrays) applied; its manifest
    follows (removed arrays leave it, new ones join the parameters) unless the
    change touches the manifest itself."""
    with np.load(src) as npz:
        arrays = {k: npz[k] for k in npz.files}
    manifest = str(arrays["__manifest__"])
    change(arrays)
    if "__manifest__" in arrays and str(arrays["__manifest__"]) == manifest:
        m = json.loads(manifest)
        parts = {p: [n for n in names if n in arrays] for p, names in m["parts"].items()}
        listed = {n for names in parts.values() for n in names}
        parts.setdefault("parameters", []).extend(
            n for n in arrays if n not in listed and not n.startswith("__"))
        arrays["__manifest__"] = np.array(json.dumps({**m, "parts": parts}))
    with open(dst, "wb") as f:
        io.write_npz(f, arrays)
    return dst
