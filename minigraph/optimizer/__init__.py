"""Optimisers: `minimize(net, loss)` appends backward and update ops to the train branch.

    SGD(learning_rate, weight_decay=0.0, grad_clip=None)
    Momentum(learning_rate, momentum=0.9, nesterov=False, weight_decay=0.0, grad_clip=None)
    Adam(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0,
         grad_clip=None)
    AdamW(learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.01,
          grad_clip=None)
    ClipGradByGlobalNorm(max_norm)
    lr.StepDecay(learning_rate, step_size, gamma=0.1)
    lr.CosineDecay(learning_rate, total_steps, end_lr=0.0, warmup_steps=0)

Each equals its PyTorch namesake step for step: `weight_decay` is L2 added
to the gradient in SGD, Momentum and Adam, decoupled in AdamW; clipping
scales the raw gradients before weight decay is added. `learning_rate` is a
number >= 0 (0 allowed) or a schedule; a schedule advances once per
`net.train` step and keeps its step counter in a persistable, so a
checkpoint resumes it. The update section of the net is, in order: the
schedule's op, the clipping op, one update op per parameter.

An optimizer's state is named under its own name, `<kind>_<k>` (`adam_0`,
`momentum_0`; GradientMerge's `gradient_merge_0`): its learning rate
`adam_0.learning_rate` (`.step`, `.plateau` for schedules) and each
parameter's state `adam_0.<param>.moment1`, so it never shares a name with
another optimizer's or a layer's, and checkpoints can tell it apart (the
"optimizer" part, see minigraph.io). The names under that prefix are
reserved once minimize() returns. Version 1 checkpoints named the state
without the prefix (`learning_rate_0`, `<param>.moment1`): `legacy_names`
maps each state name to that one.
"""
from __future__ import annotations

import numpy as np

from minigraph.backward import append_backward
from minigraph.initializer import Constant
from minigraph.io import checkpoint_values
from minigraph.optimizer import groups, lr
from minigraph.optimizer.gradient_merge import GradientMerge
from minigraph.schema import OpDesc
from minigraph.validators import check_number

__all__ = ["SGD", "Adam", "AdamW", "ClipGradByGlobalNorm", "GradientMerge", "Momentum",
           "Optimizer", "lr"]


def check_learning_rate(value, what="learning_rate"):
    """A learning rate: a finite number >= 0 (0 is allowed, as in torch)."""
    return check_number(value, what)


def check_minimize_args(net, loss, who):
    """A TypeError or ValueError naming `who` unless `net` is a Net that can train and
    `loss` is one of its Variables."""
    from minigraph.net import Net
    from minigraph.scope import Variable

    if not isinstance(net, Net):
        raise TypeError(f"{who}: net must be a minigraph Net, got {type(net).__name__} "
                        f"{net!r:.60}")
    if getattr(net, "infer_only", False):
        raise ValueError(f"{who}: this net is infer-only (made by an inference pass or "
                         "load_inference); minimise the net the layers built")
    if not isinstance(loss, Variable):
        raise TypeError(f"{who}: loss must be a Variable of the net (the scalar a layer such "
                        f"as layers.mean returns), got {type(loss).__name__} {loss!r:.60}")
    if not net.owns(loss):
        raise ValueError(f"{who}: the loss {loss.name!r} belongs to another net")


class ClipGradByGlobalNorm:
    """Scale every gradient by min(max_norm / (total_norm + 1e-6), 1), total_norm the L2
    norm of all the gradients together (torch.nn.utils.clip_grad_norm_), before
    the optimiser adds weight decay."""

    def __init__(self, max_norm):
        self.max_norm = check_number(max_norm, "ClipGradByGlobalNorm: max_norm", low_open=True)

    def op(self, grads):
        """The OpDesc that clips `grads` (Variables) in place."""
        return OpDesc("clip_by_global_norm", dict(x=list(grads), out=list(grads),
                                                  max_norm=self.max_norm))


class Optimizer:
    """Base: subclasses say which update op each (parameter, gradient) gets.
    `takes_momentum`: whether OneCycleLR(cycle_momentum=True) may drive its momentum
    (Momentum's momentum, Adam's beta1)."""

    takes_momentum = False

    def __init__(self, learning_rate, weight_decay=0.0, grad_clip=None):
        name = type(self).__name__
        if isinstance(learning_rate, lr.Schedule):
            self.schedule, self._initial = learning_rate, learning_rate.value(0)
        elif isinstance(learning_rate, lr.ReduceOnPlateau):
            self.schedule, self._initial = learning_rate, learning_rate.learning_rate
        else:
            self.schedule = None
            self._initial = check_learning_rate(learning_rate, f"{name}: learning_rate")
        self.weight_decay = check_number(weight_decay, f"{name}: weight_decay")
        if grad_clip is not None and not isinstance(grad_clip, ClipGradByGlobalNorm):
            raise TypeError(f"{name}: grad_clip must be a ClipGradByGlobalNorm or None, got "
                            f"{type(grad_clip).__name__}")
        self.grad_clip = grad_clip
        if getattr(self.schedule, "cycle_momentum", False) and not self.takes_momentum:
            raise ValueError(f"{name}: OneCycleLR(cycle_momentum=True) needs an optimizer with "
                             "a momentum to cycle: Momentum, or Adam/AdamW (beta1)")
        self.lr_var = None
        self.step_var = None
        self.momentum_var = None
        self._place = None
        self.name = None                # its name in the net (minimize): "adam_0"
        self.state_vars = []            # its persistables, in creation order
        self.legacy_names = {}          # state name -> its name in version 1 checkpoints

    kind = "optimizer"                  # the stem of its name in a net (a subclass's)

    def describe(self):
        """What a checkpoint records about this optimizer: {"type", "name"}."""
        return {"type": type(self).__name__, "name": self.name}

    @property
    def learning_rate(self):
        """The current learning rate: the value of the learning-rate variable after
        minimize() (with a schedule: the rate of the last update, the initial rate
        before the first), else the initial value."""
        if self.lr_var is None or self.lr_var.value is None:
            return self._initial
        return float(self.lr_var.get())

    @property
    def cycled_momentum(self):
        """The momentum (or Adam's beta1) OneCycleLR(cycle_momentum=True) set for the
        last update (its value for the first before any); None without cycling."""
        if not getattr(self.schedule, "cycle_momentum", False):
            return None
        if self.momentum_var is None or self.momentum_var.value is None:
            return self.schedule.momentum(0)
        return float(self.momentum_var.get())

    def minimize(self, net, loss, parameters=None):
        """Append backward and the update section (schedule, learning-rate multipliers,
        clipping, one update op per parameter; train branch only). parameters: None
        (every trainable one), or a list of parameters and groups (see
        minigraph.optimizer.groups). Returns [(parameter, gradient)]."""
        settings, params_grads = self.backward(net, loss, parameters)
        self.append_updates(net, [(s, g) for s, (_, g) in zip(settings, params_grads)
                                  if g is not None])
        return params_grads

    def backward(self, net, loss, parameters=None):
        """The first half of minimize: checks, then append_backward for the parameters'
        settings. Returns ([ParamSetting], [(parameter, gradient)]) in one order."""
        name = type(self).__name__
        check_minimize_args(net, loss, f"{name}.minimize")
        if self.lr_var is not None:
            raise ValueError(f"{name}.minimize: this optimizer already minimises a net; make "
                             "one optimizer per net")
        if getattr(net, "optimizer", None) is not None:
            raise ValueError(f"{name}.minimize: this net is already minimised (by "
                             f"{type(net.optimizer).__name__}); a net has one optimizer: give it "
                             "parameter groups instead (parameters=[{'params': [...], "
                             "'learning_rate': multiplier, 'weight_decay': wd}, ...])")
        settings = groups.resolve(net, parameters, f"{name}.minimize", self.weight_decay)
        return settings, append_backward(net, loss, [s.param for s in settings])

    def append_updates(self, net, updates):
        """The second half of minimize: the learning-rate variable, the schedule op, one
        `scale` op per learning-rate multiplier other than 1, the clipping op and one
        update op per (ParamSetting, gradient) of `updates`, in the update section."""
        self._place = net.place
        self.name = net.unique_name(self.kind)
        legacy = net.unique_name("learning_rate", take=False)
        self.lr_var = self.new_state(net, "learning_rate", (), "float64", self._initial, legacy)
        self.lr_var.value_rule = checkpoint_values.learning_rate
        if isinstance(self.schedule, lr.ReduceOnPlateau):
            self.schedule.bind(net, self.lr_var, lambda: self.new_state(
                net, "learning_rate.plateau", (5,), "float64", 0.0, f"{legacy}.plateau"))
        elif self.schedule is not None:
            self.step_var = self.new_state(net, "learning_rate.step", (), "int64", 0,
                                           f"{legacy}.step")
            cycled = {}
            if getattr(self.schedule, "cycle_momentum", False):
                self.momentum_var = self.new_state(
                    net, "learning_rate.momentum", (), "float64", self.schedule.momentum(0),
                    f"{legacy}.momentum")
                cycled["momentum"] = self.momentum_var
            net.append_op(OpDesc("lr_schedule", dict(step=self.step_var, step_out=self.step_var,
                                                      learning_rate=self.lr_var, **cycled,
                                                      **self.schedule.attrs())), "update")
        rates = {1.0: self.lr_var}
        for setting, _ in updates:
            if setting.lr_scale not in rates:
                out = net.scopes["train"].new_var(f"{self.lr_var.name}.x{len(rates)}")
                net.append_op(OpDesc("scale", dict(x=self.lr_var, out=out,
                                                   scale=setting.lr_scale)), "update")
                rates[setting.lr_scale] = out
        if self.grad_clip is not None and updates:
            net.append_op(self.grad_clip.op([g for _, g in updates]), "update")
        for setting, grad in updates:
            net.append_op(self.update(net, setting.param, grad, rates[setting.lr_scale],
                                      setting.weight_decay), "update")
        net.optimizer = self
        net.trained = tuple(setting.param for setting, _ in updates)
        net.frozen_at_minimize = tuple(
            v for v in net.persistables()
            if checkpoint_values.part_of(v) == "parameters" and not v.trainable)
        net.scope.reserve(self.name, f"the {type(self).__name__} optimizer {self.name!r}")

    def set_learning_rate(self, value):
        """Change the learning rate for the next steps (after minimize; not with a
        schedule). Validated like the constructor: a finite number >= 0."""
        name = type(self).__name__
        if self.lr_var is None:
            raise ValueError(f"{name}.set_learning_rate: call minimize() first")
        if self.schedule is not None:
            raise ValueError(f"{name}.set_learning_rate: the learning rate follows a schedule "
                             f"({type(self.schedule).__name__}); build the optimizer with a "
                             "number instead to set it by hand (lr.ReduceOnPlateau lowers it "
                             "from a metric)")
        value = check_learning_rate(value, f"{name}.set_learning_rate: learning_rate")
        self.lr_var.set(self._place.to_device(np.array(value, dtype=np.float64)))

    def new_state(self, net, name, shape, dtype, value, legacy):
        """A persistable of this optimizer, `<self.name>.<name>`, filled with `value`;
        `legacy` is its name in version 1 checkpoints."""
        var = net.create_parameter(f"{self.name}.{name}", shape, dtype, Constant(value),
                                   trainable=False, part="optimizer")
        self.state_vars.append(var)
        self.legacy_names[var.name] = legacy
        return var

    def state(self, net, param, suffix, value=0.0, shape=None, dtype=None):
        """A persistable optimizer state for `param` (`<self.name>.<param>.<suffix>`),
        filled with value."""
        name = f"{param.name}.{suffix}"
        return self.new_state(net, name, param.shape if shape is None else shape,
                              param.dtype if dtype is None else dtype, value, name)

    def update(self, net, param, grad, learning_rate, weight_decay):
        """The OpDesc updating `param` from `grad` at the rate held by the Variable
        `learning_rate`, with this parameter's `weight_decay`."""
        raise NotImplementedError


class SGD(Optimizer):
    """param -= learning_rate * (grad + weight_decay * param)."""

    kind = "sgd"

    def update(self, net, param, grad, learning_rate, weight_decay):
        return OpDesc("sgd", dict(param=param, grad=grad, learning_rate=learning_rate,
                                  param_out=param, weight_decay=weight_decay))


class Momentum(Optimizer):
    """d = grad + weight_decay * param; velocity = momentum * velocity + d;
    param -= learning_rate * velocity (PyTorch's convention; nesterov=True
    steps along d + momentum * velocity). OneCycleLR(cycle_momentum=True) replaces
    `momentum` by its cycled value, step by step."""

    takes_momentum = True

    kind = "momentum"

    def __init__(self, learning_rate, momentum=0.9, nesterov=False, weight_decay=0.0,
                 grad_clip=None):
        super().__init__(learning_rate, weight_decay, grad_clip)
        self.momentum = check_number(momentum, "Momentum: momentum", high=1.0)
        if not isinstance(nesterov, bool):
            raise TypeError(f"Momentum: nesterov must be True or False, got {nesterov!r}")
        self.nesterov = nesterov

    def update(self, net, param, grad, learning_rate, weight_decay):
        velocity = self.state(net, param, "velocity")
        cycled = {} if self.momentum_var is None else {"mu_value": self.momentum_var}
        return OpDesc("momentum", dict(param=param, grad=grad, velocity=velocity,
                                       learning_rate=learning_rate, param_out=param,
                                       velocity_out=velocity, mu=self.momentum,
                                       use_nesterov=self.nesterov, weight_decay=weight_decay,
                                       **cycled))


class Adam(Optimizer):
    """torch.optim.Adam: bias-corrected moments; weight_decay is L2 added to the grad.
    A float16 parameter keeps its moments in float32 and its update is computed in
    float32 (epsilon = 1e-8 and the second moment underflow in float16).
    OneCycleLR(cycle_momentum=True) replaces beta1 by its cycled value, step by step,
    with torch's bias correction 1 - beta1 ** step."""

    decoupled = False
    takes_momentum = True
    kind = "adam"

    def __init__(self, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 weight_decay=0.0, grad_clip=None):
        super().__init__(learning_rate, weight_decay, grad_clip)
        name = type(self).__name__
        self.beta1 = check_number(beta1, f"{name}: beta1", high=1.0, high_open=True)
        self.beta2 = check_number(beta2, f"{name}: beta2", high=1.0, high_open=True)
        self.epsilon = check_number(epsilon, f"{name}: epsilon", low_open=True)

    def update(self, net, param, grad, learning_rate, weight_decay):
        work = np.float32 if np.dtype(param.dtype) == np.float16 else None
        m1, m2 = (self.state(net, param, s, dtype=work) for s in ("moment1", "moment2"))
        p1, p2 = (self.state(net, param, s, 1.0, (), "float64")
                  for s in ("beta1_pow", "beta2_pow"))
        cycled = {} if self.momentum_var is None else {"beta1_value": self.momentum_var,
                                                       "step": self.step_var}
        return OpDesc("adam", dict(**cycled,
            param=param, grad=grad, moment1=m1, moment2=m2, beta1_pow=p1, beta2_pow=p2,
            learning_rate=learning_rate, param_out=param, moment1_out=m1, moment2_out=m2,
            beta1_pow_out=p1, beta2_pow_out=p2, beta1=self.beta1, beta2=self.beta2,
            epsilon=self.epsilon, weight_decay=weight_decay, decoupled=self.decoupled))


class AdamW(Adam):
    """torch.optim.AdamW: Adam with decoupled weight decay (param *= 1 - lr * wd)."""

    decoupled = True
    kind = "adamw"

    def __init__(self, learning_rate=1e-3, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 weight_decay=0.01, grad_clip=None):
        super().__init__(learning_rate, beta1, beta2, epsilon, weight_decay, grad_clip)
