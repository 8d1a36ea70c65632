"""Parameter groups: what `minimize(net, loss, parameters=...)` accepts, resolved to one
learning-rate multiplier and one weight decay per parameter.

parameters: None (every trainable parameter of the net), or a list whose elements
are each a parameter Variable or a group
    {"params": [Variable, ...], "learning_rate": multiplier, "weight_decay": wd}
("learning_rate" and "weight_decay" optional). A parameter's learning rate is the
optimizer's (its schedule included) times its group's multiplier times its
ParamAttr's learning_rate; its weight decay is its ParamAttr's weight_decay if set,
else its group's, else the optimizer's. Anything else is an error naming the
element: an empty list, an unknown key, a non-parameter, a frozen parameter, a
Variable of another net, or one parameter listed twice. A trainable parameter
left out of every element is not trained: a warning names it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from minigraph.scope import Variable
from minigraph.validators import check_number

GROUP_KEYS = ("params", "learning_rate", "weight_decay")


@dataclass(frozen=True)
class ParamSetting:
    """One parameter and what the optimizer does with it."""

    param: Variable
    lr_scale: float
    weight_decay: float


def _check_param(net, who, where, var):
    if not isinstance(var, Variable):
        raise TypeError(f"{who}: {where} must be a parameter Variable, got "
                        f"{type(var).__name__}")
    if not net.owns(var) or not var.persistable:
        raise ValueError(f"{who}: {where} ({var.name!r}) is not a parameter of this net")
    if not var.trainable:
        raise ValueError(f"{who}: {where} ({var.name!r}) is frozen (trainable=False); leave it "
                         "out, or make it with ParamAttr(trainable=True)")


def resolve(net, parameters, who, weight_decay):
    """[ParamSetting] for `parameters` (see the module doc); `who` names the caller in
    errors, `weight_decay` is the optimizer's."""
    if parameters is None:
        groups = [{"params": net.parameters()}]
        if not groups[0]["params"]:
            raise ValueError(f"{who}: this net has no trainable parameter")
    elif isinstance(parameters, (list, tuple)):
        if not parameters:
            raise ValueError(f"{who}: parameters is empty; nothing would be trained")
        groups = [p if isinstance(p, dict) else {"params": [p], "_single": True}
                  for p in parameters]
    else:
        raise TypeError(f"{who}: parameters must be None or a list of parameter Variables "
                        f"and groups ({{'params': [...], 'learning_rate': ..., "
                        f"'weight_decay': ...}}), got {type(parameters).__name__}")
    settings, seen = [], {}
    for i, group in enumerate(groups):
        where = f"parameters[{i}]"
        unknown = sorted(set(group) - set(GROUP_KEYS) - {"_single"})
        if unknown:
            raise ValueError(f"{who}: {where} has unknown keys {unknown}; a group's keys are "
                             f"{', '.join(GROUP_KEYS)}")
        params = group.get("params")
        if isinstance(params, Variable):
            params = [params]
        if not isinstance(params, (list, tuple)) or not params:
            raise ValueError(f"{who}: {where}['params'] must be a non-empty list of parameter "
                             f"Variables, got {params!r}")
        scale = check_number(group.get("learning_rate", 1.0),
                             f"{who}: {where}['learning_rate']")
        wd = group.get("weight_decay")
        if wd is not None:
            wd = check_number(wd, f"{who}: {where}['weight_decay']")
        for j, var in enumerate(params):
            at = where if group.get("_single") else f"{where}['params'][{j}]"
            _check_param(net, who, at, var)
            if id(var) in seen:
                raise ValueError(f"{who}: {at} ({var.name!r}) is also {seen[id(var)]}; list "
                                 "each parameter once")
            seen[id(var)] = at
            attr = var.param_attr
            own_scale = attr.learning_rate if attr is not None else 1.0
            own_wd = attr.weight_decay if attr is not None else None
            settings.append(ParamSetting(
                var, scale * own_scale,
                own_wd if own_wd is not None else wd if wd is not None else weight_decay))
    left = [p.name for p in net.parameters() if id(p) not in seen]
    if left:
        warnings.warn(f"{who}: the trainable parameter{'s' if len(left) > 1 else ''} "
                      f"{', '.join(map(repr, left))} {'are' if len(left) > 1 else 'is'} in no "
                      "element of parameters and will not be trained; list "
                      f"{'them' if len(left) > 1 else 'it'} (in a group with learning_rate "
                      "0.0 to keep the values), or freeze with trainable=False before "
                      "minimize()", UserWarning, stacklevel=4)
    return settings
