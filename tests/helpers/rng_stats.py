"""Statistical checks for random numbers (NumPy only: the CPU tier runs without torch or SciPy).

Each check compares samples with an exact distribution and fails with a false-failure probability
of about 1e-4 or less, so a suite of a few hundred checks stays green on correct generators while
a wrong mean, scale, rounding, category probability or a correlation fails. A check returns
``Result(statistic, threshold, passed)``; by default a failed check raises ``AssertionError`` with
the statistic, the threshold and where the samples disagree (``raise_on_fail=False`` returns it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

ALPHA = 1e-4  # false-failure probability of each check
Z_LIMIT = 4.5  # two-sided normal tail 6.8e-6


class Result(NamedTuple):
    statistic: float
    threshold: float
    passed: bool


def _finish(statistic: float, threshold: float, passed: bool, message: str, raise_on_fail: bool) -> Result:
    if not passed and raise_on_fail:
        raise AssertionError(message)
    return Result(float(statistic), float(threshold), bool(passed))


def _label(what: str) -> str:
    return f"{what}: " if what else ""


# ----------------------------------------------------------------- distributions (vectorised)


_erfc = np.frompyfunc(math.erfc, 1, 1)


def norm_sf(z) -> np.ndarray:
    """P(Z > z) for a standard normal Z, exact to double precision (``math.erfc``)."""
    z = np.asarray(z, dtype=np.float64)
    return np.asarray(_erfc(z / math.sqrt(2.0)), dtype=np.float64) * 0.5


def norm_isf(p: float) -> float:
    """The z with P(Z > z) = p (bisection on ``math.erfc``; p in (0, 1))."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"{p=} must be in (0, 1)")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * math.erfc(mid / math.sqrt(2.0)) > p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def chi2_isf(alpha: float, df: int) -> float:
    """The chi-square quantile exceeded with probability ``alpha`` (Wilson-Hilferty). At alpha =
    1e-4 it is on the high, conservative side: 7% above the exact quantile at df = 1, 3.5% at
    df = 3, 1% at df = 10, 0.1% at df = 100."""
    if df < 1:
        raise ValueError(f"{df=} must be >= 1")
    z = norm_isf(alpha)
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def kolmogorov_threshold(n: int, alpha: float = ALPHA) -> float:
    """The asymptotic Kolmogorov critical value of sqrt(n) * D at ``alpha``, divided by sqrt(n)."""
    return math.sqrt(-0.5 * math.log(alpha / 2.0)) / math.sqrt(n)


def uniform_cdf(lo: float = 0.0, hi: float = 1.0) -> Callable:
    return lambda x: np.clip((np.asarray(x, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)


def normal_cdf(mean: float = 0.0, std: float = 1.0) -> Callable:
    return lambda x: norm_sf(-(np.asarray(x, dtype=np.float64) - mean) / std)


def exponential_cdf(rate: float = 1.0) -> Callable:
    return lambda x: -np.expm1(-rate * np.maximum(np.asarray(x, dtype=np.float64), 0.0))


def log_normal_cdf(mean: float = 0.0, std: float = 1.0) -> Callable:
    def cdf(x):
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(divide="ignore"):
            return np.where(x > 0, normal_cdf(mean, std)(np.log(np.maximum(x, 1e-300))), 0.0)

    return cdf


def cauchy_cdf(median: float = 0.0, sigma: float = 1.0) -> Callable:
    return lambda x: 0.5 + np.arctan((np.asarray(x, dtype=np.float64) - median) / sigma) / math.pi


# ----------------------------------------------------------------- Kolmogorov-Smirnov


def _finite(samples, what: str) -> np.ndarray:
    x = np.asarray(samples).reshape(-1)
    if x.size == 0:
        raise ValueError(f"{_label(what)}no samples")
    if np.isnan(x.astype(np.float64)).any():
        raise AssertionError(f"{_label(what)}{int(np.isnan(x.astype(np.float64)).sum())} NaN sample(s)")
    return x


def ks_continuous(samples, cdf: Callable, *, what: str = "", raise_on_fail: bool = True) -> Result:
    """One-sample Kolmogorov-Smirnov test against the exact continuous ``cdf``.

    Ties (float32 samples repeat) make the test conservative, never looser."""
    x = np.sort(_finite(samples, what).astype(np.float64))
    n = x.size
    f = np.asarray(cdf(x), dtype=np.float64)
    i = np.arange(1, n + 1, dtype=np.float64)
    d_plus = i / n - f
    d_minus = f - (i - 1) / n
    k_plus, k_minus = int(np.argmax(d_plus)), int(np.argmax(d_minus))
    d = max(d_plus[k_plus], d_minus[k_minus])
    thr = kolmogorov_threshold(n)
    if d_plus[k_plus] >= d_minus[k_minus]:
        where = f"empirical CDF {i[k_plus] / n:.6f} > exact {f[k_plus]:.6f} at x={x[k_plus]:.7g}"
    else:
        where = f"empirical CDF {(i[k_minus] - 1) / n:.6f} < exact {f[k_minus]:.6f} just below x={x[k_minus]:.7g}"
    msg = f"{_label(what)}KS statistic D={d:.3g} >= {thr:.3g} (n={n}): {where}"
    return _finish(d, thr, d < thr, msg, raise_on_fail)


_DTYPES = {"float16": "float16", "f16": "float16", "half": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "").replace("numpy.", "")
    if name.startswith("<class"):
        name = np.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"{dtype=} must be float16 or bfloat16")
    return _DTYPES[name]


def _bits16(values: np.ndarray, dtype: str) -> np.ndarray:
    """The 16-bit patterns of ``values``, which must be exactly representable in ``dtype``."""
    if dtype == "float16":
        h = values.astype(np.float16)
        if not np.array_equal(h.astype(np.float64), values.astype(np.float64)):
            raise ValueError("samples are not exact float16 values")
        return h.view(np.uint16).astype(np.int64)
    f = values.astype(np.float32)
    if not np.array_equal(f.astype(np.float64), values.astype(np.float64)):
        raise ValueError("bfloat16 samples must be given as float32 (or wider) values")
    u = f.view(np.uint32)
    if (u & 0xFFFF).any():
        bad = f[(u & 0xFFFF) != 0][:3]
        raise ValueError(f"samples are not exact bfloat16 values (e.g. {bad})")
    return (u >> 16).astype(np.int64)


def _from_bits16(bits: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # NaN patterns, when every pattern is asked for
        if dtype == "float16":
            return bits.astype(np.uint16).view(np.float16).astype(np.float64)
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _step16(bits: np.ndarray, up: bool, dtype: str) -> np.ndarray:
    """The next representable value above (``up``) or below, in float64 (infinities included)."""
    mag = bits & 0x7FFF
    order = np.where(bits & 0x8000, -mag, mag)  # monotone in value; -0 and +0 both map to 0
    order = order + (1 if up else -1)
    nxt = np.where(order >= 0, order, 0x8000 | -order)
    return _from_bits16(nxt, dtype)


def rounding_bounds(values, dtype) -> tuple[np.ndarray, np.ndarray]:
    """For each exact ``dtype`` value v: the interval (lo, hi) of float32 inputs that
    round-to-nearest onto v (ties ignored: they have probability zero for a continuous source)."""
    dtype = _dtype_name(dtype)
    v = np.asarray(values).reshape(-1)
    bits = _bits16(v, dtype)
    v = v.astype(np.float64)
    up, down = _step16(bits, True, dtype), _step16(bits, False, dtype)
    with np.errstate(invalid="ignore"):
        hi = np.where(np.isinf(up) & np.isfinite(v), v + 0.5 * (v - down), 0.5 * (v + up))
        lo = np.where(np.isinf(down) & np.isfinite(v), v - 0.5 * (up - v), 0.5 * (v + down))
    hi = np.where(np.isposinf(v), np.inf, hi)
    lo = np.where(np.isneginf(v), -np.inf, lo)
    return lo, hi


def representable(dtype) -> np.ndarray:
    """Every finite value of float16 or bfloat16, ascending, as float64 (one zero)."""
    dtype = _dtype_name(dtype)
    v = _from_bits16(np.arange(1 << 16, dtype=np.int64), dtype)
    return np.unique(v[np.isfinite(v)])


def rounded_moments(cdf: Callable, dtype) -> tuple[float, float]:
    """Mean and variance of a continuous ``cdf`` rounded to nearest into ``dtype`` (exact sums
    over every representable value; mass beyond the largest finite value is left out)."""
    v = representable(dtype)
    vv = v.astype(np.float16) if _dtype_name(dtype) == "float16" else v.astype(np.float32)
    lo, hi = rounding_bounds(vv, dtype)
    p = np.asarray(cdf(hi), dtype=np.float64) - np.asarray(cdf(lo), dtype=np.float64)
    mean = float(np.dot(p, v) / p.sum())
    return mean, float(np.dot(p, (v - mean) ** 2) / p.sum())


def wrapped_uniform_cdf(lo: float, hi: float, dtype) -> Callable:
    """The CDF, over the continuous source, of a uniform [lo, hi) draw stored in ``dtype`` the way
    torch's ``uniform_`` stores it: round to nearest, and a value that rounds up to ``hi`` becomes
    ``lo`` (so ``lo`` carries the extra mass of the top half-ulp). For ``ks_discretised`` and
    ``rounded_moments``; evaluate it at rounding bounds, not at arbitrary points."""
    top = float(rounding_bounds(np.array([hi], dtype=np.float32 if _dtype_name(dtype) == "bfloat16"
                                         else np.float16), dtype)[0][0])
    extra = (hi - top) / (hi - lo)
    base = uniform_cdf(lo, hi)

    def cdf(x):
        x = np.asarray(x, dtype=np.float64)
        return np.where(x < lo, 0.0, np.where(x >= top, 1.0, base(x) + extra))

    return cdf


def ks_discretised(samples, cdf: Callable, dtype, *, what: str = "", raise_on_fail: bool = True) -> Result:
    """Kolmogorov-Smirnov test of float16/bfloat16 samples against the exact distribution of a
    continuous ``cdf`` rounded to nearest into ``dtype``: P(X <= v) = cdf(midpoint of v and the
    next value above v). bfloat16 samples come as float32 values (``t.float().numpy()``).

    The supremum is exact for a step distribution: at each distinct sample value, and just below
    it (where the exact CDF has risen through every representable value that was never drawn)."""
    dtype = _dtype_name(dtype)
    x = _finite(samples, what)
    n = x.size
    vals, counts = np.unique(x.astype(np.float64), return_counts=True)
    if dtype == "float16":
        vals16 = vals.astype(np.float16)
    else:
        vals16 = vals.astype(np.float32)
    lo, hi = rounding_bounds(vals16, dtype)
    emp = np.cumsum(counts) / n
    emp_before = np.concatenate([[0.0], emp[:-1]])
    d_plus = emp - np.asarray(cdf(hi), dtype=np.float64)  # at v: P(X <= v) = cdf(hi)
    d_minus = np.asarray(cdf(lo), dtype=np.float64) - emp_before  # just below v: P(X < v) = cdf(lo)
    k_plus, k_minus = int(np.argmax(np.abs(d_plus))), int(np.argmax(np.abs(d_minus)))
    dp, dm = abs(d_plus[k_plus]), abs(d_minus[k_minus])
    d = max(dp, dm)
    thr = kolmogorov_threshold(n)
    if dp >= dm:
        where = (f"P(X <= {vals[k_plus]:.6g}): empirical {emp[k_plus]:.6f}, exact {emp[k_plus] - d_plus[k_plus]:.6f}")
    else:
        where = (f"P(X < {vals[k_minus]:.6g}): empirical {emp_before[k_minus]:.6f}, "
                 f"exact {emp_before[k_minus] + d_minus[k_minus]:.6f}")
    msg = f"{_label(what)}{dtype} KS statistic D={d:.3g} >= {thr:.3g} (n={n}, {vals.size} distinct values): {where}"
    return _finish(d, thr, d < thr, msg, raise_on_fail)


# ----------------------------------------------------------------- counts and moments


def chi_square(counts, probs, *, ddof: int = 0, what: str = "", raise_on_fail: bool = True) -> Result:
    """Pearson's chi-square test of category ``counts`` against ``probs``, with
    ``len(cells) - 1 - ddof`` degrees of freedom (``ddof``: further constraints, e.g. the fixed
    totals of the other rows when the cells of several independent rows are tested together).

    Cells expected fewer than 5 times are pooled into one cell (which joins the smallest other
    cell if it is still under 5). A count in a cell of probability 0 fails outright."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ in shape")
    if (probs < 0).any() or probs.sum() <= 0:
        raise ValueError("probs must be non-negative with a positive sum")
    probs = probs / probs.sum()
    n = counts.sum()
    impossible = (probs == 0) & (counts > 0)
    if impossible.any():
        cells = np.flatnonzero(impossible)[:5].tolist()
        return _finish(math.inf, 0.0, False,
                       f"{_label(what)}{int(counts[impossible].sum())} draw(s) in cells of probability 0: {cells}",
                       raise_on_fail)
    keep = probs > 0
    counts, probs = counts[keep], probs[keep]
    expected = n * probs
    small = expected < 5
    obs_cells, exp_cells = list(counts[~small]), list(expected[~small])
    if small.any():
        po, pe = counts[small].sum(), expected[small].sum()
        if pe < 5 and exp_cells:
            j = int(np.argmin(exp_cells))
            po, pe = po + obs_cells.pop(j), pe + exp_cells.pop(j)
        obs_cells.append(po)
        exp_cells.append(pe)
    if len(obs_cells) < 2:
        raise ValueError(f"{_label(what)}fewer than 2 cells after pooling (n={n:.0f}): draw more samples")
    o, e = np.array(obs_cells), np.array(exp_cells)
    terms = (o - e) ** 2 / e
    stat = float(terms.sum())
    df = len(o) - 1 - ddof
    if df < 1:
        raise ValueError(f"{_label(what)}{len(o)} cells and {ddof=} leave no degree of freedom")
    thr = chi2_isf(ALPHA, df)
    worst = np.argsort(terms)[::-1][:3]
    where = ", ".join(f"observed {o[j]:.0f} expected {e[j]:.1f}" for j in worst)
    msg = f"{_label(what)}chi-square {stat:.1f} >= {thr:.1f} (df={df}, n={n:.0f}); largest terms: {where}"
    return _finish(stat, thr, stat < thr, msg, raise_on_fail)


def frequency_check(successes: int, trials: int, p: float, *, what: str = "", raise_on_fail: bool = True) -> Result:
    """A binomial z-test: ``successes`` of ``trials`` at probability ``p``, |z| < 4.5."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"{p=} must be in (0, 1)")
    z = (successes - trials * p) / math.sqrt(trials * p * (1.0 - p))
    msg = (f"{_label(what)}frequency {successes / trials:.6f} vs {p} "
           f"(n={trials}): z={z:.2f}, |z| >= {Z_LIMIT}")
    return _finish(abs(z), Z_LIMIT, abs(z) < Z_LIMIT, msg, raise_on_fail)


def mean_var_check(samples, mean: float, var: float, *, what: str = "", raise_on_fail: bool = True) -> Result:
    """z-tests of the sample mean and the sample variance against ``mean`` and ``var``.

    The variance's standard error uses the sample's 4th central moment:
    Var(s^2) = m4/n - var^2 (n-3)/(n(n-1)). Meant for continuous distributions (for a two-point
    one the variance is nearly determined by the mean: use ``frequency_check``)."""
    if var <= 0:
        raise ValueError(f"{var=} must be > 0")
    x = _finite(samples, what).astype(np.float64)
    n = x.size
    m = float(x.mean())
    z_mean = (m - mean) / math.sqrt(var / n)
    s2 = float(x.var(ddof=1))
    m4 = float(np.mean((x - m) ** 4))
    var_s2 = max(m4 / n - var * var * (n - 3) / (n * (n - 1)), 1e-3 * var * var / n)
    z_var = (s2 - var) / math.sqrt(var_s2)
    stat = max(abs(z_mean), abs(z_var))
    msg = (f"{_label(what)}mean {m:.6g} (expected {mean:.6g}, z={z_mean:.2f}), variance {s2:.6g} "
           f"(expected {var:.6g}, z={z_var:.2f}); n={n}, limit |z| < {Z_LIMIT}")
    return _finish(stat, Z_LIMIT, stat < Z_LIMIT, msg, raise_on_fail)


def corr_check(a, b, *, what: str = "", raise_on_fail: bool = True) -> Result:
    """Pearson correlation of paired samples: |r| < max(0.01, 4.5 / sqrt(n))."""
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"a {a.shape} and b {b.shape} differ in shape")
    n = a.size
    da, db = a - a.mean(), b - b.mean()
    den = math.sqrt(float(np.dot(da, da)) * float(np.dot(db, db)))
    if den == 0:
        raise AssertionError(f"{_label(what)}a constant sequence has no correlation (n={n})")
    r = float(np.dot(da, db)) / den
    thr = max(0.01, Z_LIMIT / math.sqrt(n))
    msg = f"{_label(what)}correlation r={r:.4g}, |r| >= {thr:.3g} (n={n})"
    return _finish(abs(r), thr, abs(r) < thr, msg, raise_on_fail)
