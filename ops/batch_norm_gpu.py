"""The GPU kernel bindings of batch norm: `batch_norm_gpu`, `batch_norm_grad_gpu`.

The launchers of minigraph.kernels.batch_norm on device arrays; nothing is
copied to the host. The estimates and the counter are updated in place on
the device. A batch with non-finite statistics cannot raise inside the step:
the kernels flag it and leave the estimates and the counter unchanged, and
the error (an OpError, as on the CPU) is raised at the next fetch.

Not an op module: it registers nothing. ops/batch_norm.py registers these
bindings (with the float dtypes they take, checked by the executor), and
ops/sync_batch_norm.py calls them with an allreduce.
"""
from __future__ import annotations

from minigraph.kernels import batch_norm as gpu
from minigraph.kernels import batch_norm_sync as gpu_sync
from minigraph.kernels import elementwise as gpu_elementwise
from minigraph.kernels import launch as gpu_launch
from minigraph.kernels import loader
from minigraph.ops.device import present
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


def _too_few_values(op, n, x, layout):
    # the n <= 1 error is batch_norm's own; imported here, since ops/batch_norm.py
    # imports this module to register these bindings
    from minigraph.ops.batch_norm import too_few_values

    return too_few_values(op, n, x, layout)


def forward_gpu(op, ins, allreduce=None):
    """The GPU forward of batch_norm: the CPU kernel's outputs and in-place
    updates, on the device. With is_infer or use_global_est, y is normalised
    with the estimates and batch_mean/batch_var are copies of them.

    `allreduce(v) -> v` combines a float64 device vector over ranks (sync_batch_norm):
    training then takes the statistics of every rank's batch - one call on the
    2C+1 numbers (n, mean, M2) of kernels.batch_norm_sync.local_stats, merged (Chan)."""
    a = op.attrs
    x, scale, bias = ins["x"], ins["scale"], ins["bias"]
    est_mean, est_var, counter = ins["estimated_mean"], ins["estimated_var"], \
        ins.get("num_batches")
    layout, eps = a["data_layout"], a["epsilon"]
    if a["is_infer"] or a["use_global_est"]:
        y = gpu.forward_infer(x, scale, bias, est_mean, est_var, eps, layout)
        mean, var = gpu_elementwise.copy(est_mean), gpu_elementwise.copy(est_var)
    else:
        common = (scale, bias, est_mean, est_var, counter, a["momentum"], eps, layout)
        if allreduce is None:
            try:
                y, mean, var = gpu.forward_train(x, *common, guard=gpu_guard(op.type))
            except ValueError:      # raised before anything is written: n <= 1 is ours
                n = _values(x, layout)
                if n is not None and n <= 1:
                    raise _too_few_values(op, n, x, layout) from None
                raise
        else:
            n = _values(x, layout)
            sums = allreduce(gpu_sync.local_stats(x, layout))
            if n <= 1:          # only then can the global count be <= 1: read it back
                n = int(round(float(loader.to_host(sums)[0])))
                if n <= 1:
                    raise _too_few_values(op, n, x, layout)
            y, mean, var = gpu_sync.forward_train_from_sums(x, sums, *common,
                                                       guard=gpu_guard(op.type))
    return {"y": y, "batch_mean": mean, "batch_var": var, "saved_mean": est_mean,
            "saved_var": est_var, "saved_num_batches": counter}


def backward_gpu(op, ins, allreduce=None):
    """The GPU grad kernel; unbound outputs are not computed. `allreduce` (see
    forward_gpu) sums (n, Σdy, Σdy·(x−μ)) over ranks when the statistics came
    from the batch: dscale and dbias are then the whole batch's, dx uses the
    global n."""
    a = op.attrs
    x, dy, scale, mean, var = ins["x"], ins["dy"], ins["scale"], ins["mean"], ins["var"]
    layout, eps = a["data_layout"], a["epsilon"]
    need = dict(need_dx=op.wants("dx"), need_dscale=op.wants("dscale"),
                need_dbias=op.wants("dbias"))
    if allreduce is None or a["use_global_est"]:
        dx, dscale, dbias = gpu.backward(x, dy, scale, mean, var, eps, layout,
                                         a["use_global_est"], **need)
    else:
        sums = allreduce(gpu_sync.backward_sums(x, dy, mean, layout))
        dx, dscale, dbias = gpu_sync.backward_from_sums(x, dy, scale, mean, var, sums, eps, layout,
                                                   **need)
    return present(dx=dx, dscale=dscale, dbias=dbias)
