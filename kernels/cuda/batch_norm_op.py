"""GPU kernels of batch_norm, sync_batch_norm and their ReLU-fused forms
(ops/batch_norm.py, ops/sync_batch_norm.py, ops/batch_norm_relu.py): the launchers of
batch_norm.py and batch_norm_sync.py on device arrays (a module of their own: the
launcher modules are full).

Nothing is copied to the host. The estimates and the counter are updated in
place on the device. A batch with non-finite statistics cannot raise inside
the step: the kernels flag it and leave the estimates and the counter
unchanged, and the error (an OpError, as on the CPU) is raised at the next
fetch. `forward_gpu` and `backward_gpu` are the drivers; sync_batch_norm passes
them `allreduce`, one collective of the communicator of the kernel's context.
"""
from __future__ import annotations

from minigraph import device
from minigraph.kernels import present
from minigraph.kernels.cpu.batch_norm import (
    backward_label,
    batch_statistics,
    forward_label,
    presummed_scale,
    too_few_values,
)
from minigraph.kernels.cuda import batch_norm as gpu
from minigraph.kernels.cuda import batch_norm_grad as gpu_grad
from minigraph.kernels.cuda import batch_norm_sync as gpu_sync
from minigraph.kernels.cuda import elementwise as gpu_elementwise
from minigraph.kernels.cuda import fill, loader
from minigraph.kernels.cuda import launch as gpu_launch
from minigraph.schema import OpError


class NonFiniteGuard(gpu.Guard):
    """The device record of rejected training batches (kernels.batch_norm.Guard)
    that reports them as the CPU kernel does: an OpError naming the op."""

    def check(self, what):
        n = self.rejected()
        if n:
            raise OpError(f"{what}: the batch statistics of {n} training batch(es) were not "
                          "finite (input 'x' held NaN or Inf, or its variance overflowed); the "
                          "running estimates and the counter were left unchanged for them "
                          "(found on the GPU, reported at the first fetch after the step)")


def gpu_guard(op_type):
    """The NonFiniteGuard of `op_type`, checked by GPUPlace.check_errors at fetch."""
    return loader.error_flag(op_type, NonFiniteGuard)


def _values(x, layout):
    """Values per channel of x (None for a layout that has no channel axis)."""
    try:
        pre, _, post = gpu_launch.channel_view(x.shape, layout)
    except ValueError:
        return None
    return pre * post


def affine(ins, x, layout):
    """(scale, bias) of a batch norm on the device: ones and zeros without them."""
    scale, bias = ins.get("scale"), ins.get("bias")
    if scale is not None and bias is not None:
        return scale, bias
    channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
    return (fill.full((channels,), 1.0, x.dtype) if scale is None else scale,
            fill.full((channels,), 0.0, x.dtype) if bias is None else bias)


def empty_batch(x, est_mean, est_var, tracked):
    """(y, batch_mean, batch_var) of a training batch with no values: y empty, the
    statistics copies of the estimates (zeros without them); nothing is written."""
    if tracked:
        mean, var = gpu_elementwise.copy(est_mean), gpu_elementwise.copy(est_var)
    else:
        mean, var = (fill.full(est_mean.shape, 0.0, x.dtype) for _ in range(2))
    return loader.empty(x.shape, x.dtype), mean, var


def forward_gpu(op, ins, allreduce=None, relu=False):
    """The GPU forward of batch_norm: the CPU kernel's outputs and in-place
    updates, on the device. With is_infer or use_global_est, y is normalised
    with the estimates and batch_mean/batch_var are copies of them.

    `allreduce(v) -> v` combines a float64 device vector over ranks (sync_batch_norm):
    training then takes the statistics of every rank's batch - one call on the
    2C+1 numbers (n, mean, M2) of kernels.batch_norm_sync.local_stats, merged (Chan).
    relu: y = max(y, 0) in the same kernels (batch_norm_relu)."""
    a = op.attrs
    x = ins["x"]
    est_mean, est_var, counter = ins.get("estimated_mean"), ins.get("estimated_var"), \
        ins.get("num_batches")
    layout, eps = a["data_layout"], a["epsilon"]
    scale, bias = affine(ins, x, layout)
    if not batch_statistics(op, ins):
        y = gpu.forward_infer(x, scale, bias, est_mean, est_var, eps, layout, relu=relu)
        mean, var = gpu_elementwise.copy(est_mean), gpu_elementwise.copy(est_var)
    else:
        momentum, first = a["momentum"], a["first_batch_sets_estimates"]
        tracked = est_mean is not None
        if not tracked:             # no running estimates: the kernels update scratch ones
            channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
            est_mean, est_var = (fill.full((channels,), v, x.dtype) for v in (0.0, 1.0))
            momentum = 0.0 if momentum is None else momentum
        common = (scale, bias, est_mean, est_var, counter, momentum, eps, layout)
        if allreduce is None:
            n = _values(x, layout)
            if n == 0:              # an empty batch: an empty y, nothing written
                y, mean, var = empty_batch(x, est_mean, est_var, tracked)
            else:
                try:
                    y, mean, var = gpu.forward_train(x, *common, guard=gpu_guard(op.type),
                                                     first_batch=first, relu=relu)
                except ValueError:  # raised before anything is written: n == 1 is ours
                    if n is not None and n <= 1:
                        raise too_few_values(op, n, x, layout) from None
                    raise
        else:
            n = _values(x, layout)
            sums = allreduce(gpu_sync.local_stats(x, layout))
            if n <= 1:          # only then can the global count be <= 1: read it back
                n = int(round(float(device.to_host(sums)[0])))
                if n == 1:
                    raise too_few_values(op, n, x, layout)
            if n == 0:
                y, mean, var = empty_batch(x, est_mean, est_var, tracked)
            else:
                y, mean, var = gpu_sync.forward_train_from_sums(
                    x, sums, *common, guard=gpu_guard(op.type), first_batch=first, relu=relu)
    return present(y=y, batch_mean=mean, batch_var=var, saved_mean=ins.get("estimated_mean"),
                   saved_var=ins.get("estimated_var"), saved_num_batches=counter)


def backward_gpu(op, ins, allreduce=None, relu_out=None, out_scale=1.0):
    """The GPU grad kernel; unbound outputs are not computed. `allreduce` (see
    forward_gpu) sums (n, Σdy, Σdy·(x−μ)) over ranks when the statistics came
    from the batch: dscale and dbias are then the whole batch's (times out_scale:
    1 / ranks folds data parallelism's average in), dx uses the global n.
    relu_out: batch_norm_relu's forward output; dy counts where it is > 0."""
    a = op.attrs
    x, dy, mean, var = ins["x"], ins["dy"], ins["mean"], ins["var"]
    layout, eps = a["data_layout"], a["epsilon"]
    scale, _ = affine(ins, x, layout)
    need = dict(need_dx=op.wants("dx"), need_dscale=op.wants("dscale"),
                need_dbias=op.wants("dbias"))
    if allreduce is None or a["use_global_est"]:
        dx, dscale, dbias = gpu_grad.backward(x, dy, scale, mean, var, eps, layout,
                                              a["use_global_est"], **need, relu_out=relu_out)
    else:
        sums = allreduce(gpu_sync.backward_sums(x, dy, mean, layout, relu_out))
        dx, dscale, dbias = gpu_sync.backward_from_sums(x, dy, scale, mean, var, sums, eps,
                                                        layout, **need, y=relu_out,
                                                        out_scale=out_scale)
    return present(dx=dx, dscale=dscale, dbias=dbias)


# ---- op kernels -------------------------------------------------------------------

def batch_norm_gpu(op, ins, ctx):
    """The GPU kernel of batch_norm (forward_gpu on this process's batch)."""
    return forward_gpu(op, ins)


def batch_norm_grad_gpu(op, ins, ctx):
    """The GPU kernel of batch_norm_grad (backward_gpu)."""
    return backward_gpu(op, ins)


def device_allreduce(comm, what):
    """allreduce(v) -> v: the sum over ranks of a float64 device vector."""
    return lambda v: comm.allreduce(v, what=what)


def device_stats_merge(comm, what):
    """merge(v) -> v: the whole batch's (n, mean, M2) from every rank's float64
    device vector of kernels.batch_norm_sync.local_stats (comm.allreduce_stats)."""
    return lambda v: comm.allreduce_stats(v, what=what)


def sync_batch_norm_gpu(op, ins, ctx, relu=False):
    """GPU forward: batch_norm's binding with ONE allreduce_stats of the 2C+1 local
    (n, mean, M2) (batch statistics with more than one rank); otherwise exactly
    batch_norm."""
    if not batch_statistics(op, ins):
        return forward_gpu(op, ins, relu=relu)
    comm = ctx.comm
    return forward_gpu(op, ins, allreduce=device_stats_merge(comm, forward_label(op))
                       if comm.size > 1 else None, relu=relu)


def sync_batch_norm_grad_gpu(op, ins, ctx, relu_out=None):
    """GPU grad: ONE allreduce of (n, Σdy, Σdy·(x−μ)) when the statistics came from
    the batch and there is more than one rank; then dx with the global n (dscale and
    dbias divided by the world size in the same kernel with `average_ranks`)."""
    comm = ctx.comm
    return backward_gpu(op, ins, allreduce=device_allreduce(comm, backward_label(op))
                        if comm.size > 1 else None, relu_out=relu_out,
                        out_scale=presummed_scale(op, comm))


def batch_norm_relu_gpu(op, ins, ctx):
    """The GPU kernel of batch_norm_relu: batch_norm's with y = max(y, 0)."""
    return forward_gpu(op, ins, relu=True)


def batch_norm_relu_grad_gpu(op, ins, ctx):
    """The GPU kernel of batch_norm_relu_grad: dy counts where the forward's y > 0."""
    return backward_gpu(op, ins, relu_out=ins["y"])


def sync_batch_norm_relu_gpu(op, ins, ctx):
    """sync_batch_norm's GPU forward with y = max(y, 0)."""
    return sync_batch_norm_gpu(op, ins, ctx, relu=True)


def sync_batch_norm_relu_grad_gpu(op, ins, ctx):
    """sync_batch_norm's GPU grad with dy counting where the forward's y > 0."""
    return sync_batch_norm_grad_gpu(op, ins, ctx, relu_out=ins["y"])
