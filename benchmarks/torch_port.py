"""Run a PyTorch norm module and its minigraph port on the same data, and compare.

A "case" is a torch norm module (its class name and constructor arguments, bound to
their names), an input array and a dy; `run_torch` and `run_minigraph` each make one
training step (the output, dx, the parameters' gradients, the running estimates and
the counter after it) and then an evaluation forward, and `compare` says whether the
two agree. The port is the one docs/porting_from_pytorch.md describes:

    BatchNormNd(C, eps, m, affine, track, bias)  layers.batch_norm(epsilon=eps, momentum=1 - m
                                                  (None: None), affine, track_running_stats,
                                                  bias, first_batch_sets_estimates=False)
    InstanceNormNd(C, eps, m, affine, track, bias) layers.instance_norm(epsilon=eps, momentum=
                                                  1 - m (None: 1.0, torch never updates then),
                                                  affine, track_running_stats, bias,
                                                  first_batch_sets_estimates=False,
                                                  spatial_dims=N)
    GroupNorm(G, C, eps, affine, bias)           layers.group_norm(G, epsilon, affine, bias)
    LayerNorm(shape, eps, elementwise_affine, bias) layers.layer_norm(begin_norm_axis=
                                                  x.ndim - len(shape), epsilon, scale=
                                                  elementwise_affine, shift=that and bias)

The parameters of both are set to the same random values; x is a minigraph parameter so
its gradient can be fetched, and plain SGD with learning rate 0 leaves everything as it
was but the running estimates. A benchmark helper: PyTorch is never imported by tests.
"""
from __future__ import annotations

import inspect

import numpy as np

BATCH = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
         "LazyBatchNorm2d", "LazyBatchNorm3d")
INSTANCE = ("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LazyInstanceNorm1d",
            "LazyInstanceNorm2d", "LazyInstanceNorm3d")


def bind(kind, args=(), kwargs=None):
    """The constructor arguments of torch.nn.<kind> by name, defaults included."""
    import torch

    sig = inspect.signature(getattr(torch.nn, kind).__init__)
    bound = sig.bind(None, *args, **(kwargs or {}))
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop("self", None)
    named.update(named.pop("kwargs", {}) or {})
    for k in ("device", "dtype", "factory_kwargs"):
        named.pop(k, None)
    return named


def random_params(shape, seed):
    r = np.random.default_rng(seed)
    return r.uniform(0.5, 1.5, shape), r.normal(0.0, 1.0, shape)


# ---- PyTorch ---------------------------------------------------------------------------

def batches(x):
    """x as a list of training batches (one array: one batch)."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def run_torch(kind, named, x, dy, dtype, eval_x=None, train=True, steps=True):
    """{y, dx, dscale, dbias, mean, var, counter, y_eval} of torch.nn.<kind>(**named)
    after a training step on each batch of x (an array, or a list of them; dy the output
    gradient; the last step's values) and one evaluation forward on eval_x (default the
    last batch). train=False: the steps run in eval mode (y, dx and the parameters'
    gradients with the running estimates as constants). steps=False: the evaluation
    forward alone."""
    import torch

    tdt = torch.float64 if dtype == np.float64 else torch.float32
    xs = batches(x)
    m = getattr(torch.nn, kind)(**named).to(tdt)
    if kind.startswith("Lazy"):     # materialise the parameters, then forget that batch
        with torch.no_grad():
            m(torch.tensor(xs[0], dtype=tdt))
        if getattr(m, "running_mean", None) is not None:
            m.reset_running_stats()
    m.train(train)
    if getattr(m, "weight", None) is not None:
        scale, bias = random_params(tuple(m.weight.shape), 1)
        with torch.no_grad():
            m.weight.copy_(torch.tensor(scale))
            if getattr(m, "bias", None) is not None:
                m.bias.copy_(torch.tensor(bias))
    out = {}
    for xb in xs if steps else ():
        xt = torch.tensor(xb, dtype=tdt, requires_grad=True)
        m.zero_grad()
        y = m(xt)
        y.backward(torch.tensor(dy, dtype=tdt))
    if steps:
        out["y"], out["dx"] = y.detach().numpy(), xt.grad.numpy()
    if steps and getattr(m, "weight", None) is not None:
        out["dscale"] = m.weight.grad.numpy()
        if getattr(m, "bias", None) is not None:
            out["dbias"] = m.bias.grad.numpy()
    if getattr(m, "running_mean", None) is not None:
        out["mean"], out["var"] = m.running_mean.numpy().copy(), m.running_var.numpy().copy()
        if m.num_batches_tracked is not None:
            out["counter"] = int(m.num_batches_tracked)
    m.eval()
    with torch.no_grad():
        out["y_eval"] = m(torch.tensor(xs[-1] if eval_x is None else eval_x, dtype=tdt)).numpy()
    return out


# ---- minigraph ---------------------------------------------------------------------------

def our_momentum(m, none_means):
    """PyTorch's momentum m (weight of the batch) as ours (weight of the old estimate)."""
    return none_means if m is None else 1.0 - m


def build_minigraph(kind, named, shape, dtype, train=True, layout="NCHW"):
    """(net, y, x, dy, loss) of the minigraph port of torch.nn.<kind>(**named) for an input
    of `shape` (the module doc's table); raises where the port (or minigraph) refuses.
    train=False ports eval-mode training steps: batch_norm(use_global_est=True).
    layout "NHWC": x has its channels last (shape is then channels-last too)."""
    import minigraph as mg
    from minigraph import layers as L
    from minigraph.initializer import Constant

    net = mg.Net(seed=0)
    x = net.create_parameter("x", shape, dtype, Constant(0.0))
    dy = net.create_parameter("dy", shape, dtype, Constant(0.0), trainable=False)
    a = named
    channels = shape[1] if layout == "NCHW" else shape[-1]
    if kind in BATCH:
        c = a.get("num_features", channels)
        if not kind.startswith("Lazy") and c != channels:
            raise ValueError(f"{kind}: num_features {c} != the {channels} channels of x")
        y = L.batch_norm(net, x, epsilon=a["eps"], momentum=our_momentum(a["momentum"], None),
                         affine=a["affine"], track_running_stats=a["track_running_stats"],
                         bias=a.get("bias", True), first_batch_sets_estimates=False, name="m",
                         sync=kind == "SyncBatchNorm", data_layout=layout,
                         use_global_est=not train and a["track_running_stats"])
    elif kind in INSTANCE:
        spatial = int(kind[-2])
        y = L.instance_norm(net, x, epsilon=a["eps"], affine=a["affine"],
                            track_running_stats=a["track_running_stats"],
                            momentum=our_momentum(a["momentum"], 1.0), bias=a.get("bias", True),
                            first_batch_sets_estimates=False, spatial_dims=spatial,
                            data_layout=layout, name="m")
    elif kind == "GroupNorm":
        if a["num_channels"] != channels:
            raise ValueError(f"GroupNorm: num_channels {a['num_channels']} != the {channels} "
                             "channels of x")
        y = L.group_norm(net, x, a["num_groups"], epsilon=a["eps"], affine=a["affine"],
                         bias=a.get("bias", True), data_layout=layout, name="m")
    elif kind == "LayerNorm":
        ns = a["normalized_shape"]
        ns = (ns,) if isinstance(ns, int) else tuple(ns)
        begin = len(shape) - len(ns)
        if begin < 0 or tuple(shape[max(begin, 0):]) != ns:
            raise ValueError(f"LayerNorm: normalized_shape {ns} is not the trailing shape of "
                             f"x {tuple(shape)}")
        y = L.layer_norm(net, x, begin_norm_axis=begin, epsilon=a["eps"],
                         scale=a["elementwise_affine"],
                         shift=a["elementwise_affine"] and a.get("bias", True), name="m")
    else:
        raise ValueError(f"no minigraph port of {kind}")
    loss = L.reduce_sum(net, L.multiply(net, y, dy))
    mg.optimizer.SGD(0.0).minimize(net, loss)
    return net, y, x, dy, loss


def to_last(a, batched=True):
    """A channels-first array, (N, C, ...) or without a batch axis (C, ...), channels last."""
    return np.ascontiguousarray(np.moveaxis(a, 1 if batched else 0, -1))


def to_first(a, batched=True):
    """to_last undone."""
    return np.ascontiguousarray(np.moveaxis(a, -1, 1 if batched else 0))


def run_minigraph(kind, named, x, dy, dtype, eval_x=None, train=True, steps=True,
                  layout="NCHW"):
    """run_torch's dict from the minigraph port. layout "NHWC": the same (channels-first)
    data goes in channels last, and y, dx and y_eval come back channels first."""
    xs = batches(x)
    batched = not (kind in INSTANCE and xs[0].ndim == int(kind[-2]) + 1)
    if layout == "NHWC":
        xs, dy = [to_last(a, batched) for a in xs], to_last(dy, batched)
        eval_x = None if eval_x is None else to_last(eval_x, batched)
    net, y, xv, dyv, loss = build_minigraph(kind, named, xs[0].shape, np.dtype(dtype), train,
                                            layout)
    dyv.set(np.ascontiguousarray(dy, dtype))
    names = [v.name for v in net.persistables()]
    wanted = {"y": y, "dx": net.grad(xv)}
    if "m.scale" in names:
        shape = net.var("m.scale").shape
        scale, bias = random_params(shape, 1)
        net.var("m.scale").set(scale.astype(dtype))
        wanted["dscale"] = net.grad(net.var("m.scale"))
        if "m.bias" in names:
            net.var("m.bias").set(bias.astype(dtype))
            wanted["dbias"] = net.grad(net.var("m.bias"))
    out = {}
    for xb in xs if steps else ():
        xv.set(np.ascontiguousarray(xb, dtype))
        out = dict(zip(wanted, net.train(fetch=list(wanted.values()))))
    if not steps:
        xv.set(np.ascontiguousarray(xs[-1], dtype))
    if "m.estimated_mean" in names:
        out["mean"] = net.var("m.estimated_mean").get().copy()
        out["var"] = net.var("m.estimated_var").get().copy()
        out["counter"] = int(net.var("m.num_batches").get())
    if eval_x is not None:
        xv.set(np.ascontiguousarray(eval_x, dtype))
    (out["y_eval"],) = net.infer(fetch=[y])
    if layout == "NHWC":
        for key in ("y", "dx", "y_eval"):
            if key in out:
                out[key] = to_first(out[key], batched)
    return out


# ---- comparing ---------------------------------------------------------------------------

TOL = {np.float64: 1e-9, np.float32: 2e-4}


def difference(a, b):
    """max |a - b| relative to max(1, max |b|) (0 for empty arrays); a parameter that
    minigraph keeps flattened (layer_norm's) is compared value for value."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape and a.ndim == 1 and a.size == b.size:
        a = a.reshape(b.shape)
    if a.shape != b.shape:
        return np.inf
    if not a.size:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def compare(theirs, ours, dtype, skip=()):
    """(worst relative difference, [what differs]) over the keys both have; `skip`:
    keys left out (documented differences)."""
    worst, bad = 0.0, []
    for key in theirs:
        if key in skip:
            continue
        if key not in ours:
            bad.append(f"{key} missing")
            continue
        if key == "counter":
            if theirs[key] != ours[key]:
                bad.append(f"counter {ours[key]} vs {theirs[key]}")
            continue
        d = difference(ours[key], theirs[key])
        worst = max(worst, d)
        if not d <= TOL[dtype]:
            bad.append(f"{key} {d:.2g}")
    return worst, bad
