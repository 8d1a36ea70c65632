"""One generic op test: forward against a float64 reference, gradients against
central finite differences."""
from __future__ import annotations

import contextlib
import dataclasses
import subprocess

import numpy as np

import minigraph as mg
from minigraph.schema import KernelContext, get_schema

DEFAULT_TOL = {np.dtype("float16"): 1e-2, np.dtype("float32"): 1e-5, np.dtype("float64"): 1e-9}


def helper_test_op(op_type, inputs, attrs=None, reference=None, grad_wrt=(), outputs=None,
                   atol=None, rtol=None, seed=0, grad_atol=1e-6, grad_rtol=1e-5, eps=1e-6):
    """Run `op_type` once on `inputs` and check it; return its outputs {slot: array}.

    inputs: {slot: array}, a list of arrays for a duplicable slot; an optional
      slot left out (or None) stays unbound. Every run gets fresh copies, so
      ops that update inputs in place (their outputs alias inputs) are fine.
    reference(**inputs, **attrs) -> {out_slot: expected}: an independent numpy
      implementation; float inputs arrive as float64 copies, `attrs` exactly as
      given here. Every output it returns is compared (atol/rtol default to the
      precision of the float inputs, else of the output), and float outputs
      must keep the dtype of the float inputs. Outputs it leaves out are bound but not compared.
    grad_wrt: input slots whose gradients are checked, in float64, against
      central differences of loss = sum_k sum(w_k * out_k), w_k fixed random
      weights (from `seed`) over `outputs` (default: every float output the
      reference returns that is not an in-place alias of an input). The grad
      ops come from the schema's grad maker, asked for all slots at once and
      then for each slot alone.
    """
    attrs = dict(attrs or {})
    inputs = {k: v for k, v in inputs.items() if v is not None}
    schema = get_schema(op_type)
    expected = reference(**_map(inputs, _as_float64), **attrs) if reference else {}
    scope, op, in_vars = _build(op_type, inputs, attrs, expected)
    got = _run_forward(op, scope, in_vars, inputs)
    _check_bound_form(op, inputs)
    float_dtypes = [np.asarray(a).dtype for a in _leaves(inputs) if _is_float(a)]
    in_tol = max((DEFAULT_TOL[d] for d in float_dtypes), default=None)
    for slot, want in expected.items():
        for k, (g, w) in enumerate(_pairs(got[slot], want)):
            where = f"{op_type}: output {slot!r}" + (f"[{k}]" if isinstance(want, list) else "")
            w = np.asarray(w)
            assert g.shape == w.shape, f"{where}: shape {g.shape}, expected {w.shape}"
            if float_dtypes and _is_float(g):
                assert g.dtype == float_dtypes[0], \
                    f"{where}: dtype {g.dtype}, expected the input dtype {float_dtypes[0]}"
            tol = in_tol or DEFAULT_TOL.get(g.dtype, 0.0)
            np.testing.assert_allclose(g.astype(np.float64) if _is_float(g) else g, w,
                                       atol=tol if atol is None else atol,
                                       rtol=tol if rtol is None else rtol, err_msg=where)
    if grad_wrt:
        loss_slots = outputs if outputs is not None else [
            s for s in expected if s not in schema.inplace
            and all(_is_float(a) for a in _leaves({s: expected[s]}))]
        _check_grads(op_type, _map(inputs, _as_float64), attrs, expected, grad_wrt,
                     loss_slots, seed, grad_atol, grad_rtol, eps)
    return got


def _check_bound_form(op, inputs):
    """Where the op's CPU kernel has a bound form (minigraph.bound_run) that takes
    `inputs`: it gives the kernel's bits (from the same state: in-place outputs advance
    it), or the kernel's error, again after other values are written into the same
    input arrays (what it prepared must read them anew), and on new arrays of other
    values."""
    def copied(arrays):
        return {k: None if v is None else [np.array(a) for a in v] if isinstance(v, list)
                else np.array(v) for k, v in arrays.items()}

    def outcome(call, *args):
        try:
            return call(*args), None
        except Exception as e:  # noqa: BLE001 - compared with the kernel's below
            return None, e

    ins = copied({s.name: inputs.get(s.name) for s in op.schema.inputs})
    fn = op.schema.kernel_for("cpu", ins)
    bind = next((k.bind for k in op.schema.kernels["cpu"] if k.fn is fn), None)
    run = None if bind is None else bind(op)
    if run is None:
        return
    for step in range(3):
        if step == 2:                   # new arrays (then other values again)
            ins = copied(ins)
        if step:                        # other values (step 1: in the same arrays, where
            for a in _leaves(ins):      # writeable: not a filter a kernel keeps a transform of)
                if a is not None and _is_float(a) and a.flags.writeable:
                    a *= 0.5
                    a += 0.25
        before = copied(ins)
        got, error = outcome(run, ins)
        if got is None and error is None:
            return
        want, expected = outcome(fn, op, before, KernelContext())
        where = f"{op.type}: bound form, run {step}"
        assert (type(error), str(error)) == (type(expected), str(expected)), where
        if error is not None:
            return
        for slot, w in want.items():
            if isinstance(w, list):
                assert len(got[slot]) == len(w), f"{where}: output {slot!r}"
            for g, one in zip(got[slot], w) if isinstance(w, list) else [(got[slot], w)]:
                assert np.array_equal(g, one, equal_nan=True), f"{where}: output {slot!r}"


def call_kernel(op, ins, device="cpu", donated=(), room=None, place=None):
    """Call the kernel the runner would pick for `op` on `device` and the dtypes of
    `ins`, with a KernelContext of `donated` input slots and work `room`."""
    fn = op.schema.kernel_for(device, ins)
    return fn(op, ins, KernelContext(place, donated, room))


@contextlib.contextmanager
def spying(op_type, make_spy, device="cpu"):
    """Within the block, every `device` kernel `fn` of `op_type` is replaced by
    make_spy(fn) (a function (op, ins, ctx) -> outs); restored after."""
    schema = get_schema(op_type)
    plain = schema.kernels[device]
    schema.kernels[device] = tuple(dataclasses.replace(k, fn=make_spy(k.fn)) for k in plain)
    try:
        yield
    finally:
        schema.kernels[device] = plain


def committed_repo(path, files):
    """A git repository at `path` holding `files` ({relative path: text}) in one commit."""
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    for words in (("init", "-q"), ("add", "."), ("commit", "-q", "-m", "start")):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *words],
                       cwd=path, check=True, capture_output=True, timeout=60)
    return path


def same_as_twin(net, fetch, twin, twin_fetch, feeds, runs=2, what=""):
    """Each of `feeds` through net.infer and twin.infer `runs` times (a checked run, then
    bound ones; one where a KV cache moves on with each run): the fetched bytes agree."""
    for feed in feeds:
        for _ in range(runs):
            (got,) = net.infer(feed=feed, fetch=[fetch])
            (want,) = twin.infer(feed=feed, fetch=[twin_fetch])
            assert got.tobytes() == want.tobytes(), (what, {k: v.shape for k, v in feed.items()})


def trained_on(net, logits, label):
    """`net` minimized (Adam, 1e-2) on the mean cross entropy of `logits` (..., classes)
    against the int64 data `label` (one class per row of logits); (net, logits)."""
    from minigraph import layers

    classes = logits.shape[-1]
    loss = layers.mean(net, layers.softmax_with_cross_entropy(
        net, layers.reshape(net, logits, (-1, classes)), label))
    mg.optimizer.Adam(1e-2).minimize(net, loss)
    return net, logits


def tiny_bn_net(sync, place=None, seed=0, optimizer=None):
    """(net, loss, logits): image (N, 2, 4, 4) -> conv c1 -> batch_norm bn1 (sync_batch_norm
    when `sync`) -> relu -> fc1 (4 classes) -> mean cross entropy; `optimizer.minimize`d
    when one is given. The small net of the distributed and GPU tests."""
    from minigraph import layers

    net = mg.Net(place=place, seed=seed)
    img = layers.data(net, "image", shape=(-1, 2, 4, 4))
    lbl = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, img, num_filters=3, filter_size=3, padding=1, name="c1")
    h = layers.relu(net, layers.batch_norm(net, h, name="bn1", sync=sync))
    logits = layers.fc(net, h, size=4, name="fc1")
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, lbl))
    if optimizer is not None:
        optimizer.minimize(net, loss)
    return net, loss, logits


def _is_float(a):
    return np.asarray(a).dtype.kind == "f"


def _as_float64(a):
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a.copy()


def _map(arrays, fn):
    return {k: [fn(a) for a in v] if isinstance(v, list) else fn(v) for k, v in arrays.items()}


def _leaves(arrays):
    for v in arrays.values():
        yield from (v if isinstance(v, list) else [v])


def _pairs(a, b):
    return zip(a, b, strict=True) if isinstance(b, list) else [(a, b)]


def _build(op_type, inputs, attrs, expected):
    """A scope, the Operator, and its input Variables ({slot: Variable or list})."""
    schema = get_schema(op_type)
    scope = mg.Scope()
    kwargs = dict(attrs)
    in_vars = {}
    for slot in schema.inputs:
        if slot.name not in inputs:
            continue
        value = inputs[slot.name]
        if isinstance(value, list):
            in_vars[slot.name] = [scope.new_var(f"{slot.name}.{i}") for i in range(len(value))]
        else:
            in_vars[slot.name] = scope.new_var(slot.name)
    for slot in schema.outputs:
        src = schema.inplace.get(slot.name)
        if src is not None:
            if src in in_vars:
                kwargs[slot.name] = in_vars[src]
        elif isinstance(expected.get(slot.name), list):
            n = len(expected[slot.name])
            kwargs[slot.name] = [scope.new_var(f"out.{slot.name}.{i}") for i in range(n)]
        elif not slot.optional or slot.name in expected:
            kwargs[slot.name] = scope.new_var(f"out.{slot.name}")
    _set_inputs(in_vars, inputs)
    op = mg.Operator(op_type, **kwargs, **in_vars)
    return scope, op, in_vars


def _set_inputs(in_vars, inputs):
    for slot, var in in_vars.items():
        for v, a in _pairs(var, inputs[slot]):
            v.set(np.array(a, copy=True))


def _run_forward(op, scope, in_vars, inputs):
    """Fresh inputs, one run; the outputs as copies {slot: array or list}."""
    _set_inputs(in_vars, inputs)
    mg.Executor(mg.CPUPlace()).run([op], scope)
    got = {}
    for slot, var in op.outputs.items():
        if isinstance(var, list):
            got[slot] = [np.array(v.get(), copy=True) for v in var]
        elif var is not None and var.value is not None:
            got[slot] = np.array(var.get(), copy=True)
    return got


def _loss(got, weights):
    return sum(float(np.sum(w * got[s])) for s, w in weights.items())


def _check_grads(op_type, inputs, attrs, expected, grad_wrt, loss_slots, seed, atol, rtol, eps):
    schema = get_schema(op_type)
    assert schema.grad is not None, f"{op_type} has no grad maker"
    for slot in grad_wrt:
        assert slot in inputs, f"grad_wrt names {slot!r}, which is not an input given"
        assert all(np.asarray(a).dtype == np.float64 for a in _leaves({slot: inputs[slot]}))
    scope, op, in_vars = _build(op_type, inputs, attrs, expected)
    got = _run_forward(op, scope, in_vars, inputs)
    rng = np.random.default_rng(seed)
    weights = {s: rng.standard_normal(np.shape(got[s])) for s in loss_slots}

    numeric = {}
    for slot in grad_wrt:
        values = inputs[slot] if isinstance(inputs[slot], list) else [inputs[slot]]
        grads = []
        for value in values:
            g = np.zeros(value.shape)
            for idx in np.ndindex(value.shape):
                orig = value[idx]
                value[idx] = orig + eps
                up = _loss(_run_forward(op, scope, in_vars, inputs), weights)
                value[idx] = orig - eps
                down = _loss(_run_forward(op, scope, in_vars, inputs), weights)
                value[idx] = orig
                g[idx] = (up - down) / (2 * eps)
            grads.append(g)
        numeric[slot] = grads

    asks = [tuple(grad_wrt)] + ([(s,) for s in grad_wrt] if len(grad_wrt) > 1 else [])
    for wanted in asks:
        analytic = _analytic_grads(op, scope, in_vars, inputs, weights, wanted)
        for slot in wanted:
            for k, (a, n) in enumerate(zip(analytic[slot], numeric[slot], strict=True)):
                where = f"{op_type}: d loss / d {slot!r}" + (f"[{k}]" if k else "") + \
                        f" (grads asked for {wanted})"
                assert a is not None, f"{where}: the grad ops did not write it"
                assert a.shape == n.shape, f"{where}: shape {a.shape}, expected {n.shape}"
                np.testing.assert_allclose(a, n, atol=atol, rtol=rtol, err_msg=where)


def _analytic_grads(op, scope, in_vars, inputs, weights, wanted):
    """Forward on fresh inputs, then the grad maker's ops with d loss/d out = weights."""
    _run_forward(op, scope, in_vars, inputs)
    gscope = scope.new_scope()
    dout = {}
    for slot, var in op.outputs.items():
        if slot in weights and var is not None:
            d = gscope.new_var(var.name + "@GRAD")
            d.set(weights[slot].astype(var.get().dtype))
            dout[slot] = d
        else:
            dout[slot] = None
    targets = {id(v): v for s in wanted for v in _leaves({s: in_vars[s]})}
    made = {}

    def make_grad(var):
        if id(var) not in targets:
            return None
        if id(var) not in made:
            made[id(var)] = gscope.new_var(var.name + "@GRAD")
        return made[id(var)]

    descs = op.schema.grad(op, dout, make_grad)
    grad_ops = [mg.Operator(d.type, **d.kwargs) for d in descs]
    mg.Executor(mg.CPUPlace()).run(grad_ops, gscope)
    result = {}
    for slot in wanted:
        vs = in_vars[slot] if isinstance(in_vars[slot], list) else [in_vars[slot]]
        result[slot] = [made[id(v)].get() if id(v) in made and made[id(v)].value is not None
                        else None for v in vs]
    return result


def save_fails_mid_write(monkeypatch, error):
    """Make mg.io.save's atomic write write a few bytes of the file, then raise `error`
    (as a disk that fills up would), through the real atomic_write."""
    from minigraph.io import checkpoint

    real_atomic_write = checkpoint.atomic_write

    def partial(path, write):
        def write_part(f):
            f.write(b"PK\x03\x04 the first bytes")
            raise error
        return real_atomic_write(path, write_part)

    monkeypatch.setattr(checkpoint, "atomic_write", partial)


def native_products(module):
    """An autouse fixture for the tests of a native product kernel's launcher `module`
    (its MIN_WORK and MIN_THREAD_WORK): small test products run natively, on as many
    threads as asked. Assign it in the test module: `small_products = native_products(m)`."""
    import pytest

    @pytest.fixture(autouse=True)
    def every_product_native(monkeypatch):
        monkeypatch.setattr(module, "MIN_WORK", 1)
        monkeypatch.setattr(module, "MIN_THREAD_WORK", 1)

    return every_product_native


def native_built(name):
    """A skip mark for tests of kernels/cpu/<name>.c where it is not built here."""
    import pytest

    from minigraph.kernels.cpu import native

    return pytest.mark.skipif(native.library(name) is None,
                              reason=f"native kernels not built: {native.reason(name)}")
