"""PyTorch's own norm test definitions, run in PyTorch and in minigraph.

    python benchmarks/torch_norm_tests.py [--quick] [--verbose]

Cases:
- the module inputs of torch/testing/_internal/common_modules.py (module_db) for
  BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d, GroupNorm and LayerNorm, their error inputs,
  and the same inputs through the Lazy and Sync variants PyTorch runs on the CPU
  (LazyBatchNormNd, LazyInstanceNormNd, SyncBatchNorm outside a process group);
- common_nn's LayerNorm module test (3d_no_affine_large_feature, and its eval copy);
- the norm tests of PyTorch's test/test_nn.py that run on the CPU (the InstanceNorm,
  LayerNorm and GroupNorm "general", "numeric", "empty" and error tests, the BatchNorm
  empty, update-stats, simple-average, eval, affine, grad and error tests, and the
  layer_norm eps and create_graph tests), with the shapes and settings they use.
Each case runs in float64 and float32: a training step (y, dx, the parameters'
gradients, the running estimates and the counter after it) and an evaluation forward,
in both frameworks (benchmarks/torch_port.py ports each module), or, for an error case,
checks that both refuse. It prints one line per case - pass, differ or cannot express,
with the reason - and the counts. Documented differences that are not compared (and
that the line says): the counter of an empty batch (minigraph's does not move, by
design) and InstanceNorm's counter (PyTorch never counts).

--quick leaves out the two cases of tens of millions of values (GroupNorm_numeric,
LayerNorm_numeric). PyTorch is a benchmark-only dependency; its testing modules also
need `expecttest` (pip install expecttest).
"""
from __future__ import annotations

import argparse
import random
import sys
from functools import partial

import numpy as np
from torch_port import INSTANCE, bind, compare, run_minigraph, run_torch

DTYPES = (np.float64, np.float32)
NORMS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
         "InstanceNorm3d", "GroupNorm", "LayerNorm")


class Result:
    """One case's outcome: status "pass", "differ" or "cannot express", and why."""

    def __init__(self, source, name, dtype, status, note=""):
        self.source, self.name, self.dtype = source, name, np.dtype(dtype).name
        self.status, self.note = status, note


def pair(source, name, kind, named, x, dtype, eval_x=None, train=True, skip=(), steps=True,
         variant=False):
    """Run a case in both frameworks and compare (see the module doc). A `variant` case
    (a Lazy input PyTorch's own tests do not run) that PyTorch cannot run is left out
    (None)."""
    xs = x if isinstance(x, list) else [x]
    xs = [np.asarray(a, dtype) for a in xs]
    dy = np.random.default_rng(3).standard_normal(xs[-1].shape).astype(dtype)
    if kind in INSTANCE:
        skip = tuple(skip) + ("counter (PyTorch's InstanceNorm never counts)",)
    if not xs[-1].size and "BatchNorm" in kind:
        skip = tuple(skip) + ("counter (an empty batch: ours does not move)",)
    try:
        theirs = run_torch(kind, named, xs, dy, dtype, eval_x, train, steps)
    except Exception as e:                                   # noqa: BLE001
        if variant:
            return None
        return refused(source, name, kind, named, xs, dy, dtype, e, eval_x, train)
    try:
        ours = run_minigraph(kind, named, xs, dy, dtype, eval_x, train, steps)
    except Exception as e:                                   # noqa: BLE001
        return Result(source, name, dtype, "cannot express", f"{type(e).__name__}: {e}")
    worst, bad = compare(theirs, ours, dtype, [k.split(" ")[0] for k in skip])
    note = f"max rel diff {worst:.1e}" + (f"; not compared: {', '.join(skip)}" if skip else "")
    if bad:
        return Result(source, name, dtype, "differ", "; ".join(bad))
    return Result(source, name, dtype, "pass", note)


def refused(source, name, kind, named, xs, dy, dtype, error, eval_x=None, train=True):
    """PyTorch refused the case: minigraph must refuse it too."""
    try:
        run_minigraph(kind, named, xs, dy, dtype, eval_x, train)
    except Exception as e:                                   # noqa: BLE001
        return Result(source, name, dtype, "pass",
                      f"both refuse: torch {type(error).__name__}, minigraph "
                      f"{type(e).__name__}: {str(e)[:90]}")
    return Result(source, name, dtype, "differ",
                  f"torch refuses ({type(error).__name__}: {error}) and minigraph runs")


def expect_error(source, name, kind, named, x, dtype, train=True):
    """A case PyTorch's test expects to raise: both must."""
    import torch

    tdt = torch.float64 if dtype == np.float64 else torch.float32
    try:
        m = getattr(torch.nn, kind)(**named).to(tdt)
        m.train(train)
        m(torch.tensor(np.asarray(x, dtype)))
    except Exception as e:                                   # noqa: BLE001
        dy = np.zeros(np.shape(x), dtype)
        return refused(source, name, kind, named, [np.asarray(x, dtype)], dy, dtype, e)
    return Result(source, name, dtype, "differ", "torch did not raise as its test expects")


# ---- common_modules ------------------------------------------------------------------------

def module_db_cases(dtype):
    import torch
    from torch.testing._internal import common_modules as cm

    tdt = torch.float64 if dtype == np.float64 else torch.float32
    out = []
    for info in cm.module_db:
        kind = info.module_cls.__name__
        if kind not in NORMS:
            continue
        torch.manual_seed(0)
        inputs = info.module_inputs_func(info, device="cpu", dtype=tdt, requires_grad=True,
                                         training=True)
        for mi in inputs:
            desc = mi.desc or "default"
            args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
            x = mi.forward_input.args[0].detach().numpy()
            out.append(pair("common_modules", f"{kind}/{desc}", kind, bind(kind, args, kwargs),
                            x, dtype))
            variant = variant_of(kind, args, kwargs)
            if variant is not None:
                vkind, vargs = variant
                out.append(pair("common_modules", f"{vkind}/{desc}", vkind,
                                bind(vkind, vargs, kwargs), x, dtype, variant=True))
        if kind.startswith("InstanceNorm"):
            n = int(kind[-2])
            lazy = partial(cm.module_inputs_torch_nn_InstanceNormNd, N=n, lazy=True)
            for mi in lazy(info, device="cpu", dtype=tdt, requires_grad=True, training=True):
                vkind = "Lazy" + kind
                out.append(pair("common_modules", f"{vkind}/{mi.desc or 'default'}", vkind,
                                bind(vkind, mi.constructor_input.args,
                                     mi.constructor_input.kwargs),
                                mi.forward_input.args[0].detach().numpy(), dtype,
                                variant=True))
        if info.module_error_inputs_func is not None:
            errors = info.module_error_inputs_func(info, device="cpu", dtype=tdt,
                                                   requires_grad=True, training=True)
            for k, ei in enumerate(errors):
                mi = ei.module_error_input
                args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
                fwd = mi.forward_input.args
                x = fwd[0].detach().numpy() if fwd else np.zeros((2, kwargs.get(
                    "num_channels", args[1] if len(args) > 1 else 1), 3))
                out.append(error_case(f"{kind}/error-{k}", kind, args, kwargs, x, dtype))
    return out


def variant_of(kind, args, kwargs):
    """The Lazy (and Sync) variant of a BatchNorm input: (class name, its args)."""
    if kind.startswith("BatchNorm"):
        return "Lazy" + kind, args[1:]
    return None


def sync_cases(dtype):
    """SyncBatchNorm (outside a process group it is batch norm) on BatchNorm2d's inputs."""
    import torch
    from torch.testing._internal import common_modules as cm

    tdt = torch.float64 if dtype == np.float64 else torch.float32
    info = next(i for i in cm.module_db if i.module_cls.__name__ == "BatchNorm2d")
    torch.manual_seed(0)
    out = []
    for mi in info.module_inputs_func(info, device="cpu", dtype=tdt, requires_grad=True,
                                      training=True):
        out.append(pair("common_modules", f"SyncBatchNorm/{mi.desc or 'default'}",
                        "SyncBatchNorm", bind("SyncBatchNorm", mi.constructor_input.args,
                                              mi.constructor_input.kwargs),
                        mi.forward_input.args[0].detach().numpy(), dtype))
    return out


def error_case(name, kind, args, kwargs, x, dtype):
    """A module error input: both refuse (at construction or forward)."""
    import torch

    try:
        named = bind(kind, args, kwargs)
        getattr(torch.nn, kind)(**named)(torch.tensor(np.asarray(x, dtype)))
    except Exception as e:                                   # noqa: BLE001
        dy = np.zeros(np.shape(x), dtype)
        return refused("common_modules", name, kind, bind(kind, args, kwargs),
                       [np.asarray(x, dtype)], dy, dtype, e)
    return Result("common_modules", name, dtype, "differ", "torch did not raise")


def common_nn_cases(dtype, quick):
    if quick:
        return []
    x = np.random.default_rng(0).standard_normal((4, 56, 56, 56))
    named = bind("LayerNorm", ([56, 56, 56], 1e-5, False))
    return [pair("common_nn", "LayerNorm/3d_no_affine_large_feature (+ _eval)", "LayerNorm",
                 named, x, dtype)]


# ---- test_nn.py ----------------------------------------------------------------------------

def instance_norm_general(n, dtype):
    """_test_InstanceNorm_general: eps=0 untracked (train = eval), tracked with
    momentum=1 (the estimates are the batch's), eval with X * std added per channel."""
    random.seed(n)
    b, c = random.randint(3, 5), random.randint(3, 5)
    spatial = {1: (random.randint(8, 10),),
               2: (random.randint(6, 8), random.randint(3, 6)),
               3: tuple(random.randint(2, 5) for _ in range(3))}[n]
    x = np.random.default_rng(n).uniform(0, 1, (b, c, *spatial))
    kind, name = f"InstanceNorm{n}d", f"test_InstanceNorm{n}d_general"
    out = [pair("test_nn", f"{name}/eps0", kind, bind(kind, (c,), {"eps": 0.0}), x, dtype),
           pair("test_nn", f"{name}/eps0-eval-grads", kind, bind(kind, (c,), {"eps": 0.0}), x,
                dtype, train=False)]
    tracked = bind(kind, (c,), {"momentum": 1, "eps": 0.0, "track_running_stats": True})
    out.append(pair("test_nn", f"{name}/tracked-momentum1", kind, tracked, x, dtype))
    theirs = run_torch(kind, tracked, [x], np.zeros(x.shape), dtype)
    delta = (np.sqrt(theirs["var"]) * np.arange(c)).reshape(-1, *[1] * len(spatial))
    out.append(pair("test_nn", f"{name}/tracked-eval-plus-delta", kind, tracked, x, dtype,
                    eval_x=x + delta))
    return out


def instance_norm_errors(dtype):
    out = [expect_error("test_nn", "test_instancenorm_raises_error_if_less_than_one_value_per_"
                        "channel", "InstanceNorm1d", bind("InstanceNorm1d", (10,)),
                        np.random.default_rng(0).uniform(size=(1, 10, 1)), dtype)]
    for n in (1, 2, 3):
        kind = f"InstanceNorm{n}d"
        x = np.random.default_rng(n).standard_normal((10, 3) + (1,) * n)
        named = bind(kind, (3,), {"track_running_stats": True})
        name = f"test_instancenorm_raises_error_for_single_spatial_element_during_training/{n}d"
        out.append(expect_error("test_nn", name, kind, named, x, dtype))
        out.append(pair("test_nn", name + "/eval-works", kind, named, x, dtype, steps=False))
    return out


def layer_norm_general(dtype):
    """_test_LayerNorm_general: ranks 2 to 5 with eps=0, then the bad shapes."""
    g = np.random.default_rng(4)
    out = []
    for i in range(2, 6):
        shape = tuple(int(v) for v in g.integers(3, 6, i))
        nd = int(g.integers(1, i))
        x = g.uniform(0, 10, shape)
        out.append(pair("test_nn", f"test_LayerNorm_general/{shape} ns {shape[-nd:]}",
                        "LayerNorm", bind("LayerNorm", (list(shape[-nd:]),), {"eps": 0.0}), x,
                        dtype))
    bad = {(): (), (2, 3): (3,), (2,): (1, 2, 3), (10,): (2, 3), 10: (2, 3)}
    for ns, shape in bad.items():
        out.append(expect_error("test_nn", f"test_LayerNorm_general/bad {ns} for {shape}",
                                "LayerNorm", bind("LayerNorm", (ns,)),
                                g.uniform(0, 10, shape), dtype))
    return out


def group_norm_general(dtype):
    """_test_GroupNorm_general: the good shapes with eps=0, the bad group counts."""
    g = np.random.default_rng(5)
    good = {(1, 2, 3, 4): 2, (2, 3, 10): 3, (3, 1, 1, 1, 2): 1, (2, 6, 4, 2, 2): 3,
            (1, 256, 1, 1): 32}
    out = [pair("test_nn", f"test_GroupNorm_general/{shape} g{gr}", "GroupNorm",
                bind("GroupNorm", (gr, shape[1]), {"eps": 0.0}), g.uniform(0, 10, shape),
                dtype) for shape, gr in good.items()]
    bad = {(1, 2, 3, 4): 3, (2, 3, 10): 2, (3, 1, 1, 1, 2): 10, (2, 6, 4, 2, 2): 4}
    for shape, gr in bad.items():
        out.append(expect_error("test_nn", f"test_GroupNorm_general/bad g{gr} for {shape}",
                                "GroupNorm", {"num_groups": gr, "num_channels": shape[1],
                                              "eps": 1e-5, "affine": True},
                                g.uniform(0, 10, shape), dtype))
    return out


def misc_norm_tests(dtype, quick):
    g = np.random.default_rng(6)
    out = [
        expect_error("test_nn", "test_GroupNorm_raises_error_if_one_value_per_group",
                     "GroupNorm", bind("GroupNorm", (10, 10)), g.uniform(size=(1, 10, 1)),
                     dtype),
        pair("test_nn", "test_GroupNorm_empty", "GroupNorm", bind("GroupNorm", (2, 4)),
             np.zeros((0, 4, 2, 2)), dtype),
        pair("test_nn", "test_BatchNorm_empty", "BatchNorm2d", bind("BatchNorm2d", (3,)),
             np.zeros((0, 3, 2, 2)), dtype),
        pair("test_nn", "test_layer_norm_grads_with_create_graph_flag", "LayerNorm",
             bind("LayerNorm", ((16,), 1e-5, True)), g.standard_normal((4, 4, 16)), dtype),
        pair("test_nn", "test_layer_norm_eps", "LayerNorm",
             bind("LayerNorm", (2,), {"eps": 1e-6, "elementwise_affine": False}),
             np.array([[[2.0, 2.0], [14.0, 14.0]], [[2.0, 2.0], [14.0, 14.0]]]), dtype),
        expect_error("test_nn", "test_batchnorm_raises_error_if_less_than_one_value_per_channel",
                     "BatchNorm1d", bind("BatchNorm1d", (10,)), g.standard_normal((1, 10)),
                     dtype),
        pair("test_nn", "test_batchnorm_buffer_update_when_stats_are_not_tracked",
             "BatchNorm1d", bind("BatchNorm1d", (3,), {"track_running_stats": False}),
             g.standard_normal((4, 3)), dtype),
        pair("test_nn", "test_batchnorm_update_stats", "BatchNorm1d", bind("BatchNorm1d", (3,)),
             g.uniform(size=(4, 3)), dtype),
        pair("test_nn", "test_batchnorm_simple_average", "BatchNorm1d",
             bind("BatchNorm1d", (3,), {"momentum": None}),
             [g.uniform(size=(4, 3)), g.uniform(size=(4, 3))], dtype),
    ]
    for ndim, shape in ((2, (4, 3)), (3, (4, 3, 5)), (4, (4, 3, 5, 5)), (5, (4, 3, 3, 3, 3))):
        kind = {2: "BatchNorm1d", 3: "BatchNorm1d", 4: "BatchNorm2d", 5: "BatchNorm3d"}[ndim]
        x = g.uniform(size=shape)
        out.append(pair("test_nn", f"test_batchnorm_eval/{ndim}d", kind, bind(kind, (3,)), x,
                        dtype, train=False))
        out.append(pair("test_nn", f"test_batchnorm_affine/{ndim}d-no-affine", kind,
                        bind(kind, (3,), {"affine": False}), x, dtype))
        out.append(pair("test_nn", f"test_batchnorm_grad/{ndim}d", kind,
                        bind(kind, (3,), {"momentum": None}), x, dtype))
    if not quick:
        out.append(pair("test_nn", "test_LayerNorm_numeric", "LayerNorm",
                        bind("LayerNorm", ([256, 256, 144],)),
                        g.uniform(size=(2, 256, 256, 144)), dtype))
        out.append(pair("test_nn", "test_GroupNorm_numeric", "GroupNorm",
                        bind("GroupNorm", (2, 8)), g.uniform(size=(1, 8, 256, 256, 72)), dtype))
    return out


def all_cases(quick):
    for dtype in DTYPES:
        yield from module_db_cases(dtype)
        yield from sync_cases(dtype)
        yield from common_nn_cases(dtype, quick)
        for n in (1, 2, 3):
            yield from instance_norm_general(n, dtype)
        yield from instance_norm_errors(dtype)
        yield from layer_norm_general(dtype)
        yield from group_norm_general(dtype)
        yield from misc_norm_tests(dtype, quick)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="leave out the two largest cases")
    p.add_argument("--verbose", action="store_true", help="print the passing cases' notes")
    args = p.parse_args(argv)
    counts = {"pass": 0, "differ": 0, "cannot express": 0}
    rows = []
    left_out = 0
    for r in all_cases(args.quick):
        if r is None:
            left_out += 1
            continue
        counts[r.status] += 1
        rows.append(r)
        if r.status != "pass" or args.verbose:
            print(f"{r.status:15s} {r.dtype:8s} {r.source:15s} {r.name}: {r.note}", flush=True)
    by_source = {}
    for r in rows:
        by_source.setdefault(r.source, {"pass": 0, "differ": 0, "cannot express": 0})
        by_source[r.source][r.status] += 1
    print("\n| source | cases | pass | differ | cannot express |\n|---|---|---|---|---|")
    for source, c in by_source.items():
        print(f"| {source} | {sum(c.values())} | {c['pass']} | {c['differ']} | "
              f"{c['cannot express']} |")
    print(f"| all | {len(rows)} | {counts['pass']} | {counts['differ']} | "
          f"{counts['cannot express']} |")
    if left_out:
        print(f"\n{left_out} Lazy variant inputs PyTorch itself cannot run on the CPU (inputs "
              "without a batch axis: the lazy module takes its channels from axis 1) were left "
              "out.")
    return 0 if counts["pass"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
