"""GradientMerge: gradient accumulation over k train steps around any optimizer.

    opt = mg.optimizer.GradientMerge(mg.optimizer.AdamW(1e-3), k_steps=4, avg=True)
    opt.minimize(net, loss)

Every train step adds each parameter's gradient into the persistable
`gradient_merge_<i>.<param>.merged_grad` (add_inplace); on every k-th step the
inner optimizer's update section runs with their mean (avg=True; the sum with
avg=False), then the sums are zeroed (fill_inplace). Both write the sums' own
arrays, so a GPU step can be replayed as a CUDA graph.
This is PyTorch's accumulation loop (loss / k, backward() on each micro-batch,
optimizer.step() and zero_grad() every k-th): k steps of batch B train like one
step of batch k·B for ops whose loss is a mean over rows. The inner optimizer's
schedule advances once per update, clipping acts on the merged gradient, and
parameter groups work as in minimize. The step count is the persistable
`gradient_merge_<i>.step`, so a checkpoint resumes mid-accumulation; the
checkpoint records k_steps, and loading it into a GradientMerge of another
k_steps is refused.
"""
from __future__ import annotations

from minigraph.initializer import Constant
from minigraph.schema import OpDesc
from minigraph.validators import is_int


class GradientMerge:
    """See the module doc."""

    def __init__(self, inner, k_steps, avg=True):
        from minigraph.optimizer import Optimizer

        if not isinstance(inner, Optimizer):
            raise TypeError(f"GradientMerge: inner must be an optimizer (SGD, Momentum, Adam, "
                            f"AdamW), got {type(inner).__name__}")
        if not is_int(k_steps) or k_steps < 1:
            raise ValueError(f"GradientMerge: k_steps must be an int >= 1, got {k_steps!r}")
        if not isinstance(avg, bool):
            raise TypeError(f"GradientMerge: avg must be True or False, got {avg!r}")
        self.inner, self.k_steps, self.avg = inner, int(k_steps), avg
        self.counter = None
        self.merged = []               # the merged-gradient sums, after minimize
        self.name = None                # its name in the net (minimize): "gradient_merge_0"
        self.state_vars = []
        self.legacy_names = {}          # state name -> its name in version 1 checkpoints

    def describe(self):
        """What a checkpoint records about this optimizer (minigraph.io)."""
        return {"type": "GradientMerge", "name": self.name, "k_steps": self.k_steps,
                "avg": self.avg, "inner": self.inner.describe()}

    @property
    def learning_rate(self):
        """The inner optimizer's current learning rate."""
        return self.inner.learning_rate

    def minimize(self, net, loss, parameters=None):
        """Append backward, the accumulation (backward section, every step) and the inner
        optimizer's update section (every k-th step). Returns [(parameter, gradient)]
        with each step's own gradients."""
        if self.counter is not None:
            raise ValueError("GradientMerge.minimize: this optimizer already minimises a net; "
                             "make one per net")
        settings, params_grads = self.inner.backward(net, loss, parameters)
        self.name = net.unique_name("gradient_merge")
        updates, sums = [], []
        for setting, (param, grad) in zip(settings, params_grads):
            if grad is None:
                continue
            total = self._state(net, f"{param.name}.merged_grad", param.shape, param.dtype,
                                0.0)
            net.append_op(OpDesc("add_inplace", dict(x=total, y=grad, x_out=total)), "backward")
            sums.append(total)
            if self.avg and self.k_steps > 1:
                mean = net.scopes["train"].new_var(f"{total.name}_mean")
                net.append_op(OpDesc("scale", dict(x=total, out=mean, scale=1.0 / self.k_steps)),
                              "update")
                updates.append((setting, mean))
            else:
                updates.append((setting, total))
        self.inner.append_updates(net, updates)
        for total in sums:
            net.append_op(OpDesc("fill_inplace", dict(x=total, x_out=total, value=0.0)),
                          "update")
        self.merged = sums
        self.counter = self._state(net, "step", (), "int64", 0)
        net.update_every(self.k_steps, self.counter)
        net.optimizer = self
        net.scope.reserve(self.name, f"the GradientMerge optimizer {self.name!r}")
        return params_grads

    def _state(self, net, name, shape, dtype, value):
        """A persistable of this optimizer, `<self.name>.<name>` (version 1 checkpoints
        named a merged gradient `<param>.merged_grad`, the counter the same)."""
        var = net.create_parameter(f"{self.name}.{name}", shape, dtype, Constant(value),
                                   trainable=False, part="optimizer")
        self.state_vars.append(var)
        self.legacy_names[var.name] = var.name if name == "step" else name
        return var
