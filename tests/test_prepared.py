"""kernels/cpu/prepared.py: a bound form's kept output array and its prepared call."""
import numpy as np

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
