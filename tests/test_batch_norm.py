"""batch_norm forward through the public API against the float64 reference
(tests/references.py):
modes, layouts, ranks, running estimates over batches and in-place aliasing.
(Finite-difference gradient checks live in test_batch_norm_grad.py, the errors a user
can run into in test_batch_norm_errors.py; the grad kernel is checked here against
its closed form.)"""
import numpy as np
import pytest
from references import batch_norm, batch_norm_grad, batch_stats

import minigraph as mg
from minigraph import OpError
from minigraph.kernels.cpu import batch_norm_stats as bn_cpu
from minigraph.kernels.cpu import blocks as cpu_blocks

rng = np.random.default_rng(1234)

SHAPES = {  # rank -> (NCHW shape, NHWC shape), 3 channels
    2: ((8, 3), (8, 3)),
    3: ((4, 3, 5), (4, 5, 3)),
    4: ((3, 3, 4, 2), (3, 4, 2, 3)),
    5: ((2, 3, 2, 3, 2), (2, 2, 3, 2, 3)),
}
MODES = {"train": {}, "global": {"use_global_est": True}, "infer": {"is_infer": True}}


# ---- building and running the op ----------------------------------------------------

class BN:
    """A scope with x and the batch-norm state, and one batch_norm op over them."""

    def __init__(self, x, layout="NCHW", counter=0, est=None, params=None, **attrs):
        c = x.shape[1] if layout == "NCHW" else x.shape[-1]
        dt = x.dtype
        self.scope = mg.Scope()
        self.x = self.scope.new_var("x")
        self.x.set(x)
        est_mean, est_var = est if est is not None else (rng.standard_normal(c),
                                                         rng.uniform(0.5, 2.0, c))
        scale, bias = params if params is not None else (rng.uniform(0.5, 1.5, c),
                                                         rng.standard_normal(c))
        self.mean = self._persistable("estimated_mean", np.asarray(est_mean, dt))
        self.var = self._persistable("estimated_var", np.asarray(est_var, dt))
        self.scale = self._persistable("scale", np.asarray(scale, dt))
        self.bias = self._persistable("bias", np.asarray(bias, dt))
        self.counter = (None if counter is None
                        else self._persistable("num_batches", np.array(counter, np.int64)))
        self.y, self.bm, self.bv = (self.scope.new_var(n) for n in ("y", "bm", "bv"))
        kw = {} if self.counter is None else {"num_batches": self.counter,
                                              "saved_num_batches": self.counter}
        self.attrs = dict(attrs, data_layout=layout)
        self.op = mg.Operator("batch_norm", x=self.x, estimated_mean=self.mean,
                              estimated_var=self.var, scale=self.scale, bias=self.bias,
                              y=self.y, batch_mean=self.bm, batch_var=self.bv,
                              saved_mean=self.mean, saved_var=self.var, **kw, **self.attrs)

    def _persistable(self, name, value):
        v = self.scope.new_var(name, persistable=True)
        v.set(value)
        return v

    def expected(self):
        """The reference for the op's next run, from the current state."""
        counter = None if self.counter is None else int(self.counter.get())
        a = dict(self.attrs)
        return batch_norm(self.x.get(), self.mean.get(), self.var.get(), self.scale.get(),
                          self.bias.get(), counter, a.pop("data_layout"), **a)

    def run(self):
        mg.Executor(mg.CPUPlace()).run([self.op], self.scope)

    def state(self):
        """Bitwise copies of the estimates and the counter."""
        vs = [self.mean, self.var] + ([self.counter] if self.counter is not None else [])
        return [v.get().tobytes() for v in vs]


def tol(dtype):
    return {np.float32: 2e-5, np.float64: 1e-11}[np.dtype(dtype).type]


def check(bn, want, dtype):
    t = tol(dtype)
    for var, key in ((bn.y, "y"), (bn.bm, "batch_mean"), (bn.bv, "batch_var"),
                     (bn.mean, "estimated_mean"), (bn.var, "estimated_var")):
        got = var.get()
        assert got.dtype == dtype, f"{key}: dtype {got.dtype}, expected {dtype}"
        np.testing.assert_allclose(got, want[key], rtol=t, atol=t, err_msg=key)
    if bn.counter is not None:
        assert bn.counter.get().dtype == np.int64 and bn.counter.get().shape == ()
        assert int(bn.counter.get()) == want["num_batches"]


def data(shape, dtype=np.float64, offset=3.0, std=2.0):
    return (offset + std * rng.standard_normal(shape)).astype(dtype)


# ---- every mode, layout and rank -------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("mode", list(MODES))
def test_modes_layouts_ranks(mode, layout, rank, dtype):
    shape = SHAPES[rank][0 if layout == "NCHW" else 1]
    bn = BN(data(shape, dtype), layout, counter=2, epsilon=1e-2, **MODES[mode])
    want = bn.expected()
    bn.run()
    check(bn, want, dtype)
    assert bn.y.get().shape == shape


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batch_var_is_biased_and_estimate_unbiased(layout):
    x = np.array([[1.0, 10.0], [3.0, 20.0], [8.0, 60.0]])     # 3 rows, 2 channels
    if layout == "NHWC":
        x = np.ascontiguousarray(x)
    bn = BN(x, layout, counter=0, params=([1.0, 1.0], [0.0, 0.0]))
    bn.run()
    np.testing.assert_allclose(bn.bm.get(), [4.0, 30.0])
    np.testing.assert_allclose(bn.bv.get(), [26 / 3, 1400 / 3])          # divided by n
    np.testing.assert_allclose(bn.var.get(), [13.0, 700.0])              # divided by n - 1
    np.testing.assert_allclose(bn.mean.get(), [4.0, 30.0])


def test_non_contiguous_input():
    x = data((4, 5, 3)).transpose(0, 2, 1)          # (4, 3, 5) view, not contiguous
    bn = BN(x, "NCHW", counter=1)
    want = bn.expected()
    bn.run()
    check(bn, want, np.float64)


# ---- offset data: |mean| / std = 1e4 ----------------------------------------------------

@pytest.mark.parametrize("layout, shape", [("NCHW", (16, 4, 32, 32)), ("NHWC", (16, 32, 32, 4)),
                                           ("NCHW", (64, 4))])
def test_offset_data_keeps_precision(layout, shape):
    x = data(shape, np.float32, offset=1e4, std=1.0)
    bn = BN(x, layout, counter=0, params=(np.ones(4), np.zeros(4)))
    want = bn.expected()
    bn.run()
    np.testing.assert_allclose(bn.bv.get(), want["batch_var"], rtol=1e-3)
    np.testing.assert_allclose(bn.var.get(), want["estimated_var"], rtol=1e-3)
    np.testing.assert_allclose(bn.bm.get(), want["batch_mean"], rtol=1e-7)
    np.testing.assert_allclose(bn.y.get(), want["y"], atol=2e-5)
    assert abs(bn.var.get() - 1.0).max() < 0.6          # not swamped by the offset


@pytest.mark.parametrize("first, rest", [(0.0, 1e4), (1e4, 0.0), (1e4, 1e4 + 5.0)])
def test_batch_whose_first_values_are_unlike_the_rest(first, rest):
    """The statistics' shift comes from the first values of each channel: a batch
    whose first sample differs from the others must still be exact to 1e-3."""
    x = data((64, 2, 32, 32), np.float32, offset=rest, std=1.0)
    x[0] = data((2, 32, 32), np.float32, offset=first, std=1.0)
    bn = BN(x, counter=0, params=(np.ones(2), np.zeros(2)))
    want = bn.expected()
    bn.run()
    np.testing.assert_allclose(bn.bv.get(), want["batch_var"], rtol=1e-3)
    np.testing.assert_allclose(bn.bm.get(), want["batch_mean"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(bn.y.get(), want["y"], atol=1e-4)


# ---- sequences of batches: first batch, momentum, cumulative average ---------------------

def test_first_batch_takes_the_batch_statistics():
    x = data((6, 3, 4))
    bn = BN(x, counter=0, est=([50.0] * 3, [70.0] * 3), momentum=0.9)
    bn.run()
    mean, var, n = batch_stats(x, "NCHW")
    np.testing.assert_allclose(bn.mean.get(), mean, rtol=1e-12)
    np.testing.assert_allclose(bn.var.get(), var * n / (n - 1), rtol=1e-12)
    assert int(bn.counter.get()) == 1


@pytest.mark.parametrize("momentum", [0.9, 0.0, 1.0])
def test_momentum_over_batches(momentum):
    bn = BN(data((5, 3, 4)), counter=0, momentum=momentum)
    est_mean = est_var = None
    for k in range(4):
        x = data((5, 3, 4), offset=k)                  # statistics differ from batch to batch
        bn.x.set(x)
        want = bn.expected()
        bn.run()
        mean, var, n = batch_stats(x, "NCHW")
        unbiased = var * n / (n - 1)
        if k == 0:
            est_mean, est_var = mean, unbiased
        else:            # momentum weights the old estimate
            est_mean = momentum * est_mean + (1 - momentum) * mean
            est_var = momentum * est_var + (1 - momentum) * unbiased
        np.testing.assert_allclose(bn.mean.get(), est_mean, rtol=1e-12)
        np.testing.assert_allclose(bn.var.get(), est_var, rtol=1e-12)
        check(bn, want, np.float64)
        assert int(bn.counter.get()) == k + 1
    if momentum == 1.0:
        assert not np.allclose(bn.mean.get(), batch_stats(x, "NCHW")[0])


def test_momentum_none_is_the_cumulative_average():
    bn = BN(data((5, 3, 4)), counter=0, momentum=None)
    means, variances = [], []
    for k in range(5):
        x = data((5, 3, 4), offset=2.0 * k, std=1.0 + k)
        bn.x.set(x)
        bn.run()
        mean, var, n = batch_stats(x, "NCHW")
        means.append(mean)
        variances.append(var * n / (n - 1))
        np.testing.assert_allclose(bn.mean.get(), np.mean(means, axis=0), rtol=1e-12)
        np.testing.assert_allclose(bn.var.get(), np.mean(variances, axis=0), rtol=1e-12)
        assert int(bn.counter.get()) == k + 1


def test_counter_resumes_without_the_first_batch_rule():
    bn = BN(data((5, 3)), counter=7, momentum=0.5)
    want = bn.expected()
    old = bn.mean.get().copy()
    bn.run()
    mean, _, _ = batch_stats(bn.x.get(), "NCHW")
    np.testing.assert_allclose(bn.mean.get(), 0.5 * old + 0.5 * mean, rtol=1e-12)
    check(bn, want, np.float64)
    assert int(bn.counter.get()) == 8


def test_without_counter_no_first_batch_rule():
    x = data((6, 3))
    bn = BN(x, counter=None, est=([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]), momentum=0.75)
    bn.run()
    mean, var, n = batch_stats(x, "NCHW")
    np.testing.assert_allclose(bn.mean.get(), 0.75 * np.array([1.0, 2.0, 3.0]) + 0.25 * mean,
                               rtol=1e-12)
    np.testing.assert_allclose(bn.var.get(),
                               0.75 * np.array([4.0, 5.0, 6.0]) + 0.25 * var * n / (n - 1),
                               rtol=1e-12)


def test_without_counter_momentum_none_is_rejected_at_build():
    with pytest.raises(OpError, match=r"batch_norm: momentum=None .*'num_batches'"):
        BN(data((6, 3)), counter=None, momentum=None)


# ---- in-place aliasing ----------------------------------------------------------------

def test_saved_outputs_are_the_estimates_updated_in_place():
    bn = BN(data((6, 3, 2)), counter=0)
    arrays = [bn.mean.value, bn.var.value, bn.counter.value]
    before = [a.copy() for a in arrays]
    bn.run()
    assert bn.op.outputs["saved_mean"] is bn.op.inputs["estimated_mean"] is bn.mean
    assert bn.op.outputs["saved_var"] is bn.op.inputs["estimated_var"] is bn.var
    assert bn.op.outputs["saved_num_batches"] is bn.op.inputs["num_batches"] is bn.counter
    for arr, var, old in zip(arrays, (bn.mean, bn.var, bn.counter), before, strict=True):
        assert arr is var.value                      # the very same array object ...
        assert not np.array_equal(arr, old)          # ... changed in place
    assert int(arrays[2]) == 1


@pytest.mark.parametrize("mode", ["global", "infer"])
def test_global_and_infer_leave_estimates_and_counter_bitwise(mode):
    bn = BN(data((6, 3, 2), np.float32), counter=4, **MODES[mode])
    arrays = [bn.mean.value, bn.var.value, bn.counter.value]
    before = bn.state()
    for _ in range(2):
        bn.x.set(data((6, 3, 2), np.float32, offset=-5.0))
        bn.run()
    assert bn.state() == before
    assert all(a is v.value for a, v in zip(arrays, (bn.mean, bn.var, bn.counter), strict=True))


# ---- the blocked, threaded kernels: many blocks, every block plan -------------------------

BLOCK_CASES = [
    ("NCHW", (9, 3, 5)),         # short inner axis: rows grouped into units, rows left over
    ("NHWC", (7, 5, 4, 3)),      # inner axis 1: units of rows
    ("NCHW", (10, 3, 20)),       # several whole rows per block
    ("NCHW", (9, 6, 40)),        # runs of channels inside a row, expanded constants
    ("NCHW", (3, 6, 40)),        # the same with broadcast constants (few rows)
    ("NCHW", (3, 2, 150)),       # one channel split into pieces
    ("NCHW", (9, 2, 150)),
]


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 64 floats (32 doubles), and two threads even for small tensors (which
    otherwise take the plain float64 path)."""
    monkeypatch.setattr(cpu_blocks, "CHUNK_BYTES", 256)
    monkeypatch.setattr(cpu_blocks, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(bn_cpu, "SMALL_VALUES", 0)
    with cpu_blocks.num_threads(2):
        yield


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("offset", [0.1, 3.0, 1e4])      # |mean| below std: x * k + c
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout, shape", BLOCK_CASES)
def test_many_blocks_match_the_reference(tiny_blocks, layout, shape, dtype, offset, mode):
    bn = BN(data(shape, dtype, offset=offset, std=1.0), layout, counter=1, **MODES[mode])
    if mode != "train":          # estimates near the data: y keeps its size
        bn.mean.set(bn.mean.get() + np.asarray(offset, dtype))
    want = bn.expected()
    bn.run()
    t = tol(dtype)
    var_tol = 1e-3 if offset > 100 and dtype == np.float32 else t
    np.testing.assert_allclose(bn.bm.get(), want["batch_mean"], rtol=t, atol=t)
    np.testing.assert_allclose(bn.y.get(), want["y"], rtol=t, atol=t)
    np.testing.assert_allclose(bn.bv.get(), want["batch_var"], rtol=var_tol)
    np.testing.assert_allclose(bn.var.get(), want["estimated_var"], rtol=var_tol)


def test_results_do_not_depend_on_threads_or_blocks(monkeypatch):
    x = data((16, 4, 50), np.float32)
    outs = []
    for threads, chunk in ((1, 1 << 18), (3, 512), (1, 512)):
        monkeypatch.setattr(cpu_blocks, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(cpu_blocks, "PARALLEL_MIN_BYTES", 0)
        monkeypatch.setattr(bn_cpu, "SMALL_VALUES", 0)
        with cpu_blocks.num_threads(threads):
            bn = BN(x, est=(np.zeros(4), np.ones(4)), params=(np.ones(4), np.zeros(4)))
            bn.run()
        outs.append([bn.y.get(), bn.bm.get(), bn.bv.get()])
    for a, b in zip(outs[1], outs[2], strict=True):          # same blocks, 1 or 3 threads
        assert a.tobytes() == b.tobytes()
    for a, b in zip(outs[0], outs[1], strict=True):          # different blocks
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ---- the kernel functions a synced batch norm reuses ------------------------------------

def test_local_stats_and_grad_sums_directly(tiny_blocks):
    x = data((6, 3, 40), np.float32, offset=1e4, std=1.0)
    dy = data((6, 3, 40), np.float32, offset=5.0)
    n, mean, m2 = bn_cpu.local_stats(x)
    want_mean, want_var, want_n = batch_stats(x, "NCHW")
    assert n == want_n == 240
    assert mean.dtype == m2.dtype == np.float64
    np.testing.assert_allclose(mean, want_mean, rtol=1e-12)
    np.testing.assert_allclose(m2 / n, want_var, rtol=1e-4)
    center = want_mean + 1e-3               # a float64 centre, not representable in float32
    n, s_dy, s_dyxmu = bn_cpu.grad_sums(x, dy, center)
    x64, dy64 = np.float64(x), np.float64(dy)
    np.testing.assert_allclose(s_dy, dy64.sum(axis=(0, 2)), rtol=1e-6)
    np.testing.assert_allclose(s_dyxmu, (dy64 * (x64 - center[:, None])).sum(axis=(0, 2)),
                               rtol=1e-4, atol=1e-2)


def test_local_stats_of_an_empty_batch():
    n, mean, m2 = bn_cpu.local_stats(np.empty((0, 3, 4), np.float32))
    assert n == 0 and mean.tolist() == [0, 0, 0] and m2.tolist() == [0, 0, 0]
    n, s_dy, s_dyxmu = bn_cpu.grad_sums(np.empty((0, 3, 4)), np.empty((0, 3, 4)), np.zeros(3))
    assert n == 0 and s_dy.tolist() == [0, 0, 0] and s_dyxmu.tolist() == [0, 0, 0]


# ---- the grad kernel against its closed form --------------------------------------------

@pytest.mark.parametrize("small, max_dot", [(1 << 14, 8192),   # plain float64
                                            (0, 8192), (0, 4)])  # blocks: einsum, multiply
@pytest.mark.parametrize("use_global_est", [False, True])
@pytest.mark.parametrize("offset, dtype", [(3.0, np.float64), (3.0, np.float32),
                                           (1e4, np.float32)])
@pytest.mark.parametrize("layout, shape", [("NCHW", (4, 3, 5, 6)), ("NHWC", (4, 5, 6, 3)),
                                           ("NCHW", (9, 2, 150))])
def test_grad_kernel_closed_form(layout, shape, offset, dtype, use_global_est, small, max_dot,
                                 monkeypatch):
    monkeypatch.setattr(cpu_blocks, "CHUNK_BYTES", 512)
    monkeypatch.setattr(bn_cpu, "SMALL_VALUES", small)
    monkeypatch.setattr(cpu_blocks, "MAX_DOT", max_dot)
    bn = BN(data(shape, dtype, offset=offset, std=1.0), layout, counter=1,
            use_global_est=use_global_est)
    if use_global_est:
        bn.mean.set(bn.mean.get() + np.asarray(offset, dtype))
    bn.run()
    dy = bn.scope.new_var("dy")
    dy.set(rng.standard_normal(shape).astype(dtype))
    grads = {id(v): bn.scope.new_var(v.name + "@GRAD") for v in (bn.x, bn.scale, bn.bias)}
    (desc,) = bn.op.schema.grad(bn.op, {"y": dy}, lambda v: grads.get(id(v)))
    mg.Executor(mg.CPUPlace()).run([mg.Operator(desc.type, **desc.kwargs)], bn.scope)
    stats = (bn.mean, bn.var) if use_global_est else (bn.bm, bn.bv)
    want = batch_norm_grad(bn.x.get(), dy.get(), bn.scale.get(), stats[0].get(),
                           stats[1].get(), 1e-5, layout, use_global_est)
    t = tol(dtype) * 10
    for v, w, name in zip((bn.x, bn.scale, bn.bias), want, ("dx", "dscale", "dbias"),
                          strict=True):
        got = grads[id(v)].get()
        assert got.dtype == dtype and got.shape == w.shape
        scale = max(1.0, np.abs(w).max())
        np.testing.assert_allclose(got, w, rtol=t, atol=t * scale, err_msg=name)
