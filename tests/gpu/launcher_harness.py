"""What the launcher tests share (tests/gpu/test_*_launchers.py): the relative error
they compare with, its tolerance per dtype, and seeded generators. Where the
launchers run (the emulator, or a real GPU marked gpu) is conftest's `device`
fixture; the float64 references are in tests/references.py."""
from __future__ import annotations

import numpy as np

TOL = {np.float32: 1e-5, np.float64: 1e-12}


def rel_err(got, want, terms=None):
    """||got - want|| / ||want|| in float64 (||want|| 0: the absolute error); fails on a
    non-finite output where the reference is finite. Where `want` comes out of a
    cancellation (a - b with a close to b), pass the terms' magnitude, e.g.
    abs(a) + abs(b): the error is measured against ||terms|| instead. A GPU fuses
    a * b + c into one rounding (FMA), so its result differs from numpy's by a few
    ulps of the terms, which can be many ulps of a small result."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all() or not np.isfinite(want).all(), "non-finite output"
    scale = np.linalg.norm(np.asarray(want if terms is None else terms, np.float64).ravel())
    return np.linalg.norm((got - want).ravel()) / (scale if scale else 1.0)


def rng(seed=0):
    """A numpy Generator seeded with `seed`."""
    return np.random.default_rng(seed)
