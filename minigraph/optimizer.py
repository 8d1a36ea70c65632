"""Optimisers: `minimize(net, loss)` appends backward and update ops to the train branch."""
from __future__ import annotations

import numpy as np

from minigraph.backward import append_backward
from minigraph.initializer import Constant
from minigraph.schema import OpDesc


class Optimizer:
    """Base: subclasses say which update op each (parameter, gradient) gets."""

    def __init__(self, learning_rate):
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
        self.learning_rate = float(learning_rate)
        self.lr_var = None

    def minimize(self, net, loss, parameters=None):
        """Append backward and one update op per trainable parameter (train branch only).
        Returns [(parameter, gradient Variable)]."""
        params_grads = append_backward(net, loss, parameters)
        self._place = net.place
        self.lr_var = net.create_parameter(net.unique_name("learning_rate"), (), "float32",
                                           Constant(self.learning_rate), trainable=False)
        for param, grad in params_grads:
            if grad is not None:
                net.append_op(self.update(net, param, grad), "update")
        net.optimizer = self
        return params_grads

    def set_learning_rate(self, value):
        """Change the learning rate for the next steps (after minimize)."""
        if self.lr_var is None:
            raise ValueError("set_learning_rate: call minimize() first")
        self.learning_rate = float(value)
        self.lr_var.set(self._place.to_device(np.array(value, dtype=np.float32)))

    def update(self, net, param, grad):
        raise NotImplementedError


class SGD(Optimizer):
    """param -= learning_rate * grad."""

    def update(self, net, param, grad):
        return OpDesc("sgd", dict(param=param, grad=grad, learning_rate=self.lr_var,
                                  param_out=param))


class Momentum(Optimizer):
    """velocity = momentum * velocity + grad; param -= learning_rate * velocity
    (PyTorch's convention; nesterov=True uses grad + momentum * velocity)."""

    def __init__(self, learning_rate, momentum=0.9, nesterov=False):
        super().__init__(learning_rate)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)

    def update(self, net, param, grad):
        velocity = net.create_parameter(f"{param.name}.velocity", param.shape, param.dtype,
                                        Constant(0.0), trainable=False)
        return OpDesc("momentum", dict(param=param, grad=grad, velocity=velocity,
                                       learning_rate=self.lr_var, param_out=param,
                                       velocity_out=velocity, mu=self.momentum,
                                       use_nesterov=self.nesterov))
