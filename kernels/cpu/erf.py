"""erf and erfc in vectorised numpy (numpy has neither), to ~1e-15 relative in float64.

W. J. Cody's rational Chebyshev approximations ("Rational Chebyshev
approximations for the error function", Math. Comp. 23 (1969) 631-637; the
SPECFUN routine CALERF) in three ranges of |x|: erf on [0, 0.46875], erfc on
(0.46875, 4] and erfc by its asymptotic form beyond 4. erfc(x) for x < 0 is
2 - erfc(-x), so neither function loses digits to cancellation where it is
small. Not an op module: it registers nothing.
"""
from __future__ import annotations

import numpy as np

THRESH = 0.46875
XSMALL = 1.11e-16
XBIG = 26.543            # erfc(x) underflows to 0 beyond this
SQRPI = 5.6418958354775628695e-1     # 1 / sqrt(pi)

A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
     3.20937758913846947e03, 1.85777706184603153e-1)
B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
     2.84423683343917062e03)
C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
     2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
     2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
     1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
     3.43936767414372164e03, 1.23033935480374942e03)
P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
     1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
     6.05183413124413191e-2, 2.33520497626869185e-3)


def _erf_small(x):
    """erf(x) for |x| <= THRESH."""
    ysq = np.where(np.abs(x) > XSMALL, x * x, 0.0)
    num, den = A[4] * ysq, ysq
    for i in range(3):
        num = (num + A[i]) * ysq
        den = (den + B[i]) * ysq
    return x * (num + A[3]) / (den + B[3])


def _times_gauss(y, r):
    """r * exp(-y^2), with y^2 split so the exponent keeps its digits."""
    ysq = np.trunc(16.0 * y) / 16.0
    return np.exp(-ysq * ysq) * np.exp(-(y - ysq) * (y + ysq)) * r


def _erfc_mid(y):
    """erfc(y) for THRESH < y <= 4."""
    num, den = C[8] * y, y
    for i in range(7):
        num = (num + C[i]) * y
        den = (den + D[i]) * y
    return _times_gauss(y, (num + C[7]) / (den + D[7]))


def _erfc_big(y):
    """erfc(y) for 4 < y < XBIG (asymptotic form)."""
    ysq = 1.0 / (y * y)
    num, den = P[5] * ysq, ysq
    for i in range(4):
        num = (num + P[i]) * ysq
        den = (den + Q[i]) * ysq
    r = ysq * (num + P[4]) / (den + Q[4])
    return _times_gauss(y, (SQRPI - r) / y)


def _erfc_abs(y):
    """erfc(y) for y > THRESH (0 from XBIG on; NaN stays NaN)."""
    out = np.zeros_like(y)
    mid = y <= 4.0
    big = (y > 4.0) & (y < XBIG)
    out[mid] = _erfc_mid(y[mid])
    out[big] = _erfc_big(y[big])
    out[np.isnan(y)] = np.nan
    return out


def erf(x):
    """erf(x), elementwise, as a float64 array of x's shape."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    y = np.abs(x)
    small = y <= THRESH
    out[small] = _erf_small(x[small])
    rest = ~small
    tail = 1.0 - _erfc_abs(y[rest])
    out[rest] = np.where(x[rest] < 0, -tail, tail)
    return out


def erfc(x):
    """erfc(x) = 1 - erf(x), elementwise, as a float64 array of x's shape; accurate
    relative to its value where that is small (large x)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    y = np.abs(x)
    small = y <= THRESH
    out[small] = 1.0 - _erf_small(x[small])
    rest = ~small
    tail = _erfc_abs(y[rest])
    out[rest] = np.where(x[rest] < 0, 2.0 - tail, tail)
    return out


def normal_cdf(x):
    """Phi(x) = P(N(0, 1) <= x) = erfc(-x / sqrt(2)) / 2, elementwise in float64."""
    return 0.5 * erfc(-np.asarray(x, dtype=np.float64) / np.sqrt(2.0))
