"""kernels/cpu/prepared.py: a bound form's kept output array and its prepared call."""
import numpy as np
import pytest

from minigraph import handover
from minigraph.kernels.cpu import prepared


def test_the_output_is_kept_for_its_shape_and_dtype_and_made_anew_for_others():
    kept = {"out": None}
    first = prepared.output(kept, (2, 3), np.float32)
    assert first.shape == (2, 3) and first.dtype == np.float32 and kept["out"] is first
    assert prepared.output(kept, [2, 3], np.float32) is first
    other_shape = prepared.output(kept, (3, 2), np.float32)
    assert other_shape is not first and other_shape.shape == (3, 2)
    other_dtype = prepared.output(kept, (3, 2), np.float64)
    assert other_dtype is not other_shape and other_dtype.dtype == np.float64
    assert kept["out"] is other_dtype
    assert all(a.ctypes.data % 64 == 0 for a in (first, other_shape, other_dtype))


@pytest.mark.parametrize("shape, dtype", [((3, 5), np.float32), (7, np.float64),
                                          ((), np.int64), ((4, 3), np.int8)])
def test_aligned_empty_starts_a_cache_line_and_is_never_donated(shape, dtype):
    for _ in range(8):                  # malloc's 16-byte steps: some start off a line
        a = prepared.aligned_empty(shape, dtype)
        assert a.ctypes.data % 64 == 0
        assert a.shape == ((shape,) if isinstance(shape, int) else shape)
        assert a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        a[...] = 1                      # its whole memory is its own to write
        assert (a == 1).all()
        assert not handover._plain(a)   # a view of a larger array: no kernel writes into it
    empty = prepared.aligned_empty((2, 0, 4), np.float32)    # no memory to align
    assert empty.shape == (2, 0, 4) and empty.dtype == np.float32


def test_a_form_prepares_again_only_for_another_array():
    prepares = []

    def prepare(x):
        prepares.append(x)
        if x.dtype != np.float32:
            return None                              # the kernel runs instead
        out = np.empty_like(x)
        return (lambda: np.multiply(x, 2, out=out)), {"out": out}

    run = prepared.form(("x",), prepare)
    x = np.arange(3, dtype=np.float32)
    outs = run({"x": x})
    np.testing.assert_array_equal(outs["out"], [0, 2, 4])
    x[:] = 5                                          # new values, the same array
    assert run({"x": x}) is outs and list(outs["out"]) == [10, 10, 10]
    assert len(prepares) == 1
    assert run({"x": np.ones(3, np.float64)}) is None and len(prepares) == 2
    y = np.ones(3, np.float32)
    np.testing.assert_array_equal(run({"x": y})["out"], [2, 2, 2])
    assert len(prepares) == 3


def test_a_read_only_view_of_the_same_memory_runs_the_prepared_call_of_a_streamed_slot():
    """A batch fed again is a new read-only view every run: in a streamed slot the call
    prepared on the last one runs on it. Any other array prepares again: a writeable
    view of the same memory, a read-only view of other memory or of the same memory in
    another layout, and any new array in a slot not streamed."""
    prepares = []

    def prepare(x, w):
        prepares.append(x)
        out = np.empty(x.shape, x.dtype)
        return (lambda: np.multiply(x, w, out=out)), {"out": out}

    def read_only(a):
        view = a.view()
        view.flags.writeable = False
        return view

    run = prepared.form(("x", "w"), prepare, streamed=("x",))
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    w = read_only(np.full(3, 2, np.float32))
    outs = run({"x": read_only(base), "w": w})
    base[0, 0] = 7                                    # the caller's array, written
    assert run({"x": read_only(base), "w": w}) is outs and outs["out"][0, 0] == 14
    assert len(prepares) == 1
    np.testing.assert_array_equal(run({"x": base.view(), "w": w})["out"], base * 2)
    assert len(prepares) == 2                         # writeable: another array
    other = base.copy()
    np.testing.assert_array_equal(run({"x": read_only(other), "w": w})["out"], other * 2)
    transposed = read_only(base.reshape(3, 2).T)      # same address and shape, other strides
    np.testing.assert_array_equal(run({"x": transposed, "w": w})["out"], transposed * 2)
    assert len(prepares) == 4
    run({"x": transposed, "w": read_only(w)})         # w is not streamed
    assert len(prepares) == 5
    assert prepared.same_memory(None, None) and not prepared.same_memory(None, base)
    with pytest.raises(ValueError, match="streamed slots"):
        prepared.form(("x", "w"), prepare, lists=("w",), streamed=("x",))
