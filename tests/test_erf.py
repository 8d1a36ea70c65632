"""erf / erfc (Cody's rational approximations) against math.erf / math.erfc."""
import math

import numpy as np
import pytest

from minigraph.kernels.cpu.erf import erf, erfc, normal_cdf

GRID = np.concatenate([
    np.linspace(-30.0, 30.0, 120001),                      # every range, both signs
    np.linspace(0.46, 0.48, 2001), -np.linspace(0.46, 0.48, 2001),    # range boundaries
    np.linspace(3.99, 4.01, 2001), -np.linspace(3.99, 4.01, 2001),
    np.geomspace(1e-300, 1e-3, 500), -np.geomspace(1e-300, 1e-3, 500),   # around 0
    [0.0, -0.0, 0.46875, 4.0, 26.543, 5e-324, 1e300, -1e300],
])


def test_erf_matches_math_erf_to_1e15():
    want = np.array([math.erf(v) for v in GRID])
    got = erf(GRID)
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    assert erf(np.array([0.0]))[0] == 0.0 and math.copysign(1, erf(np.array([-0.0]))[0]) < 0


def test_erfc_matches_math_erfc_to_1e15_where_normal():
    want = np.array([math.erfc(v) for v in GRID])
    got = erfc(GRID)
    normal = want > 1e-300                 # Cody's erfc is 0 from 26.543 (subnormals)
    np.testing.assert_allclose(got[normal], want[normal], rtol=1.5e-15, atol=0)
    assert (got[~normal] <= 1e-300).all() and (got >= 0).all()


def test_infinities_nan_and_shape():
    x = np.array([[np.inf, -np.inf], [np.nan, 1.0]])
    e, c = erf(x), erfc(x)
    assert e.shape == c.shape == (2, 2)
    assert e[0].tolist() == [1.0, -1.0] and c[0].tolist() == [0.0, 2.0]
    assert np.isnan(e[1, 0]) and np.isnan(c[1, 0])


@pytest.mark.parametrize("x", [-37.0, -8.0, -1.0, 0.0, 0.5, 3.0, 9.0])
def test_normal_cdf(x):
    want = 0.5 * math.erfc(-x / math.sqrt(2.0))
    assert normal_cdf(np.array([x]))[0] == pytest.approx(want, rel=1e-14, abs=0)
