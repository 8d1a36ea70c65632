"""Launchers for kernels/cuda/mean.cu: the mean of all elements and its gradient."""
from __future__ import annotations

from minigraph.kernels.cuda import fill, launch, loader

MODULE = "mean"
SIGNATURES = {"mean_f32": "PqPPP", "mean_f64": "PqPPP",
              **{f"mean_grad_{s}_w{w}": "PPq" for s, ws in (("f32", (1, 4)), ("f64", (1, 2)))
                 for w in ws}}


def mean(x, out=None):
    """out (shape ()) = the mean of every element of x, summed in double on the
    device; x must not be empty. Returns out."""
    if x.size == 0:
        raise ValueError(f"mean: input is empty (shape {tuple(x.shape)}); its mean is undefined")
    xp = loader.ptr(x, "mean: x")
    if out is None:
        out = loader.empty((), x.dtype)
    plans = loader.cached("mean.plans", dict)
    key = (x.size, x.dtype)
    found = plans.get(key)
    if found is None:
        name = f"mean_{loader.suffix(x.dtype)}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        dev = loader.device()
        threads = launch.block_threads(dev)
        blocks = launch.flat_grid(x.size, dev, threads, k.resources)
        found = loader.cache_put(plans, key, (blocks, k.prepared((blocks, 1, 1),
                                                                 (threads, 1, 1))))
    blocks, go = found
    # the blocks' partial sums live in the scratch (loader.scratch), not an array
    go(xp, x.size, loader.scratch(blocks, "float64"), loader.address(loader.tickets(1)),
       loader.ptr(out, "mean: out"))
    return out


def mean_grad(shape, dout, dx=None):
    """dx of `shape` = dout / size everywhere; dout is a one-element device
    array read on the device. Returns dx."""
    if dout.size != 1:
        raise ValueError(f"mean_grad: dout must hold one value, got shape {tuple(dout.shape)}")
    if dx is None:
        dx = loader.empty(shape, dout.dtype)
    else:
        launch.check_array("mean_grad: dx", dx, tuple(shape), dout.dtype)
    if dx.size:
        loader.launch_flat(MODULE, SIGNATURES, "mean_grad_{t}_w{w}", dx.dtype, dx.size,
                           (dout, dx), dx.size)
    return dx


# ---- op kernels -------------------------------------------------------------------

def mean_gpu(op, ins, ctx):
    """out = mean(x), summed in double on the device, in x's dtype; 0 when x is empty."""
    x = ins["x"]
    if x.size == 0:
        return {"out": fill.full((), 0.0, x.dtype)}
    return {"out": mean(x)}


def mean_grad_gpu(op, ins, ctx):
    """dx = dout / x.size everywhere, dout read on the device; nothing when dx is unbound."""
    x, d = ins["x"], ins["dout"]
    if not op.wants("dx"):
        return {}
    return {"dx": mean_grad(tuple(x.shape), d)}
