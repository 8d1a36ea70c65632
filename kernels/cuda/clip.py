"""Launchers for kernels/cuda/clip.cu: clip_by_global_norm in place on device arrays,
with no host round trip (the coefficient stays on the device)."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader, shape_ops

MODULE = "clip"
CLIP_ARITY = 8          # tensors per launch (clip.cu's CLIP_ARITY)
SIGNATURES = {**{f"sumsq_{t}": "P" * CLIP_ARITY + "q" * CLIP_ARITY + "iP" for t in ("f32", "f64")},
              **{f"scale_{t}": "P" * CLIP_ARITY + "q" * CLIP_ARITY + "P" for t in ("f32", "f64")},
              "clip_coef": "PqdP"}


def _groups(xs):
    """[(suffix, [tensors])]: xs by dtype, at most CLIP_ARITY per group, in order."""
    by_dtype = {}
    for a in xs:
        by_dtype.setdefault(loader.suffix(a.dtype), []).append(a)
    return [(sfx, group[i:i + CLIP_ARITY]) for sfx, group in by_dtype.items()
            for i in range(0, len(group), CLIP_ARITY)]


def _arrays(what, group):
    pointers = [loader.ptr(a, f"{what}: x") for a in group] + [0] * (CLIP_ARITY - len(group))
    sizes = [int(a.size) for a in group] + [0] * (CLIP_ARITY - len(group))
    return pointers + sizes


def clip_by_global_norm(xs, max_norm):
    """Scale every array of `xs` (float32/64, any mix) in place by
    min(max_norm / (total + 1e-6), 1), total = the L2 norm of all of them
    together (sums of squares in double). Returns xs."""
    if not float(max_norm) > 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be > 0, got {max_norm}")
    if not xs:
        return xs
    dev = loader.device()
    threads = launch.block_threads(dev)
    blocks = launch.flat_grid(max(int(a.size) for a in xs), dev, threads)
    partial = loader.empty((len(xs) * blocks,), np.float64)
    groups = _groups(xs)
    first = 0
    for sfx, group in groups:
        name = f"sumsq_{sfx}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        k.launch((blocks, len(group), 1), (threads, 1, 1),
                 *_arrays("clip_by_global_norm", group), first, loader.ptr(partial))
        first += len(group)
    coef = loader.empty((1,), np.float64)
    k = loader.kernel(MODULE, "clip_coef", SIGNATURES["clip_coef"])
    k.launch((1, 1, 1), (threads, 1, 1), loader.ptr(partial), partial.size, float(max_norm),
             loader.ptr(coef))
    for sfx, group in groups:
        name = f"scale_{sfx}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        k.launch((blocks, len(group), 1), (threads, 1, 1),
                 *_arrays("clip_by_global_norm", group), loader.ptr(coef))
    return xs


# ---- op kernels -------------------------------------------------------------------

def clip_by_global_norm_gpu(op, ins, ctx):
    """out_i = x_i * coef on the device, no host sync: in place where out_i is x_i's
    own Variable (as the optimizers bind it), else into a copy."""
    xs = [x if o is v else shape_ops.copy(x)
          for x, v, o in zip(ins["x"], op.inputs["x"], op.outputs["out"], strict=True)]
    return {"out": clip_by_global_norm(xs, op.attrs["max_norm"])}
