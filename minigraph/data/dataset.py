"""ArrayDataset: named arrays of one length, indexed by rows.

A dataset, for `DataLoader`, is any object with `len(ds)` (its rows) and
`ds[indices]` (an int64 index array) returning {name: array with those
rows}; `ArrayDataset` is that over arrays held in memory.
"""
from __future__ import annotations

import numpy as np


class ArrayDataset:
    """Named arrays with one length: `ArrayDataset(image=x, label=y)`.

    Every array needs at least one axis and the same number of rows (its first
    axis); at least one array is needed. The arrays are held, not copied.
    `ds[indices]` returns {name: array[indices]} in the order given; `len(ds)`
    is the rows; `ds.arrays` the arrays by name (a copy of the dict).
    """

    def __init__(self, **arrays):
        if not arrays:
            raise ValueError("ArrayDataset: expected at least one named array, e.g. "
                             "ArrayDataset(image=x, label=y)")
        held = {}
        for name, value in arrays.items():
            array = np.asarray(value)
            if array.ndim == 0:
                raise ValueError(f"ArrayDataset: array {name!r} is a scalar; expected an array "
                                 "whose first axis is the rows")
            if array.dtype == object:
                raise ValueError(f"ArrayDataset: array {name!r} has dtype object; expected "
                                 "numbers or booleans")
            held[name] = array
        lengths = {name: len(a) for name, a in held.items()}
        if len(set(lengths.values())) > 1:
            each = ", ".join(f"{name!r} {n}" for name, n in lengths.items())
            raise ValueError(f"ArrayDataset: every array needs the same number of rows, got "
                             f"{each}")
        self._arrays = held
        self._len = next(iter(lengths.values()))

    def __len__(self):
        return self._len

    def __getitem__(self, indices):
        return {name: array[indices] for name, array in self._arrays.items()}

    @property
    def names(self):
        """The arrays' names, in the order given."""
        return tuple(self._arrays)

    @property
    def arrays(self):
        """{name: array}: the arrays themselves (a new dict; the arrays are not copied)."""
        return dict(self._arrays)

    def __repr__(self):
        shapes = ", ".join(f"{n}={a.dtype}{list(a.shape)}" for n, a in self._arrays.items())
        return f"ArrayDataset({shapes})"
