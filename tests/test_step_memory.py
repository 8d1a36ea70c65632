"""The lean training step (minigraph/executor.py): temporaries released once dead, dying
inputs handed over to kernels that may write into them (OpSchema.reuse), a flat
memory peak over many steps, input checks skipped only for a signature that
already ran, and the relu gradient's bit-mask kernel."""
import contextlib
import tracemalloc

import numpy as np
import pytest
from helpers import call_kernel, spying

import minigraph as mg
from minigraph import layers as L


def small_net(seed=0):
    net = mg.Net(seed=seed)
    img = L.data(net, "image", shape=(-1, 3, 8, 8))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.relu(net, L.batch_norm(net, L.conv2d(net, img, 8, 3, padding=1, bias=False)))
    short = h
    h = L.batch_norm(net, L.conv2d(net, h, 8, 3, padding=1, bias=False))
    h = L.relu(net, L.add(net, h, short))
    h = L.pool2d(net, h, global_pooling=True, pool_type="avg")
    logits = L.fc(net, L.flatten(net, h), 5, name="head")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    return net, h, logits, loss


def feed(n=16, seed=0):
    r = np.random.default_rng(seed)
    return {"image": r.standard_normal((n, 3, 8, 8)).astype(np.float32),
            "label": r.integers(0, 5, n)}


def test_a_training_step_keeps_fetches_persistables_and_parameter_grads():
    net, pooled, logits, loss = small_net()
    (p,) = net.train(feed=feed(), fetch=[pooled])
    assert p.shape == (16, 8, 1, 1)                    # a fetched temporary
    assert net.var("image").value is None              # the caller's array: let go
    for param in net.parameters():                     # like PyTorch's .grad
        assert net.grad(param).value is not None, param.name
    with pytest.raises(ValueError, match="has no value"):
        logits.get()                                   # released: fetch it to read it
    (lg,) = net.train(feed=feed(), fetch=[logits])
    assert lg.shape == (16, 5)
    (q,) = net.infer(feed={"image": feed()["image"]}, fetch=[logits])
    assert net.twin(logits).get().shape == (16, 5)     # inference keeps every value


def test_the_last_steps_parameter_grads_are_dropped_before_the_first_op():
    """A step computes every parameter's gradient anew, so the last step's values are
    dropped when it starts (PyTorch's zero_grad(set_to_none=True)) and hold no memory
    while it runs; after the step they are there again."""

    net, _, _, loss = small_net()
    grads = [net.grad(p) for p in net.parameters()]
    first = net.plan("train", (loss,)).ops[0]
    seen = []

    def make_spy(plain):
        def spy(op, ins, ctx):
            if op is first:
                seen.append([g.name for g in grads if g.value is not None])
            return plain(op, ins, ctx)
        return spy

    with spying(first.type, make_spy):
        for step in range(3):
            net.train(feed=feed(seed=step), fetch=[loss])
            assert all(g.value is not None for g in grads)
    assert seen == [[], [], []]


def test_released_values_do_not_change_the_results():
    """A net trained through the plan equals the same ops run by a plain Executor,
    which releases nothing. Both on the same kernels, which round alike: the plan's
    steps leave a conv room for Winograd's scratch, so where Winograd's kernel needs
    it (it did on an AVX2 machine) the plan's conv runs on Winograd and the plain
    run's on the direct kernel; and on more than one thread the plan's first steps run
    some ops on one to measure them (minigraph/op_threads.py), with choices of their
    own."""
    from minigraph.kernels.cpu import blocks, choices

    fast, _, _, loss = small_net()
    plain, _, _, ploss = small_net()
    ops = plain.ops("train")
    alike = {kind: "direct" for kind in ("conv2d", "conv2d_dx", "conv2d_dw")}
    with blocks.num_threads(1), choices.forcing(alike):
        for step in range(3):
            f = feed(seed=step)
            (got,) = fast.train(feed=f, fetch=[loss])
            for name, value in f.items():
                plain.data_vars[name].value = value.copy()
            plain.executor.run(ops, plain.scope)
            np.testing.assert_array_equal(got, ploss.get())
    for a, b in zip(fast.persistables(), plain.persistables()):
        np.testing.assert_array_equal(a.get(), b.get(), err_msg=a.name)


def test_add_grad_gets_shape_stand_ins_not_the_forward_values():
    """add_grad reads only the shapes of add's inputs (Slot.shape_only): a training
    step replaces a value that nothing else needs by a zero-stride stand-in once the
    forward is done."""

    net, _, _, loss = small_net()
    seen = []

    def make_spy(plain):
        def spy(op, ins, ctx):
            seen.append((ins["x"].strides, ins["y"].strides, ins["x"].shape))
            return plain(op, ins, ctx)
        return spy

    with spying("add_grad", make_spy):
        net.train(feed=feed(), fetch=[loss])
    (x_strides, y_strides, shape), = seen
    assert x_strides == (0, 0, 0, 0) and shape == (16, 8, 8, 8)    # batch norm's output
    assert y_strides != (0, 0, 0, 0)             # the shortcut: relu_grad needs its values


def x_seen(op_type, net, loss):
    """Per call of op_type's kernel in one training step of `net`: (strides, shape) of
    its input x (of each array, for a list)."""
    seen = []

    def make_spy(plain):
        def spy(op, ins, ctx):
            xs = ins["x"] if isinstance(ins["x"], list) else [ins["x"]]
            seen.append([(x.strides, x.shape) for x in xs])
            return plain(op, ins, ctx)
        return spy

    with spying(op_type, make_spy):
        net.train(feed=feed(), fetch=[loss])
    return seen


def trained_on(h, net, lbl):
    """The mean cross entropy of fc(flatten(h)) minimized by SGD in `net`."""
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, L.flatten(net, h), 5),
                                                    lbl))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    return loss


def image_net():
    net = mg.Net(seed=0)
    return (net, L.data(net, "image", shape=(-1, 3, 8, 8)),
            L.data(net, "label", shape=(-1,), dtype="int64"))


@pytest.mark.parametrize("pool_type", ["avg", "max"])
def test_average_pooling_grad_gets_a_stand_in_max_pooling_the_values(pool_type):
    """pool2d_grad reads only x's shape for average pooling (a callable Slot.shape_only):
    a training step drops the activation average pooling reads (a CIFAR CNN's silu
    outputs) once the forward is done; max pooling's gradient locates the max again
    in the values."""
    net, img, lbl = image_net()
    h = L.silu(net, L.conv2d(net, img, 8, 3, padding=1))
    h = L.pool2d(net, h, pool_size=2, pool_stride=2, pool_type=pool_type)
    ((strides, shape),), = x_seen("pool2d_grad", net, trained_on(h, net, lbl))
    assert shape == (16, 8, 8, 8) and (strides == (0, 0, 0, 0)) == (pool_type == "avg")


def test_reshape_grad_gets_a_stand_in():
    """reshape_grad (reshape's and flatten's) reads only x's shape: a training step
    drops x's value once the forward is done (a language model's logits, reshaped
    for the loss, need not live through backward for their shape)."""
    net, img, lbl = image_net()
    h = L.reshape(net, L.conv2d(net, img, 2, 3, padding=1), (-1, 2 * 8 * 8))
    seen = x_seen("reshape_grad", net, trained_on(h, net, lbl))   # flatten's, then reshape's
    assert seen == [[((0, 0), (16, 128))], [((0, 0, 0, 0), (16, 2, 8, 8))]], seen


def test_concat_grad_gets_stand_ins():
    """concat_grad reads only the shapes of concat's inputs: a training step drops
    the ones nothing else needs once the forward is done."""
    net, img, lbl = image_net()
    both = L.concat(net, [L.conv2d(net, img, 2, 3, padding=1),
                          L.conv2d(net, img, 3, 1)], axis=1)
    want = [((0, 0, 0, 0), (16, 2, 8, 8)), ((0, 0, 0, 0), (16, 3, 8, 8))]
    assert x_seen("concat_grad", net, trained_on(both, net, lbl)) == [want, want]


def test_two_hundred_steps_keep_a_flat_memory_peak():
    """tracemalloc (numpy reports its arrays to it) over 200 steps: the peak and what
    stays between steps do not grow. Slack: Python's free lists of small objects fill
    up over the first thousands of steps (tens of bytes a step; the RSS levels off),
    while one leaked activation of this net is 32 KiB a step."""
    net, _, _, loss = small_net()
    f = feed()
    for _ in range(5):
        net.train(feed=f, fetch=[loss])
    tracemalloc.start()
    try:
        peaks, current = [], []
        for _ in range(200):
            tracemalloc.reset_peak()
            net.train(feed=f, fetch=[loss])
            now, peak = tracemalloc.get_traced_memory()
            peaks.append(peak)
            current.append(now)
    finally:
        tracemalloc.stop()
    slack = 256 * 1024
    assert max(peaks[150:]) <= max(peaks[:50]) + slack
    assert current[-1] <= current[10] + slack


def test_a_new_input_signature_is_checked_again():
    """Checks are skipped only for feeds and persistables of shapes that already ran:
    a bad feed after many good steps still fails with the op's own error."""
    net, _, logits, loss = small_net()
    for n in (16, 16, 4):
        net.train(feed=feed(n), fetch=[loss])
    w = net.var("head.w")
    before = w.get().copy()
    w.value = np.zeros((7, 5), np.float32)              # a parameter of the wrong shape
    with pytest.raises(mg.OpError, match="mul"):
        net.train(feed=feed(), fetch=[loss])
    w.value = before
    net.train(feed=feed(), fetch=[loss])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_relu_grad_is_dout_where_out_is_positive_else_plus_zero(dtype):
    out = np.array([0.0, 1.0, 2.0, 0.0, 3.0, 0.0, np.nan, 5.0], dtype)
    d = np.array([np.inf, -1.5, np.nan, -2.0, 4.0, np.nan, 7.0, -np.inf], dtype)
    scope = mg.Scope()
    ov, dv, dx = scope.new_var("out"), scope.new_var("dout"), scope.new_var("dx")
    ov.set(out)
    dv.set(d)
    mg.Executor().run([mg.Operator("relu_grad", out=ov, dout=dv, dx=dx)], scope)
    want = np.where(out > 0, d, np.zeros((), dtype))
    got = dx.get()
    assert got.dtype == np.dtype(dtype)
    assert got.tobytes() == want.tobytes()           # the same bits, +0.0 included


REUSERS = ("relu", "relu_grad", "add", "elementwise_add", "batch_norm_grad")


def spy_on_handovers(net, op_types=REUSERS):
    """Wrap the CPU kernels of `op_types`; each call appends (op type, donated slots,
    {slot: True when an input array shares memory with another live Variable}) and
    checks that a donated input's memory now holds the output."""
    scopes = [net.scope, *net.scopes.values()]
    calls = []

    def held_elsewhere(op, slot, a):
        own = op.inputs[slot]
        return any(v is not own and isinstance(v.value, np.ndarray) and
                   np.shares_memory(v.value, a)
                   for scope in scopes for v in scope.vars.values())

    def make(op_type, fn):
        def spy(op, ins, ctx):
            shared = {s: held_elsewhere(op, s, a) for s, a in ins.items()
                      if isinstance(a, np.ndarray) and a.strides and 0 not in a.strides}
            calls.append((op_type, ctx.donated, shared))
            outs = fn(op, ins, ctx)
            for slot in ctx.donated:
                assert any(np.shares_memory(o, ins[slot]) for o in outs.values()), (op_type, slot)
            return outs
        return spy

    stack = contextlib.ExitStack()
    for op_type in op_types:
        stack.enter_context(spying(op_type, lambda fn, t=op_type: make(t, fn)))
    return calls, stack.close


def test_dying_inputs_are_handed_over_and_never_one_another_variable_sees():
    """relu, add, the fc's bias add and the relu and batch-norm gradients write into
    an input that dies with them; an array that another Variable also holds (add_grad passes dout
    through to both inputs' gradients) is never handed over; the results equal a plain
    Executor's (test_released_values_do_not_change_the_results) step after step."""
    net, _, _, loss = small_net()
    calls, restore = spy_on_handovers(net)
    try:
        for step in range(2):
            net.train(feed=feed(seed=step), fetch=[loss])
    finally:
        restore()
    donated = {(t, s) for t, slots, _ in calls for s in slots}
    assert donated == {("relu", "x"), ("relu_grad", "dout"), ("add", "x"),
                       ("elementwise_add", "x"), ("batch_norm_grad", "dy")}
    for op_type, slots, shared in calls:
        assert not any(shared[s] for s in slots), (op_type, slots, shared)
    assert any(t == "batch_norm_grad" and shared["dy"] and not slots
               for t, slots, shared in calls)      # the aliased dout was kept whole


def test_fetched_and_inference_values_are_never_written_over():
    """A fetched value lives past the step, and inference keeps every value: neither is
    handed over (relu would clip the batch norm's output in place)."""
    net = mg.Net(seed=0)
    img = L.data(net, "image", shape=(-1, 3, 8, 8))
    pre = L.batch_norm(net, L.conv2d(net, img, 4, 3, padding=1))
    h = L.relu(net, pre)
    loss = L.mean(net, L.flatten(net, h))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    calls, restore = spy_on_handovers(net, ("relu",))
    try:
        got_pre, got_h = net.train(feed={"image": feed()["image"]}, fetch=[pre, h])
        net.infer(feed={"image": feed()["image"]}, fetch=[h])
        assert (got_pre < 0).any() and not np.shares_memory(got_pre, got_h)
        np.testing.assert_array_equal(got_h, np.maximum(got_pre, 0))
        assert net.twin(pre).get().min() < 0
        assert [slots for _, slots, _ in calls] == [(), ()]
        net.train(feed={"image": feed()["image"]}, fetch=[loss])
    finally:
        restore()
    assert calls[-1][1] == ("x",)                      # not fetched: handed over


def test_every_reusing_op_says_what_it_may_overwrite():
    """OpSchema.reuse names real slots, and a kernel given a donated input writes into
    it (test_a_kernel_writing_into_a_handed_over_input_gives_the_same_bits)."""
    from minigraph.schema import get_schema, registered_ops

    reusing = [get_schema(t) for t in registered_ops() if get_schema(t).reuse]
    assert {s.type for s in reusing} >= set(REUSERS)
    for schema in reusing:
        for out_slot, in_slots in schema.reuse.items():
            assert out_slot in {s.name for s in schema.outputs}, schema.type
            assert set(in_slots) <= {s.name for s in schema.inputs}, schema.type
    assert {op.type for op, _, _ in kernel_cases()} == {s.type for s in reusing}


def run_kernel(op, ins, donated):
    return call_kernel(op, ins, donated=donated)


def kernel_cases():
    r = np.random.default_rng(3)
    scope = mg.Scope()

    def var(name):
        return scope.new_var(f"{name}{len(scope.vars)}")

    big = (5, 3, 47, 41)       # past relu_grad's MASK_BLOCK and batch norm's small path
    x = r.standard_normal(big).astype(np.float32)
    out = np.maximum(r.standard_normal(big), 0).astype(np.float32)
    bn_grad = {k: var(k) for k in ("x", "scale", "mean", "var", "dy", "dx")}
    yield (mg.Operator("relu", x=var("x"), out=var("out")), {"x": x}, "x")
    for dtype in ("float32", "float64"):
        yield (mg.Operator("relu_grad", out=var("o"), dout=var("d"), dx=var("dx")),
               {"out": out.astype(dtype), "dout": x.astype(dtype)}, "dout")
    for kind, keep in (("sigmoid", "out"), ("tanh", "out"), ("leaky_relu", "x"), ("silu", "x")):
        for dtype in ("float32", "float64"):     # native float32, numpy float64
            yield (mg.Operator(f"{kind}_grad", **{keep: var(keep)}, dout=var("d"), dx=var("dx")),
                   {keep: out.astype(dtype), "dout": x.astype(dtype)}, "dout")
    yield (mg.Operator("add", x=var("a"), y=var("b"), out=var("s")),
           {"x": x, "y": x[:1, :, :1]}, "x")
    yield (mg.Operator("add", x=var("a2"), y=var("b2"), out=var("s2")),
           {"x": x[0, :1], "y": x}, "y")
    yield (mg.Operator("subtract", x=var("a3"), y=var("b3"), out=var("s3")),
           {"x": x, "y": x[:1, :, :1]}, "x")
    yield (mg.Operator("subtract", x=var("a4"), y=var("b4"), out=var("s4")),
           {"x": x[0, :1], "y": x}, "y")
    yield (mg.Operator("elementwise_add", x=var("p"), y=var("q"), out=var("r"), axis=1),
           {"x": x, "y": x[0, :, 0, 0]}, "x")
    cases = ((0.0, False, "batch_norm_grad"), (40.0, False, "batch_norm_grad"),
             (0.0, True, "batch_norm_grad"), (0.0, False, "sync_batch_norm_grad"))
    for shift, use_est, op_type in cases:
        op = mg.Operator(op_type, use_global_est=use_est, **bn_grad)
        xs = (x + shift).astype(np.float64)
        yield (op, {"x": xs, "scale": r.standard_normal(3), "mean": xs.mean(axis=(0, 2, 3)),
                    "var": xs.var(axis=(0, 2, 3)), "dy": r.standard_normal(big)}, "dy")
    for use_est, op_type in ((False, "batch_norm_relu_grad"), (True, "batch_norm_relu_grad"),
                             (False, "sync_batch_norm_relu_grad")):
        op = mg.Operator(op_type, use_global_est=use_est, y=var("y"), **bn_grad)
        for dtype in ("float32", "float64"):
            xs = x.astype(dtype)
            yield (op, {"x": xs, "scale": r.standard_normal(3).astype(dtype),
                        "mean": xs.mean(axis=(0, 2, 3)), "var": xs.var(axis=(0, 2, 3)),
                        "dy": r.standard_normal(big).astype(dtype),
                        "y": r.standard_normal(big).astype(dtype)}, "dy")


@pytest.mark.parametrize("case", list(kernel_cases()),
                         ids=lambda c: f"{c[0].type}-{c[2]}-{c[1][c[2]].dtype}")
def test_a_kernel_writing_into_a_handed_over_input_gives_the_same_bits(case):
    op, ins, slot = case
    want = run_kernel(op, {k: v.copy() for k, v in ins.items()}, ())
    given = {k: v.copy() for k, v in ins.items()}
    target = given[slot]
    got = run_kernel(op, given, (slot,))
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name
    out_slot = next(o for o, i in op.schema.reuse.items() if slot in i)
    assert np.shares_memory(got[out_slot], target)
