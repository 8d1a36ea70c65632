"""minigraph.data.ArrayDataset: named arrays of one length."""
from __future__ import annotations

import numpy as np
import pytest

from minigraph import data


def test_rows_by_index_arrays_in_the_order_given():
    x, y = np.arange(20.0).reshape(5, 2, 2), np.arange(5) * 10
    ds = data.ArrayDataset(image=x, label=y)
    assert len(ds) == 5 and ds.names == ("image", "label")
    got = ds[np.array([3, 0, 3])]
    np.testing.assert_array_equal(got["image"], x[[3, 0, 3]])
    np.testing.assert_array_equal(got["label"], [30, 0, 30])
    assert ds.arrays["image"] is x and ds.arrays is not ds.arrays
    assert ds[np.array([], dtype=np.int64)]["image"].shape == (0, 2, 2)
    assert "image=float64[5, 2, 2]" in repr(ds)
    assert len(data.ArrayDataset(v=[1, 2, 3])) == 3                 # array-likes


@pytest.mark.parametrize("arrays, message", [
    ({}, "expected at least one named array"),
    ({"image": np.zeros((3, 2)), "label": np.zeros(4)}, "every array needs the same number of rows, got 'image' 3, "
                                                         "'label' 4"),
    ({"x": np.float32(1.0)}, "array 'x' is a scalar"),
    ({"x": np.array([None, 1])}, "array 'x' has dtype object"),
])
def test_bad_arrays(arrays, message):
    with pytest.raises(ValueError, match=f"ArrayDataset: {message}"):
        data.ArrayDataset(**arrays)
