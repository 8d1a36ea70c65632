"""Inference plans run again through the kernels' bound forms (minigraph.bound_run):
the bits of a run op by op, values read anew every run, fetches that later runs do not
rewrite, and the plain path where a form cannot apply. (Each op's form against its
kernel: tests/helpers.py, in every op's test.)"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import spying

import minigraph as mg
from minigraph import bound_run, feeds
from minigraph import layers as L

BOUND = ("layer_norm", "fused_fc", "gelu", "add")


def block_net(seed=0):
    """A training net whose infer branch runs layer_norm, fused_fc (weight_fixed False:
    fuse_fc on a training net; with gelu, and with a residual), gelu and add: every op
    with a bound form."""
    net = mg.Net(seed=seed)
    x = L.data(net, "x", shape=(-1, 4, 16))
    label = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.dropout(net, L.layer_norm(net, x, begin_norm_axis=2), 0.1)
    h = L.gelu(net, L.linear(net, h, 32, name="up"))
    h = L.add(net, L.linear(net, h, 16, name="down"), x)
    h = L.add(net, L.gelu(net, h), h)               # read twice: not fused into down's op
    logits = L.fc(net, h, 3, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, label))
    mg.optimizer.Adam(1e-2).minimize(net, loss)
    mg.passes.fuse_fc(net)
    return net, h, logits


def unbound(net, feed, fetch):
    """net.infer with the bound forms off (every run op by op)."""
    hold, bound_run.hold = bound_run.hold, lambda compiled: None
    try:
        return net.infer(feed=feed, fetch=fetch)
    finally:
        bound_run.hold = hold


def compiled_of(net, fetch):
    """The compiled plan net.infer runs for `fetch`."""
    plan = net.plan("infer", feeds.fetch_targets(net, "infer", fetch))
    return plan.compiled(net.place)


def test_a_plan_run_again_goes_through_the_bound_forms_with_the_bits_of_a_plain_run():
    net, h, logits = block_net()
    r = np.random.default_rng(0)
    x = r.standard_normal((5, 4, 16)).astype(np.float32)
    first = net.infer(feed={"x": x}, fetch=[h, logits])         # checked: op by op
    c = compiled_of(net, [h, logits])
    assert c.bound is None
    second = net.infer(feed={"x": x}, fetch=[h, logits])
    forms = {s.op.type: f is not None for s, f in zip(c.steps, c.bound.forms)}
    assert {t for t in BOUND if forms.get(t)} == set(BOUND), forms
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()
    kept = [step.op.output_vars()[0].value for step, form in zip(c.steps, c.bound.forms)
            if form is not None]        # each form's first (layer_norm's variance: a row)
    assert all(v.ctypes.data % 64 == 0 for v in kept)           # prepared.aligned_empty
    other = r.standard_normal((5, 4, 16)).astype(np.float32)     # new values, one shape
    got = net.infer(feed={"x": other}, fetch=[h, logits])
    want = unbound(net, {"x": other}, [h, logits])
    for a, b in zip(got, want):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(second, first):                             # not rewritten since
        assert a.tobytes() == b.tobytes()


def test_fetches_are_the_callers_and_values_follow_training_and_new_parameter_arrays():
    """A fetch is a copy the next run does not touch; the optimizer's in-place updates
    and a parameter given a new array (a load) are read by the next bound run."""
    net, h, logits = block_net()
    twin, twin_h, twin_logits = block_net()
    r = np.random.default_rng(1)
    x = r.standard_normal((3, 4, 16)).astype(np.float32)
    kept = []
    for step in range(4):
        (got,) = net.infer(feed={"x": x}, fetch=[logits])
        (want,) = unbound(twin, {"x": x}, [twin_logits])
        assert got.tobytes() == want.tobytes(), step
        kept.append((got, got.copy()))
        feed = {"x": x, "label": r.integers(0, 3, 3)}
        net.train(feed=feed)
        twin.train(feed=feed)
    for got, copy in kept:
        assert got.tobytes() == copy.tobytes()
    assert kept[0][1].tobytes() != kept[-1][1].tobytes()      # training changed them
    for name in ("up.w", "down.b"):
        value = r.standard_normal(net.var(name).get().shape).astype(np.float32)
        net.var(name).set(value)
        twin.var(name).set(value.copy())
    (got,) = net.infer(feed={"x": x}, fetch=[logits])
    (want,) = unbound(twin, {"x": x}, [twin_logits])
    assert got.tobytes() == want.tobytes()


def test_a_new_shape_checks_again_and_the_forms_follow_it():
    """A checked run of other shapes keeps the forms (they follow new shapes) while it
    picks the same kernels, and drops them when it picks others."""
    net, h, logits = block_net()
    r = np.random.default_rng(2)
    bounds = []
    for n in (2, 2, 7, 7, 7, 2, 2):
        x = r.standard_normal((n, 4, 16)).astype(np.float32)
        (got,) = net.infer(feed={"x": x}, fetch=[logits])
        (want,) = unbound(net, {"x": x}, [logits])
        assert got.shape == (n, 3) and got.tobytes() == want.tobytes(), n
        bounds.append(compiled_of(net, [logits]).bound)
    assert bounds[0] is None and all(b is bounds[1] for b in bounds[1:])
    with spying("gelu", lambda fn: lambda op, ins, ctx: fn(op, ins, ctx)):
        x = r.standard_normal((3, 4, 16)).astype(np.float32)
        net.infer(feed={"x": x}, fetch=[logits])        # checked: another gelu kernel
        assert compiled_of(net, [logits]).bound is None
        (got,) = net.infer(feed={"x": x}, fetch=[logits])
    assert compiled_of(net, [logits]).bound is not bounds[1]
    assert got.tobytes() == unbound(net, {"x": x}, [logits])[0].tobytes()


def test_an_inference_conv_net_runs_its_convs_bound_with_the_bits_of_a_plain_run(
        monkeypatch):
    """optimize_for_inference's fused_conv2d ops (a strided conv: the direct kernel; 3x3
    convs of 8 channels: Winograd's, one with a residual) run through their bound forms
    on a fed batch the plan reads anew every run, with the bits of runs op by op; each
    conv's call is prepared once (a new fed array of the same shape takes it too)."""
    from minigraph.kernels.cpu import conv_native

    if not conv_native.available():
        pytest.skip("native kernels not built here")
    prepared = []
    prepare = conv_native.prepared_forward
    monkeypatch.setattr(conv_native, "prepared_forward",
                        lambda *args, **kw: prepared.append(args) or prepare(*args, **kw))
    net = mg.Net(seed=0)
    image = L.data(net, "image", shape=(-1, 8, 12, 12))
    h = L.relu(net, L.batch_norm(net, L.conv2d(net, image, 8, 3, padding=1, bias=False)))
    h = L.relu(net, L.add(net, L.conv2d(net, h, 8, 3, padding=1), image))
    h = L.relu(net, L.conv2d(net, h, 8, 3, stride=2, padding=1))
    logits = L.fc(net, L.flatten(net, L.pool2d(net, h, global_pooling=True,
                                               pool_type="avg")), 3)
    fast = mg.passes.optimize_for_inference(net)
    logits = fast.var(logits.name)
    r = np.random.default_rng(3)
    batches = [r.standard_normal((2, 8, 12, 12)).astype(np.float32) for _ in range(3)]
    fed = batches[0].copy()
    for x in batches:
        fed[...] = x                                  # the same array, new values
        got = fast.infer(feed={"image": fed}, fetch=[logits])[0]
        assert got.tobytes() == unbound(fast, {"image": x}, [logits])[0].tobytes()
    c = compiled_of(fast, [logits])
    convs = [f for s, f in zip(c.steps, c.bound.forms) if s.op.type == "fused_conv2d"]
    assert len(convs) == 3 and all(f is not None for f in convs)
    assert len(prepared) == 3


def test_an_fc_net_fed_the_same_array_prepares_its_first_product_once(monkeypatch):
    """The first fused_fc reads the feed, stored as a new read-only view every run: fed
    the same array again (written in place between runs), the bound run prepares
    nothing again and gives the bits of a run op by op; a new array is prepared for.
    (fc_native's kernel is forced: a timed choice of BLAS would prepare nothing here.)"""
    from minigraph.kernels.cpu import choices, fc_native

    if not fc_native.supports(np.zeros((8, 64), np.float32), np.zeros((64, 4096), np.float32)):
        pytest.skip("native kernels not built here")
    prepared = []
    prepare = fc_native.prepared_forward
    monkeypatch.setattr(fc_native, "prepared_forward",
                        lambda *args: prepared.append(args[1].shape) or prepare(*args))
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 64))
    logits = L.fc(net, L.relu(net, L.fc(net, x, 4096, name="wide")), 3, name="head")
    fast = mg.passes.optimize_for_inference(net)
    logits = fast.var(logits.name)
    r = np.random.default_rng(6)
    fed = r.standard_normal((8, 64)).astype(np.float32)
    with choices.forcing({"fc": "native"}):
        fast.infer(feed={"x": fed}, fetch=[logits])   # the checked run, then the first
        fast.infer(feed={"x": fed}, fetch=[logits])   # bound one, which prepares
        for _ in range(3):
            fed *= -1.5                               # the same array, new values
            before = len(prepared)
            (got,) = fast.infer(feed={"x": fed}, fetch=[logits])
            assert len(prepared) == before            # nothing prepared again
            assert got.tobytes() == unbound(fast, {"x": fed}, [logits])[0].tobytes()
        other = r.standard_normal((8, 64)).astype(np.float32)
        before = len(prepared)
        (got,) = fast.infer(feed={"x": other}, fetch=[logits])
        assert prepared[before:] == [(64, 4096)]      # another array: prepared for
        assert got.tobytes() == unbound(fast, {"x": other}, [logits])[0].tobytes()


def test_a_fixed_weight_written_in_place_is_prepared_anew():
    """A conv filter (kept Winograd transform) and a fixed fc weight (kept packed copy),
    of ops whose inputs are other ops' kept outputs (the same arrays every run), made
    writeable again and written in place: the next bound run transforms and packs them
    anew, with the bits of a run op by op. (Winograd's and fc_native's kernels are
    forced: a timed choice of another kernel keeps nothing made from the weights.)"""
    from minigraph.kernels.cpu import choices, conv_native, fc_native

    if not (conv_native.available() and fc_native.supports(
            np.zeros((2, 1152), np.float32), np.zeros((1152, 512), np.float32))):
        pytest.skip("native kernels not built here")
    net = mg.Net(seed=0)
    image = L.data(net, "image", shape=(-1, 8, 12, 12))
    h = L.relu(net, L.conv2d(net, image, 8, 3, padding=1, name="c0"))
    h = L.relu(net, L.conv2d(net, h, 8, 3, padding=1, name="c"))    # reads c0's kept output
    h = L.relu(net, L.fc(net, L.flatten(net, h), 512, name="f0"))
    logits = L.fc(net, h, 256, name="f")                            # reads f0's kept output
    fast = mg.passes.optimize_for_inference(net)
    logits = fast.var(logits.name)
    with choices.forcing({"fused_conv2d": "winograd", "fc": "native"}):
        x = np.random.default_rng(4).standard_normal((2, 8, 12, 12)).astype(np.float32)
        for _ in range(3):
            fast.infer(feed={"image": x}, fetch=[logits])
        c = compiled_of(fast, [logits])
        assert all(f is not None for s, f in zip(c.steps, c.bound.forms)
                   if s.op.type in ("fused_conv2d", "fused_fc"))
        for name in ("c.w", "f.w"):
            w = fast.var(name).value
            assert not w.flags.writeable                  # transformed / packed, so read-only
            w.flags.writeable = True
            w *= -0.5
        (got,) = fast.infer(feed={"image": x}, fetch=[logits])
        assert got.tobytes() == unbound(fast, {"image": x}, [logits])[0].tobytes()


def test_a_run_started_while_another_holds_the_plan_runs_op_by_op():
    """hold() gives the forms to one run at a time: a second run of the plan (a kernel
    calling net.infer, another thread) gets None and runs with new arrays."""
    net, h, logits = block_net()
    x = np.random.default_rng(3).standard_normal((2, 4, 16)).astype(np.float32)
    for _ in range(2):
        net.infer(feed={"x": x}, fetch=[logits])
    c = compiled_of(net, [logits])
    held = bound_run.hold(c)
    assert held is not None and bound_run.hold(c) is None
    found = []
    worker = threading.Thread(target=lambda: found.append(bound_run.hold(c)))
    worker.start()
    worker.join(timeout=60)
    assert found == [None]
    (inside,) = net.infer(feed={"x": x}, fetch=[logits])       # while held: op by op
    held.lock.release()
    (after,) = net.infer(feed={"x": x}, fetch=[logits])
    assert inside.tobytes() == after.tobytes()
    assert bound_run.hold(c) is held
    held.lock.release()


def test_generation_through_the_bound_forms_equals_generation_without():
    """examples/train_gpt's net, small: a KV cache's kv_cache_write writes each token's
    keys and values in place (its form, once it has seen the slabs), so the cache grows;
    the attention over it (its form passes the in-place step counter on, as the kernel
    does without dropout) reads the new rows each token; every pass's logits are those
    of runs op by op."""
    from minigraph.examples import train_gpt as G
    from minigraph.generation import generate

    cache = L.KVCache(24)
    net, h = G.build_gpt(11, G.Config(layers=2, heads=2, width=16, context=24), cache=cache)
    tokens, logits = h["tokens"], h["logits"]
    prompt = np.array([[1, 2, 3]])

    def unbound_run(fn):
        hold, bound_run.hold = bound_run.hold, lambda compiled: None
        try:
            return fn()
        finally:
            bound_run.hold = hold

    want = unbound_run(lambda: generate(net, tokens, logits, prompt, 12, temperature=0,
                                        kv_cache=cache))
    got = generate(net, tokens, logits, prompt, 12, temperature=0, kv_cache=cache)
    assert got.tolist() == want.tolist()

    def passes(seq):                    # each token's logits, the cache growing
        cache.reset()
        seen = [net.infer(feed={"tokens": seq[:, :3]}, fetch=[logits])[0]]
        for token in seq[0, 3:]:
            seen.append(net.infer(feed={"tokens": np.array([[token]])}, fetch=[logits])[0])
        return seen

    seq = np.arange(1, 16).reshape(1, 15) % 11
    plain = unbound_run(lambda: passes(seq))
    unbound_run(lambda: passes((seq + 5) % 11))     # other keys and values in every row
    for i, (a, b) in enumerate(zip(passes(seq), plain, strict=True)):
        assert a.tobytes() == b.tobytes(), i
    c = compiled_of(net, [logits])
    forms = {s.op.type: f is not None for s, f in zip(c.steps, c.bound.forms)}
    assert all(forms[t] for t in ("kv_cache_write", "scaled_dot_product_attention",
                                  "fused_fc", "layer_norm", "embedding", "position_embedding"))
    att = next(s.op for s in c.steps if s.op.type == "scaled_dot_product_attention")
    assert att.outputs["step_out"] is not None         # the case the form passes on


def test_forms_that_do_not_apply_leave_the_run_to_the_kernels():
    """float64 gelu has no native kernel: its form gives None and the kernel runs, every
    run; float64 layer_norm's form applies (the kernel runs on the checked run only)."""
    calls = {"gelu": 0, "layer_norm": 0}

    def counting(op_type):
        def make(fn):
            def spy(op, ins, ctx):
                calls[op_type] += 1
                return fn(op, ins, ctx)
            return spy
        return make

    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 8), dtype="float64")
    y = L.gelu(net, L.layer_norm(net, x))
    data = np.random.default_rng(5).standard_normal((3, 8))
    with spying("gelu", counting("gelu")), spying("layer_norm", counting("layer_norm")):
        runs = [net.infer(feed={"x": data}, fetch=[y])[0] for _ in range(4)]
    assert calls == {"gelu": 4, "layer_norm": 1}
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)


def test_a_bound_run_raises_the_kernels_errors():
    """An id outside the table in a bound run (embedding's one-id path) is the kernel's
    OpError naming the op, the input and the value; the next good run is right."""
    net = mg.Net(seed=0)
    tokens = L.data(net, "tokens", shape=(1, -1), dtype="int64")
    rows = L.embedding(net, tokens, 11, 8, name="emb")
    for _ in range(3):
        (good,) = net.infer(feed={"tokens": np.array([[3]])}, fetch=[rows])
    assert compiled_of(net, [rows]).bound.forms[0] is not None
    for bad in (11, -1):
        with pytest.raises(mg.OpError, match=rf"embedding: input 'ids' has value {bad} at "
                                             r"flat position 0, outside \[0, 11\)"):
            net.infer(feed={"tokens": np.array([[bad]])}, fetch=[rows])
    (again,) = net.infer(feed={"tokens": np.array([[3]])}, fetch=[rows])
    assert again.tobytes() == good.tobytes()
