"""Net: a trunk of shared ops that forks into a train branch and an infer branch.

Layers append ops through `Net.append`. Until the first op whose schema has
an `is_infer` attribute, ops go to the trunk; from that op on, every layer
appends two copies, one per branch: the train copy with is_infer=False and the
infer copy with is_infer=True. Both copies bind the same persistables (held by
the root scope); each branch keeps its temporaries in its own child scope, so
a name resolves to the branch's own copy. Backward and update ops go to the
train branch only.
"""
from __future__ import annotations

from minigraph.executor import Executor, check_feed
from minigraph.operator import Operator
from minigraph.place import CPUPlace
from minigraph.schema import get_schema
from minigraph.scope import Scope, Variable

BRANCHES = ("train", "infer")


class Net:
    """A network built by layers, run with `train` and `infer`.

    place: CPUPlace() (default) or GPUPlace(i). seed: seeds every
    initialiser (each parameter gets its own stream); None draws one.
    """

    def __init__(self, place=None, seed=None):
        import numpy as np

        self.place = place if place is not None else CPUPlace()
        self.seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
        self.scope = Scope()
        self.scopes = {b: self.scope.new_scope() for b in BRANCHES}
        self.executor = Executor(self.place)
        self.init_ops = []
        self.trunk = []
        self.branch = {b: [] for b in BRANCHES}
        self.backward_ops = []
        self.update_ops = []
        self.forked = False
        self.data_vars = {}
        self.grads = {}
        self.loss = None
        self.optimizer = None
        self._initialized = False
        self._name_counts = {}
        self._plans = {}

    # ---- building ----------------------------------------------------------

    def unique_name(self, prefix):
        """`prefix_k`, k counting the names this net has made for `prefix`."""
        k = self._name_counts.get(prefix, 0)
        self._name_counts[prefix] = k + 1
        return f"{prefix}_{k}"

    def add_data(self, name, shape, dtype="float32"):
        """Declare a fed input: a root-scope Variable checked against every feed."""
        var = self.scope.new_var(name)
        var.declare(shape, dtype)
        var.is_data = True
        self.data_vars[name] = var
        self.ops_changed()
        return var

    def create_parameter(self, name, shape, dtype, init, trainable=True, fan_in=None,
                         fan_out=None):
        """A persistable root-scope Variable initialised once by `init`
        (an initializer from minigraph.initializer)."""
        var = self.scope.new_var(name, persistable=True, trainable=trainable)
        var.declare(shape, dtype)
        seed = (self.seed + 7919 * len(self.init_ops)) % (2 ** 31)
        desc = init.op(var, seed=seed, fan_in=fan_in, fan_out=fan_out)
        self.init_ops.append(Operator(desc.type, **desc.kwargs))
        self._initialized = False
        return var

    def append(self, op_type, inputs, outputs, attrs=None):
        """Append `op_type` to the trunk, or to both branches once forked.

        inputs: {slot: Variable or list}; outputs: {slot: new variable name, or
        an input Variable for an in-place slot}. Returns {slot: Variable} of
        the train copy (the trunk's when not forked).
        """
        attrs = dict(attrs or {})
        mode_dependent = get_schema(op_type).has_attr("is_infer")
        if mode_dependent:
            self.forked = True
        if not self.forked:
            op = self._build(op_type, inputs, outputs, attrs, self.scope)
            self.trunk.append(op)
            self.ops_changed()
            return op.outputs
        result = None
        for b in BRANCHES:
            scope = self.scopes[b]
            if mode_dependent:
                attrs["is_infer"] = b == "infer"
            ins = {slot: _resolve(scope, v) for slot, v in inputs.items()}
            op = self._build(op_type, ins, outputs, attrs, scope)
            self.branch[b].append(op)
            result = result or op.outputs
        self.ops_changed()
        return result

    def append_op(self, op, branch=None):
        """Append a hand-built Operator. branch: "trunk", "train" or "infer";
        by default the trunk before the fork, and the branch named by the op's
        `is_infer` for a mode-dependent op (which forks the net)."""
        if branch is None:
            if "is_infer" in op.attrs:
                branch = "infer" if op.attrs["is_infer"] else "train"
                self.forked = True
            elif not self.forked:
                branch = "trunk"
            else:
                raise ValueError(f"append_op({op.type}): the net has forked; say "
                                 "branch='train' or branch='infer'")
        if branch == "trunk":
            if self.forked and "is_infer" not in op.attrs:
                raise ValueError(f"append_op({op.type}): the trunk ends at the fork")
            self.trunk.append(op)
        elif branch in BRANCHES:
            self.branch[branch].append(op)
        else:
            raise ValueError(f"append_op: branch must be 'trunk', 'train' or 'infer', "
                             f"got {branch!r}")
        self.ops_changed()
        return op

    def append_desc(self, desc, section):
        """Build an OpDesc and append it to `section` (a list of this net's)."""
        op = Operator(desc.type, **desc.kwargs)
        section.append(op)
        self.ops_changed()
        return op

    def _build(self, op_type, inputs, outputs, attrs, scope):
        outs = {}
        for slot, target in outputs.items():
            if isinstance(target, Variable):
                outs[slot] = target
            elif isinstance(target, (list, tuple)):
                outs[slot] = [scope.new_var(t) for t in target]
            else:
                outs[slot] = scope.new_var(target)
        return Operator(op_type, **inputs, **outs, **attrs)

    def ops_changed(self):
        """Forget cached run plans; call after rewriting ops in place (graph passes)."""
        self._plans.clear()

    # ---- looking things up -------------------------------------------------

    def var(self, name, branch="train"):
        """The Variable named `name` as `branch` sees it (persistables are shared)."""
        var = self.scopes[branch].find_var(name)
        if var is None:
            raise KeyError(f"no variable named {name!r} in this net")
        return var

    def persistables(self):
        """Every persistable Variable, once each, in creation order."""
        return [v for v in self.scope.vars.values() if v.persistable]

    def parameters(self):
        """The trainable persistables."""
        return [v for v in self.persistables() if v.trainable]

    def grad(self, var):
        """The Variable holding d(loss)/d(var); available after minimize()."""
        name = var.name if isinstance(var, Variable) else var
        if name not in self.grads:
            raise KeyError(f"no gradient for {name!r}: call an optimizer's minimize() or "
                           "append_backward() first, and check the loss depends on it")
        return self.grads[name]

    def ops(self, mode="train"):
        """The ops `train` or `infer` runs, in order (before pruning)."""
        if mode == "train":
            return self.trunk + self.branch["train"] + self.backward_ops + self.update_ops
        if mode == "infer":
            return self.trunk + self.branch["infer"]
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")

    # ---- running -----------------------------------------------------------

    def initialize(self, force=False):
        """Run the initialiser of every persistable that has no value yet (all of
        them with force=True); `train` and `infer` call this when needed, so
        values loaded or set before the first step are kept."""
        todo = [op for op in self.init_ops
                if force or any(v.value is None for v in op.output_vars())]
        self.executor.run(todo, self.scope)
        self._initialized = True

    def train(self, feed=None, fetch=None):
        """One training step: trunk, train branch, backward and updates.
        Returns the fetched values (Variables or names) as numpy arrays. On a
        GPU, errors that kernels flag on the device (labels outside [0, K),
        non-finite batch statistics) raise at the first fetch after the step
        that caused them, when the fetched values are copied out."""
        return self._run("train", feed, fetch)

    def infer(self, feed=None, fetch=None):
        """Trunk and infer branch, pruned to what `fetch` needs. Never changes
        a persistable variable."""
        return self._run("infer", feed, fetch)

    def _run(self, mode, feed, fetch):
        if not self._initialized:
            self.initialize()
        feed = feed or {}
        fetch = list(fetch or [])
        scope = self.scopes[mode]
        targets = tuple(_resolve(scope, f) for f in fetch)
        ops, needed = self._plan(mode, targets)
        for name in feed:
            if name not in self.data_vars:
                raise KeyError(f"feed {name!r}: not a data variable of this net; data: "
                               f"{', '.join(self.data_vars) or '(none)'}")
        missing = [v.name for v in needed if v.name not in feed]
        if missing:
            raise KeyError(f"{mode}: missing feed {', '.join(map(repr, missing))}; the ops run "
                           f"need {', '.join(v.name for v in needed)}")
        ex = self.executor
        for name, value in feed.items():
            var = self.data_vars[name]
            var.set(self.place.to_device(check_feed(var, value)))
        for op in ops:
            ex.run_op(op)
        return ex.fetch_all(scope, targets)     # raises what GPU kernels flagged

    def _plan(self, mode, targets):
        key = (mode, tuple(id(t) for t in targets))
        plan = self._plans.get(key)
        if plan is None:
            ops = self.ops(mode)
            if mode == "infer" and targets:
                ops = prune(ops, targets)
            needed = []
            for op in ops:
                for v in op.input_vars():
                    if v.is_data and v not in needed:
                        needed.append(v)
            plan = self._plans[key] = (ops, needed)
        return plan

    # ---- pictures ----------------------------------------------------------

    def to_dot(self, backward=False):
        """DOT source of this net (needs no Graphviz binary); backward=True
        also draws the grad and update ops."""
        from minigraph.render import to_dot
        return to_dot(self, backward=backward)

    def render(self, path, backward=False):
        """Write the net's picture; .svg, .png or .pdf by suffix (needs `dot`)."""
        from minigraph.render import render
        return render(self, path, backward=backward)


def prune(ops, targets):
    """The ops that contribute to `targets`, in their original order."""
    needed = {id(t) for t in targets}
    kept = []
    for op in reversed(ops):
        if any(id(v) in needed for v in op.output_vars()):
            kept.append(op)
            needed.update(id(v) for v in op.input_vars())
    return kept[::-1]


def _resolve(scope, v):
    if isinstance(v, list):
        return [_resolve(scope, x) for x in v]
    name = v.name if isinstance(v, Variable) else v
    found = scope.find_var(name)
    if found is None:
        raise KeyError(f"no variable named {name!r} in this branch")
    return found

