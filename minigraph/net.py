"""Net: a trunk of shared ops that forks into a train branch and an infer branch.

A Net keeps its ops in sections: `init` (parameter initialisers), `trunk`
(shared by both modes), the `train` and `infer` branches, `backward` and
`update` (train only). Layers append ops through `Net.append`. Until the
first op whose schema declares a mode attribute (`OpSchema.mode_attr`,
batch_norm's and dropout's `is_infer`), ops go to the trunk; from that op
on, every layer appends two copies, one per branch: the train copy with the
mode attribute False and the infer copy with it True. A layer whose infer copy
binds more (a KV cache's state: `append(..., infer=...)`, `append_infer`) forks
the net too. Both copies bind the
same persistables (held by the root scope); each branch keeps its
temporaries in its own child scope. Graph rewrites (backward, optimizers,
passes) change sections only through `append_op`, `insert_op`,
`replace_op` and `remove_op`, which drop the cached run plans themselves,
and record what they did with `mark_applied`.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minigraph import feeds, net_build, net_freeze
from minigraph.executor import Executor, check_place
from minigraph.fair_lock import FairRLock
from minigraph.operator import as_operator
from minigraph.plan import Plan
from minigraph.scope import Scope, Variable, check_reserved_name

BRANCHES = ("train", "infer")
SECTIONS = ("init", "trunk", "train", "infer", "backward", "update")
MODE_SECTIONS = {"train": ("trunk", "train", "backward", "update"), "infer": ("trunk", "infer")}


class Net:
    """A network built by layers, run with `train` and `infer`.

    place: CPUPlace() (default) or GPUPlace(i). seed: seeds every
    initialiser (each parameter gets its own stream) and every dropout mask;
    None draws one.
    """

    def __init__(self, place=None, seed=None):
        self.place = check_place(place, "Net")
        self.seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
        self.scope = Scope()
        self.scopes = {b: self.scope.new_scope() for b in BRANCHES}
        self.executor = Executor(self.place)
        self.forked = False
        self.data_vars = {}
        self.grads = {}
        self.loss = None
        self.optimizer = None
        self.layers = []                 # what each layer built (see net.summary)
        self.default_fetches = ()        # what train/infer return when fetch is None
        self._sections = {s: [] for s in SECTIONS}
        self._twins = {}                 # id(branch Variable) -> its copy in the other branch
        self._applied = []
        self.reports = {}                # pass name -> what it reported (mark_applied)
        self._name_counts = {}
        self._plans = {}
        self._update_every = None        # (k, step counter): see update_every
        self.trained = ()                # the parameters the optimizer updates (minimize)
        self.frozen_at_minimize = ()     # the parameters frozen then (see net_freeze)
        self._lock = FairRLock()           # steps, saves and loads, in turn
        self._running = 0

    # ---- sections and rewrites ---------------------------------------------

    def section(self, name):
        """The ops of section `name` (one of SECTIONS), in order, as a tuple."""
        return tuple(self._ops_of(name))

    def append_op(self, op, section=None):
        """Append an Operator (or an OpDesc, built here) to `section`.

        By default: the trunk before the fork, and the branch its mode
        attribute names for a mode-dependent op (which forks the net).
        Returns the Operator."""
        op = as_operator(op)
        mode_attr = op.schema.mode_attr
        if section is None:
            if mode_attr is not None:
                section = "infer" if op.attrs[mode_attr] else "train"
            elif not self.forked:
                section = "trunk"
            else:
                raise ValueError(f"append_op({op.type}): the net has forked; say "
                                 "section='train' or section='infer'")
        ops = self._ops_of(section)
        if section == "trunk" and self.forked:
            raise ValueError(f"append_op({op.type}): the trunk ends at the fork")
        if mode_attr is not None and section in BRANCHES:
            self.forked = True
        ops.append(op)
        net_build.mark_value_rules(op)
        self._changed()
        return op

    def insert_op(self, section, index, op):
        """Insert an Operator (or OpDesc) at `index` of `section`; returns it."""
        op = as_operator(op)
        self._ops_of(section).insert(index, op)
        self._changed()
        return op

    def replace_op(self, section, old, new):
        """Put `new` (an Operator or OpDesc) where the Operator `old` is in `section`;
        `new` belongs to `old`'s layer unless it names its own."""
        ops = self._ops_of(section)
        new = as_operator(new)
        if new.layer is None:
            new.layer = old.layer
        ops[self._index(section, ops, old)] = new
        self._changed()
        return new

    def remove_op(self, section, op):
        """Take the Operator `op` out of `section`."""
        ops = self._ops_of(section)
        del ops[self._index(section, ops, op)]
        self._changed()

    def mark_applied(self, name, report=None):
        """Record that the transformation `name` was applied to this net, with what
        it reports (kept as `reports[name]`: fold_batch_norm's and fuse_conv2d's
        notes); a second time is an error (a pass must not run twice)."""
        if name in self._applied:
            raise ValueError(f"{name}: already applied to this net")
        self._applied.append(name)
        if report is not None:
            self.reports[name] = report

    @property
    def applied(self):
        """The names of the transformations applied to this net, in order."""
        return tuple(self._applied)

    def _ops_of(self, section):
        if section not in self._sections:
            raise ValueError(f"section must be one of {', '.join(map(repr, SECTIONS))}, "
                             f"got {section!r}")
        return self._sections[section]

    @staticmethod
    def _index(section, ops, op):
        for i, o in enumerate(ops):
            if o is op:
                return i
        raise ValueError(f"{op.type} is not an op of section {section!r}")

    def _changed(self):
        self._plans.clear()

    # ---- building ----------------------------------------------------------

    def unique_name(self, prefix, take=True):
        """`prefix_k` with the smallest k this net has not made nor seen used; with
        take=False the name it would make, without making it."""
        k = self._name_counts.get(prefix, 0)
        while self.name_taken(f"{prefix}_{k}"):
            k += 1
        if take:
            self._name_counts[prefix] = k + 1
        return f"{prefix}_{k}"

    def name_taken(self, name):
        """True when a layer, a data input or a variable prefix `name.` uses `name`."""
        dotted = name + "."
        return (any(rec.name == name for rec in self.layers) or name in self.data_vars
                or any(v.startswith(dotted) for s in (self.scope, *self.scopes.values())
                       for v in s.vars))

    def add_data(self, name, shape, dtype="float32"):
        """Declare a fed input: a root-scope Variable checked against every feed."""
        check_reserved_name(name, self.scope)
        var = self.scope.new_var(name)
        var.declare(shape, dtype)
        var.is_data = True
        self.data_vars[name] = var
        self._changed()
        return var

    def create_parameter(self, name, shape, dtype, init, trainable=True, fan_in=None,
                         fan_out=None, part=None):
        """A persistable root-scope Variable, initialised at once by `init` (an
        initializer from minigraph.initializer); `initialize(force=True)` runs
        the initialiser again. `part`: its part of a checkpoint (checkpoint_values.part_of)."""
        if trainable and self.loss is not None:
            raise ValueError(f"{name}: cannot add a trainable parameter after minimize() / "
                             "append_backward(): it would never be trained; build every layer "
                             "with parameters first")
        check_reserved_name(name, self.scope)
        var = self.scope.new_var(name, persistable=True, trainable=trainable)
        var.part = part
        var.declare(shape, dtype)
        seed = (self.seed + 7919 * len(self._sections["init"])) % (2 ** 31)
        desc = init.op(var, seed=seed, fan_in=fan_in, fan_out=fan_out)
        op = self.append_op(desc, "init")
        self.executor.run([op], self.scope)
        return var

    def append(self, op_type, inputs, outputs, attrs=None, infer=None):
        """Append `op_type` to the trunk, or to both branches once forked.

        inputs: {slot: Variable or list}; outputs: {slot: new variable name, or
        an input Variable for an in-place slot}. infer: what the infer copy binds
        besides (or instead of) them, {"inputs": {...}, "outputs": {...}, "attrs":
        {...}} (a KV cache's state, say); the two copies then differ, so the net
        forks here if it has not. Returns {slot: Variable} of the train copy (the
        trunk's when not forked). (minigraph.net_build does it.)
        """
        return net_build.append(self, op_type, inputs, outputs, attrs, infer)

    def append_infer(self, op_type, inputs, outputs, attrs=None, twins=None):
        """Append `op_type` to the infer branch alone (the net forks here if it has not):
        generation state such as a KV cache's, which training never reads. inputs are
        read as the infer branch sees them (a train Variable stands for its infer copy);
        twins {output slot: train Variable}: from here on, later layers' infer copies
        read that output where their train copies read the Variable. Returns {slot:
        Variable} of the op."""
        return net_build.append_infer(self, op_type, inputs, outputs, attrs, twins)

    @contextlib.contextmanager
    def building(self):
        """Everything built inside is undone if it raises: ops, variables,
        parameters, data declarations and names (layers build inside one)."""
        from minigraph.net_undo import restore, snapshot

        before = snapshot(self)
        try:
            yield
        except BaseException:
            restore(self, before)
            raise

    # ---- looking things up -------------------------------------------------

    def var(self, name, branch="train"):
        """The Variable named `name` as `branch` sees it (persistables are shared)."""
        var = self.scopes[branch].find_var(name)
        if var is None:
            raise KeyError(f"no variable named {name!r} in this net")
        return var

    def twin(self, var):
        """The other branch's copy of a branch Variable (None when it has none)."""
        return self._twins.get(id(var))

    def owns(self, var):
        """True when `var` is a Variable of this net (its root or a branch scope)."""
        return var.scope is self.scope or any(var.scope is s for s in self.scopes.values())

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

    def ops(self, mode="train", update=True):
        """The ops `train` or `infer` runs, in order (before pruning), as a list;
        without the update section when `update` is False."""
        if mode not in MODE_SECTIONS:
            raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")
        return [op for s in MODE_SECTIONS[mode] if update or s != "update"
                for op in self._sections[s]]

    def summary(self):
        """A table (str): per layer its name, op types, output shape and parameter
        count; then the trainable and non-trainable totals."""
        from minigraph.pictures.summary import summary
        return summary(self)

    # ---- running -----------------------------------------------------------

    def initialize(self, force=False):
        """Run the initialiser of every persistable that has no value (all of
        them with force=True). Parameters get their values when created, so
        this matters only after values were dropped, or to start over."""
        todo = [op for op in self._sections["init"]
                if force or any(v.value is None for v in op.output_vars())]
        self.executor.run(todo, self.scope)

    def train(self, feed=None, fetch=None):
        """One training step: trunk, train branch, backward and updates.
        Returns the fetched values (Variables or names) as numpy arrays.

        A step is all or nothing: if any op raises, every persistable
        (parameters, estimates, counters, optimizer state) keeps the value it
        had before the step. On a GPU, errors that kernels flag on the device
        (labels outside [0, K), non-finite batch statistics) are checked at
        the end of the step and raise the same way. Calls from several
        threads are serialised on the net."""
        return self._run("train", feed, fetch)

    def infer(self, feed=None, fetch=None):
        """Trunk and infer branch, pruned to what `fetch` needs. Never changes
        a persistable variable. May be called from inside a running step
        (e.g. from a kernel): the step's own values are kept."""
        return self._run("infer", feed, fetch)

    def update_every(self, k, counter):
        """Run the update section on every k-th train step only, counting steps in
        `counter` (an int64 persistable scalar); optimizer.GradientMerge sets this."""
        self._update_every = (int(k), counter)
        self._changed()

    def _run(self, mode, feed, fetch):
        with self._lock:
            nested = self._running > 0
            kept = self._temporaries() if nested else None
            self._running += 1
            try:
                feed = feeds.feed_by_name(self.data_vars, feed, mode)
                fetch = self.default_fetches if fetch is None else fetch
                targets = feeds.fetch_targets(self, mode, fetch)
                count = None
                if mode == "train" and self._update_every is not None:
                    k, counter = self._update_every
                    count = int(counter.get())
                frozen = net_freeze.frozen(self) if mode == "train" else ()
                plan = self.plan(mode, targets, count is None or (count + 1) % k == 0, frozen)
                with feeds.fed(self.place, self.data_vars, plan.needed, feed, mode):
                    out = self.executor.run_plan(plan)
                if count is not None:
                    counter.set(self.place.to_device(np.array(count + 1, np.int64)))
                return out
            finally:
                self._running -= 1
                if kept is not None:
                    for var, value in kept:
                        var.value = value

    def _temporaries(self):
        return [(v, v.value) for s in (self.scope, *self.scopes.values())
                for v in s.vars.values() if not v.persistable]

    def plan(self, mode, targets, update=True, frozen=()):
        """The cached run plan of `mode` for fetch `targets` (minigraph.plan.Plan),
        without the update section when `update` is False, and without the updates
        of the parameters whose ids are in `frozen` (minigraph.net_freeze); a
        training plan keeps the persistables' gradients after each step (as
        PyTorch keeps .grad)."""
        key = (mode, tuple(id(t) for t in targets), update, frozen)
        plan = self._plans.get(key)
        if plan is None:
            keep = [g for name, g in self.grads.items() if mode == "train" and
                    getattr(self.scope.find_var(name), "persistable", False)]
            ops = net_freeze.plan_ops(self, mode, update, frozen)
            plan = self._plans[key] = Plan(ops, mode, targets, keep)
        return plan

    # ---- pictures ----------------------------------------------------------

    def to_dot(self, backward=False, level="op", profile=None):
        """DOT source of this net (needs no Graphviz binary); level "op" or "layer",
        backward=True adds the grad and update ops (minigraph.pictures.render.to_dot)."""
        from minigraph.pictures.render import to_dot
        return to_dot(self, backward=backward, level=level, profile=profile)

    def render(self, path, backward=False, timeout=None, level="op", profile=None):
        """Write the net's picture; .svg, .png or .pdf by suffix
        (minigraph.pictures.render.render)."""
        from minigraph.pictures.render import render
        return render(self, path, backward, timeout, level=level, profile=profile)

    def profile(self, feed, steps=10, mode="train", fetch=None, warmup=2):
        """Time per op type and per layer over `steps` steps
        (minigraph.pictures.profile.profile)."""
        from minigraph.pictures.profile import profile
        return profile(self, feed, steps, mode, fetch, warmup)
