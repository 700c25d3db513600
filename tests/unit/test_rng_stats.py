"""CPU tier: the statistical checks of tests/helpers/rng_stats.py pass on correct samples and fail
on wrong ones (a shifted mean, a wrong scale, a biased rounding, a biased category, correlated
pairs), so the GPU tier's random-number tests can fail. NumPy only, fixed seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import rng_stats as S

N = 1_000_000


def _gen(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _to_bf16_rn(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), returned as float32 values."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def _to_bf16_truncated(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 by dropping the low 16 bits: a rounding biased toward zero."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _uniform24(g: np.random.Generator, n: int) -> np.ndarray:
    """torch.rand's float32 uniforms: 24 random bits times 2^-24."""
    return (g.integers(0, 1 << 24, n).astype(np.float32) * np.float32(2.0 ** -24)).astype(np.float32)


# ----------------------------------------------------------------- thresholds


def test_thresholds_match_known_quantiles():
    assert S.norm_isf(1e-4) == pytest.approx(3.719016, abs=1e-5)
    assert S.norm_isf(0.5) == pytest.approx(0.0, abs=1e-12)
    # exact chi-square quantiles at 1e-4; Wilson-Hilferty lies just above them (conservative)
    for df, q, rel in ((1, 15.137, 0.08), (3, 21.108, 0.04), (10, 35.564, 0.012), (100, 161.319, 0.001)):
        assert q <= S.chi2_isf(1e-4, df) <= q * (1 + rel)
    # Kolmogorov: P(sqrt(n) D > 2.2253) ~ 1e-4
    assert S.kolmogorov_threshold(1) == pytest.approx(2.2253, abs=1e-3)
    assert S.kolmogorov_threshold(N) == pytest.approx(2.2253e-3, abs=1e-6)
    assert float(S.normal_cdf()(1.0)) == pytest.approx(0.8413447460685429, abs=1e-15)


# ----------------------------------------------------------------- KS, continuous


def test_ks_continuous_passes_on_correct_samples():
    g = _gen(1)
    S.ks_continuous(_uniform24(g, N), S.uniform_cdf(), what="uniform f32")
    S.ks_continuous(g.standard_normal(N), S.normal_cdf(), what="normal")
    S.ks_continuous(g.normal(1.5, 0.5, N).astype(np.float32), S.normal_cdf(1.5, 0.5))
    S.ks_continuous(g.exponential(1 / 2.0, N), S.exponential_cdf(2.0))
    S.ks_continuous(g.lognormal(0.5, 0.8, N), S.log_normal_cdf(0.5, 0.8))
    S.ks_continuous(g.standard_cauchy(N) * 2.0 + 1.0, S.cauchy_cdf(1.0, 2.0))
    s, thr, ok = S.ks_continuous(g.uniform(-2, 3, N), S.uniform_cdf(-2, 3))
    assert ok and 0 < s < thr


def test_ks_continuous_fails_on_shift_and_scale():
    g = _gen(2)
    with pytest.raises(AssertionError, match=r"KS statistic D=.* >= .*n=1000000"):
        S.ks_continuous(g.standard_normal(N) + 0.01, S.normal_cdf(), what="shifted")
    with pytest.raises(AssertionError, match="scaled"):
        S.ks_continuous(g.standard_normal(N) * 1.02, S.normal_cdf(), what="scaled")
    with pytest.raises(AssertionError):
        S.ks_continuous(g.exponential(1 / 2.1, N), S.exponential_cdf(2.0))
    r = S.ks_continuous(g.uniform(0, 1.005, N), S.uniform_cdf(), raise_on_fail=False)
    assert not r.passed and r.statistic > r.threshold


def test_ks_continuous_reports_nan():
    with pytest.raises(AssertionError, match="NaN"):
        S.ks_continuous(np.array([0.1, np.nan, 0.2]), S.uniform_cdf())


# ----------------------------------------------------------------- KS, 16-bit


def test_rounding_bounds_by_bits():
    v = np.array([1.0, -1.0, 0.0, 2.0 ** -24, 65504.0], dtype=np.float16)
    lo, hi = S.rounding_bounds(v, np.float16)
    assert hi[0] == 1.0 + 2.0 ** -11 and lo[0] == 1.0 - 2.0 ** -12  # ulp 2^-10 above 1, 2^-11 below
    assert hi[1] == -1.0 + 2.0 ** -12 and lo[1] == -1.0 - 2.0 ** -11
    assert lo[2] == -(2.0 ** -25) and hi[2] == 2.0 ** -25  # around zero: half the smallest subnormal
    assert lo[3] == 2.0 ** -25 and hi[3] == 3 * 2.0 ** -25
    assert hi[4] == 65504.0 + 16.0  # above the largest finite value: half an ulp (32)
    b = np.array([1.0, -3.0, 0.0], dtype=np.float32)
    lo, hi = S.rounding_bounds(b, "bfloat16")
    assert hi[0] == 1.0 + 2.0 ** -8 and lo[0] == 1.0 - 2.0 ** -9
    assert hi[1] == -3.0 + 2.0 ** -7 and lo[1] == -3.0 - 2.0 ** -7
    assert hi[2] == 2.0 ** -134  # half the smallest bfloat16 subnormal (2^-133)
    with pytest.raises(ValueError, match="bfloat16"):
        S.rounding_bounds(np.array([1.0 + 2.0 ** -20], dtype=np.float32), "bfloat16")


def test_ks_discretised_passes_on_round_to_nearest():
    g = _gen(3)
    x = g.standard_normal(N).astype(np.float32)
    S.ks_discretised(x.astype(np.float16), S.normal_cdf(), np.float16, what="normal f16")
    S.ks_discretised(_to_bf16_rn(x), S.normal_cdf(), "bfloat16", what="normal bf16")
    e = (g.exponential(0.5, N)).astype(np.float32)
    S.ks_discretised(_to_bf16_rn(e), S.exponential_cdf(2.0), "bf16")
    u = _uniform24(g, 4 * N)
    s, thr, ok = S.ks_discretised(_to_bf16_rn(u[u < 1.0 - 2.0 ** -9]), S.uniform_cdf(0, 1.0 - 2.0 ** -9), "bf16")
    assert ok and s < thr


def test_ks_discretised_catches_biased_rounding():
    g = _gen(4)
    u = _uniform24(g, 4 * N)
    u = u[u < 1.0 - 2.0 ** -9]  # the values that round below 1.0
    cdf = S.uniform_cdf(0, 1.0 - 2.0 ** -9)
    S.ks_discretised(_to_bf16_rn(u), cdf, "bfloat16")
    with pytest.raises(AssertionError, match="bfloat16 KS statistic"):
        S.ks_discretised(_to_bf16_truncated(u), cdf, "bfloat16", what="truncated")


def test_ks_continuous_is_wrong_for_16_bit_samples():
    """Why the discretised test exists: correctly rounded samples fail the continuous test."""
    u = _uniform24(_gen(5), 4 * N)
    x = _to_bf16_rn(u[u < 1.0 - 2.0 ** -9])
    cdf = S.uniform_cdf(0, 1.0 - 2.0 ** -9)
    assert not S.ks_continuous(x, cdf, raise_on_fail=False).passed
    S.ks_discretised(x, cdf, "bfloat16")


def test_ks_discretised_fails_on_shift():
    x = (_gen(6).standard_normal(N) + 0.01).astype(np.float16)
    with pytest.raises(AssertionError, match="float16 KS"):
        S.ks_discretised(x, S.normal_cdf(), "float16")


# ----------------------------------------------------------------- chi-square and frequencies


def test_chi_square_passes_and_fails():
    g = _gen(7)
    p = np.array([0.1, 0.2, 0.3, 0.4])
    s, thr, ok = S.chi_square(np.bincount(g.choice(4, N, p=p), minlength=4), p)
    assert ok and s < thr
    biased = np.bincount(g.choice(4, N, p=[0.1, 0.2, 0.31, 0.39]), minlength=4)
    with pytest.raises(AssertionError, match=r"chi-square .* \(df=3"):
        S.chi_square(biased, p, what="biased")
    # uniform integers, one value short
    counts = np.bincount(g.integers(-5, 6, N) + 5, minlength=12)
    with pytest.raises(AssertionError, match="probability 0|chi-square"):
        S.chi_square(counts, np.ones(12))
    assert S.chi_square(counts[:11], np.ones(11)).passed


def test_chi_square_pools_small_cells():
    g = _gen(8)
    p = np.concatenate([np.full(10, 0.09), np.full(1000, 0.1 / 1000)])  # 1000 cells expected 2 each
    n = 20_000
    counts = np.bincount(g.choice(p.size, n, p=p), minlength=p.size)
    _, thr, ok = S.chi_square(counts, p)
    assert ok and thr == pytest.approx(S.chi2_isf(S.ALPHA, 10))  # 10 large cells + 1 pooled
    # the pooled tail drawn twice as often fails
    q = p.copy()
    q[10:] *= 2
    counts = np.bincount(g.choice(p.size, n, p=q / q.sum()), minlength=p.size)
    assert not S.chi_square(counts, p, raise_on_fail=False).passed


def test_chi_square_rows_with_ddof():
    """Independent rows, each with its own probabilities and a fixed total: all cells tested
    together with ddof = rows - 1 (the statistic is a sum of per-row chi-squares)."""
    g = _gen(14)
    rows, cats, per_row = 400, 6, 300
    w = g.random((rows, cats)) + 0.2
    p = w / w.sum(1, keepdims=True)
    counts = np.stack([np.bincount(g.choice(cats, per_row, p=r), minlength=cats) for r in p])
    _, thr, ok = S.chi_square(counts.ravel(), p.ravel(), ddof=rows - 1)
    assert ok and thr == pytest.approx(S.chi2_isf(S.ALPHA, rows * (cats - 1)))
    # every row drawn with row 0's probabilities
    wrong = np.stack([np.bincount(g.choice(cats, per_row, p=p[0]), minlength=cats) for _ in p])
    assert not S.chi_square(wrong.ravel(), p.ravel(), ddof=rows - 1, raise_on_fail=False).passed
    with pytest.raises(ValueError, match="degree of freedom"):
        S.chi_square([10, 10], [0.5, 0.5], ddof=1)


def test_chi_square_rejects_impossible_draws():
    with pytest.raises(AssertionError, match="probability 0"):
        S.chi_square([10, 10, 1], [0.5, 0.5, 0.0])
    assert S.chi_square([5000, 5000, 0], [0.5, 0.5, 0.0]).passed


def test_frequency_check():
    g = _gen(9)
    S.frequency_check(int((g.random(N) < 0.3).sum()), N, 0.3)
    with pytest.raises(AssertionError, match="z="):
        S.frequency_check(int((g.random(N) < 0.303).sum()), N, 0.3)


# ----------------------------------------------------------------- moments and correlation


def test_mean_var_check():
    g = _gen(10)
    S.mean_var_check(g.standard_normal(N), 0.0, 1.0)
    S.mean_var_check(g.uniform(-2, 3, N), 0.5, 25 / 12)
    S.mean_var_check(g.exponential(0.5, N), 0.5, 0.25)
    with pytest.raises(AssertionError, match=r"mean .*z="):
        S.mean_var_check(g.standard_normal(N) + 0.01, 0.0, 1.0, what="shifted")
    r = S.mean_var_check(g.standard_normal(N) * 1.01, 0.0, 1.0, raise_on_fail=False)
    assert not r.passed and r.statistic > 10


def test_corr_check():
    g = _gen(11)
    a, b = g.random(N), g.random(N)
    _, thr, ok = S.corr_check(a, b)
    assert ok and thr == 0.01
    assert S.corr_check(a[:-1], a[1:]).passed  # neighbours of an independent sequence
    with pytest.raises(AssertionError, match="correlation"):
        S.corr_check(a, a + 5 * b)  # r ~ 0.2
    with pytest.raises(AssertionError, match="correlation"):
        S.corr_check(a, 0.98 * b + 0.02 * a)  # r ~ 0.02
    assert S.corr_check(a[:1000], b[:1000]).threshold == pytest.approx(4.5 / math.sqrt(1000))


def test_no_false_failures_over_many_seeds():
    """With false-failure probability ~1e-4 per check, 200 seeds x 5 checks should all pass."""
    p = np.array([0.05, 0.15, 0.3, 0.5])
    for seed in range(200):
        g = _gen(1000 + seed)
        x = g.standard_normal(4000)
        assert S.ks_continuous(x, S.normal_cdf(), raise_on_fail=False).passed, seed
        assert S.ks_discretised(x.astype(np.float16), S.normal_cdf(), "float16", raise_on_fail=False).passed, seed
        assert S.mean_var_check(x, 0.0, 1.0, raise_on_fail=False).passed, seed
        assert S.chi_square(np.bincount(g.choice(4, 4000, p=p), minlength=4), p, raise_on_fail=False).passed, seed
        assert S.corr_check(x[:-1], x[1:], raise_on_fail=False).passed, seed


# ----------------------------------------------------------------- exact distributions of 16-bit draws


def test_representable_and_rounded_moments():
    f16 = S.representable(np.float16)
    assert f16.size == 65536 - 2046 - 2 - 1  # minus the NaNs, the two infinities and -0
    assert f16[0] == -65504.0 and f16[-1] == 65504.0 and np.all(np.diff(f16) > 0)
    assert S.representable("bf16")[-1] == float(np.float32(3.3895314e38))
    for dt in ("float16", "bfloat16"):
        m, v = S.rounded_moments(S.normal_cdf(1.5, 0.5), dt)
        assert m == pytest.approx(1.5, abs=1e-4) and v == pytest.approx(0.25, rel=1e-3)
        m, v = S.rounded_moments(S.uniform_cdf(-2, 3), dt)
        assert m == pytest.approx(0.5, abs=1e-3) and v == pytest.approx(25 / 12, rel=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wrapped_uniform_matches_a_simulated_torch_rand(dtype):
    """u = 24 random bits * 2^-24, rounded to nearest into the dtype, 1.0 replaced by 0.0: what
    torch.rand(dtype=...) and cgraw's kernel draw. The wrapped CDF and its moments fit; the plain
    uniform CDF does not (bfloat16 moves 2^-9 of the mass from 1 to 0)."""
    u = _uniform24(_gen(12), N)
    x = u.astype(np.float16) if dtype == "float16" else _to_bf16_rn(u)
    x = np.where(x.astype(np.float64) >= 1.0, 0.0, x).astype(x.dtype)
    cdf = S.wrapped_uniform_cdf(0.0, 1.0, dtype)
    S.ks_discretised(x, cdf, dtype)
    S.mean_var_check(x, *S.rounded_moments(cdf, dtype))
    if dtype == "bfloat16":
        assert not S.mean_var_check(x, 0.5, 1 / 12, raise_on_fail=False).passed
        assert not S.ks_discretised(x, S.uniform_cdf(), dtype, raise_on_fail=False).passed
    y = np.where(_gen(13).random(N) < 0.01, 0.0, x).astype(x.dtype)  # 1% too many zeros
    assert not S.ks_discretised(y, cdf, dtype, raise_on_fail=False).passed
