"""GPU tier for graph-safe random numbers: torch and CuPy random ops captured by
``cgraw.capture()`` or ``@cgraw.graphed`` draw fresh numbers on every replay.

Checked against exact references: torch.rand bitwise against ``cgraw.rng.reference``'s NumPy Philox at the
key torch's generator state gives; every distribution against its exact law (Kolmogorov-Smirnov,
discretised for 16-bit dtypes; chi-square; z-tests of frequencies, means and variances;
tests/helpers/rng_stats.py, which the CPU tier shows can fail); seeding and the frameworks' own
generators (tests/gpu/test_rng_seed.py has the rest), and uncovered ops against eager behaviour;
dropout training of a transformers GPT-2 against eager training; Llama sampling against the eager
softmax. Each statistical check has a false-failure probability of about 1e-4.
"""

from __future__ import annotations

import copy
import math
import sys

import numpy as np
import pytest
import rng_stats as S
from gpu_data import trand

import cgraw
import cgraw.rng.plan
import cgraw.rng.reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")
F = torch.nn.functional

N = 1 << 20  # samples per statistical case


# ---------------------------------------------------------------- helpers


def _host(a) -> np.ndarray:
    """A torch tensor or CuPy array as NumPy (bfloat16 as float32 values, which are exact)."""
    if isinstance(a, torch.Tensor):
        return (a.float() if a.dtype == torch.bfloat16 else a).cpu().numpy()
    return sys.modules["cupy"].asnumpy(a)


def _replayed(make, replays: int = 2):
    """Capture ``make()``, replay it ``replays`` times; return the graph and, per replay, host
    copies of the output (or of each output of a tuple)."""
    with cgraw.capture() as g:
        out = make()
    got = []
    for _ in range(replays):
        g.replay()
        got.append(tuple(_host(o) for o in out) if isinstance(out, tuple) else _host(out))
    return g, got


def _last_replay(make):
    """The output of a second replay (the first one draws at offset 0, the second beyond it)."""
    return _replayed(make, 2)[1][-1]


def _stats(f):
    from cgraw.trees.graphed import _managers

    return _managers[0].stats[f.fn_id]


def _assert_recorded_once(f, replays: int):
    """``f`` recorded once, replayed at least ``replays`` times, never ran eagerly after warm-up."""
    st = _stats(f)
    text = cgraw.report()
    assert not st.skip_reasons, f"{f.name} ran eagerly: {st.skip_reasons}\n{text}"
    assert st.recordings == 1 and st.rerecords == 0 and st.eager_calls == 0 and st.replays >= replays, (
        f"{f.name}: {st.warmups} warm-up(s), {st.recordings} recording(s), {st.rerecords} re-record(s), "
        f"{st.replays} replay(s), {st.eager_calls} eager call(s)\n{text}")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{f.name}:"))
    for part in (": 1 recording(s)", f", {st.replays} replay(s)", ", 0 eager call(s)"):
        assert part in line, (part, line)
    assert "skipped" not in text, text
    node = next(ln for ln in text.splitlines() if ln.strip().startswith(f"node {f.name} "))
    assert "random draw(s) per replay" in node, node  # the recording draws its own numbers
    return st


def _cuda(*shape, dtype=None):
    return torch.empty(*shape, device="cuda", dtype=dtype or torch.float32)


def _continuous(cdf, mean=None, var=None):
    def check(x, what):
        S.ks_continuous(x, cdf, what=what)
        if mean is not None:
            S.mean_var_check(x, mean, var, what=what)
    return check


def _rounded(cdf, dtype):
    """KS against the exact law of ``cdf`` rounded into a 16-bit dtype, and its exact moments."""
    def check(x, what):
        S.ks_discretised(x, cdf, dtype, what=what)
        S.mean_var_check(x, *S.rounded_moments(cdf, dtype), what=what)
    return check


# ---------------------------------------------------------------- bitwise, offsets, keys


def test_rand_bitwise_against_reference_and_offsets():
    n = 1_000_003  # not a multiple of 4: the last Philox group is partial
    with cgraw.capture() as g:
        y = torch.rand(n, device="cuda")
        z = torch.rand(n, device="cuda")
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert g.rng is not None and g.rng.draws == 2, g.rng
    gen = torch.cuda.default_generators[0]
    torch.cuda.manual_seed(77)
    prev = None
    for r in range(3):
        offset = gen.get_offset()
        assert offset == 8 * r  # each replay moves torch's offset by 4 per draw
        g.replay()
        key = cgraw.rng.plan.replay_key(cgraw.rng.plan.torch_base(77), offset)
        got_y, got_z = _host(y), _host(z)
        for k, got in enumerate((got_y, got_z)):
            ref = cgraw.rng.reference.reference_uniform_f32(key, k, n)
            mism = np.flatnonzero(got.view(np.uint32) != ref.view(np.uint32))
            assert mism.size == 0, (f"replay {r}, draw {k}: {mism.size} of {n} differ from the reference, first "
                                    f"at {mism[:5].tolist()}: {got[mism[:5]]} vs {ref[mism[:5]]}")
        assert not np.array_equal(got_y, got_z)
        if prev is not None:
            assert not np.array_equal(prev, got_y), f"replay {r} repeated replay {r - 1}"
        prev = got_y
    words = cgraw.rng.reference.reference_words(key, 0, 4)
    assert words.shape == (4, 4) and words.dtype == np.uint32


def test_graphs_draw_apart_and_plain_graph_has_no_rng():
    x = trand(1000)
    with cgraw.capture() as plain:
        y = x * 2.0
    assert plain.rng is None
    plain.replay()
    torch.testing.assert_close(y, x * 2.0)
    with cgraw.capture() as g1:
        a = torch.rand(1000, device="cuda")
    with cgraw.capture() as g2:
        b = torch.rand(1000, device="cuda")
    assert g1.rng.sources == g2.rng.sources  # one generator: torch's of device 0
    g1.replay()
    g2.replay()
    assert not torch.equal(a, b)


# ---------------------------------------------------------------- seeding


def _seeded_run(seed: int) -> list[np.ndarray]:
    torch.manual_seed(seed)
    x = torch.ones(50_000, device="cuda")
    with cgraw.capture() as g1:
        u = torch.rand(10_001, device="cuda")
        z = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    with cgraw.capture() as g2:
        i = torch.randint(0, 100, (999,), device="cuda")
        d = F.dropout(x, 0.5, training=True)
    outs = []
    for _ in range(2):
        for g, ts in ((g1, (u, z)), (g2, (i, d))):
            g.replay()
            outs.extend(_host(t) for t in ts)
    return outs


def _assert_same(a: list, b: list, equal: bool):
    same = [np.array_equal(p, q) for p, q in zip(a, b, strict=True)]
    assert all(same) if equal else not any(same), same


def test_torch_manual_seed_reproduces_captures():
    first = _seeded_run(123)
    with cgraw.capture() as other:  # an unrelated graph with random numbers in between
        torch.rand(10, device="cuda")
    other.replay()
    _assert_same(first, _seeded_run(123), equal=True)
    _assert_same(first, _seeded_run(124), equal=False)
    # the two replays of each graph differ from each other
    assert not np.array_equal(first[0], first[4]) and not np.array_equal(first[2], first[6])


def test_torch_generator_moves_with_replays_not_captures():
    torch.cuda.manual_seed(1)
    a = torch.rand(5, device="cuda")
    b_n = torch.randn(5, device="cuda")
    torch.cuda.manual_seed(1)
    with cgraw.capture() as g:
        y = torch.rand(5, device="cuda")
        F.dropout(torch.ones(100, device="cuda"), 0.3, training=True)
    b = torch.rand(5, device="cuda")
    assert torch.equal(a, b), (a, b)  # capturing draws nothing from torch's generator
    assert torch.equal(b_n, torch.randn(5, device="cuda"))
    torch.cuda.manual_seed(1)
    g.replay()
    g.replay()
    assert torch.cuda.default_generators[0].get_offset() == 16  # two replays of two draws
    assert not torch.equal(torch.rand(5, device="cuda"), a)  # eager draws start past them
    assert not torch.equal(y, a)


def test_cupy_generator_moves_with_replays_not_captures(cupy_mod):
    cp = cupy_mod
    cp.random.seed(5)
    a = cp.random.random(7)
    a_n = cp.random.standard_normal(7)
    cp.random.seed(5)
    with cgraw.capture() as g:
        y = cp.random.random(7)
    rs = cp.random.get_random_state()
    assert rs._rk_seed == 5  # capturing draws nothing from CuPy's generator
    g.replay()
    g.replay()
    assert rs._rk_seed == 5 + 2 * 7  # each replay: the elements it draws, as CuPy's kernels
    b = cp.random.random(7)  # cuRAND's own offset: untouched by the replays
    cp.testing.assert_array_equal(a, b)
    cp.testing.assert_array_equal(a_n, cp.random.standard_normal(7))
    assert not cp.array_equal(y, a)


# ---------------------------------------------------------------- torch distributions

_BF16, _F16 = torch.bfloat16, torch.float16

TORCH_CONTINUOUS = {
    # name: (make(n), check(samples, what))
    "rand_f32": (lambda n: torch.rand(n, device="cuda"), _continuous(S.uniform_cdf(), 0.5, 1 / 12)),
    "rand_f64": (lambda n: torch.rand(n, device="cuda", dtype=torch.float64),
                 _continuous(S.uniform_cdf(), 0.5, 1 / 12)),
    "rand_bf16": (lambda n: torch.rand(n, device="cuda", dtype=_BF16),
                  _rounded(S.wrapped_uniform_cdf(0.0, 1.0, "bfloat16"), "bfloat16")),
    "rand_f16": (lambda n: torch.rand(n, device="cuda", dtype=_F16),
                 _rounded(S.wrapped_uniform_cdf(0.0, 1.0, "float16"), "float16")),
    "randn_f32": (lambda n: torch.randn(n, device="cuda"), _continuous(S.normal_cdf(), 0.0, 1.0)),
    "randn_f64": (lambda n: torch.randn(n, device="cuda", dtype=torch.float64),
                  _continuous(S.normal_cdf(), 0.0, 1.0)),
    "randn_bf16": (lambda n: torch.randn(n, device="cuda", dtype=_BF16), _rounded(S.normal_cdf(), "bfloat16")),
    "randn_f16": (lambda n: torch.randn(n, device="cuda", dtype=_F16), _rounded(S.normal_cdf(), "float16")),
    "uniform_-2_3": (lambda n: _cuda(n).uniform_(-2, 3), _continuous(S.uniform_cdf(-2, 3), 0.5, 25 / 12)),
    "normal_1.5_0.5": (lambda n: _cuda(n).normal_(1.5, 0.5), _continuous(S.normal_cdf(1.5, 0.5), 1.5, 0.25)),
    "normal_bf16": (lambda n: _cuda(n, dtype=_BF16).normal_(1.5, 0.5), _rounded(S.normal_cdf(1.5, 0.5), "bf16")),
    "exponential_2": (lambda n: _cuda(n).exponential_(2.0), _continuous(S.exponential_cdf(2.0), 0.5, 0.25)),
    "exponential_bf16": (lambda n: _cuda(n, dtype=_BF16).exponential_(2.0),
                         _rounded(S.exponential_cdf(2.0), "bf16")),
    "log_normal_0_0.5": (lambda n: _cuda(n).log_normal_(0.0, 0.5),
                         _continuous(S.log_normal_cdf(0.0, 0.5), math.exp(0.125),
                                     (math.exp(0.25) - 1) * math.exp(0.25))),
    "cauchy_1_2": (lambda n: _cuda(n).cauchy_(1.0, 2.0), _continuous(S.cauchy_cdf(1.0, 2.0))),
    "rand_like_f16": (lambda n: torch.rand_like(torch.zeros(n, device="cuda", dtype=_F16)),
                      _rounded(S.wrapped_uniform_cdf(0.0, 1.0, "float16"), "float16")),
    "randn_like_f32": (lambda n: torch.randn_like(torch.zeros(n, device="cuda")),
                       _continuous(S.normal_cdf(), 0.0, 1.0)),
}


@pytest.mark.parametrize("name", list(TORCH_CONTINUOUS))
def test_torch_continuous_distribution(name):
    make, check = TORCH_CONTINUOUS[name]
    x = _last_replay(lambda: make(N))
    assert x.shape == (N,) and np.isfinite(x.astype(np.float64)).all()
    check(x, name)


def test_torch_uniform_range():
    _, got = _replayed(lambda: (_cuda(N).uniform_(-2, 3), torch.rand(N, device="cuda", dtype=_BF16)), 3)
    for u, b in got:
        assert u.min() >= -2.0 and u.max() < 3.0
        assert b.min() >= 0.0 and b.max() < 1.0


def test_torch_geometric():
    p = 0.3
    x = _last_replay(lambda: _cuda(N).geometric_(p))
    assert (x == np.round(x)).all() and x.min() >= 0
    # ceil(log(u) / log1p(-p)) with u in (0, 1] on a 2^-24 grid (as torch): u == 1 gives 0 (p 2^-24)
    top = 40
    k = np.arange(1, top + 1)
    probs = np.concatenate([[2.0 ** -24], (1 - p) ** (k - 1) * p, [(1 - p) ** top]])
    counts = np.bincount(np.minimum(x.astype(np.int64), top + 1), minlength=top + 2)
    S.chi_square(counts, probs, what="geometric_(0.3)")


def test_torch_bernoulli_scalar_p():
    x = _last_replay(lambda: _cuda(N).bernoulli_(0.3))
    assert set(np.unique(x).tolist()) <= {0.0, 1.0}
    S.frequency_check(int(x.sum()), N, 0.3, what="bernoulli_(0.3)")
    y = _last_replay(lambda: torch.bernoulli(torch.full((N,), 0.7, device="cuda")))
    S.frequency_check(int(y.sum()), N, 0.7, what="bernoulli(0.7 tensor)")


def test_torch_bernoulli_tensor_p():
    """Per-element probabilities: a period-4 pattern (one Philox group) and random p in bins."""
    pattern = torch.tensor([0.05, 0.5, 0.95, 0.2], device="cuda")
    p_per = pattern.repeat(N // 4)
    p_rand = torch.rand(N, device="cuda")  # eager, fixed before the capture
    got_per, got_rand = _last_replay(lambda: (torch.bernoulli(p_per), torch.bernoulli(p_rand)))
    assert set(np.unique(got_per).tolist()) <= {0.0, 1.0}
    for j, pj in enumerate(pattern.tolist()):
        S.frequency_check(int(got_per[j::4].sum()), N // 4, pj, what=f"bernoulli, p[{j}::4]={pj}")
    p = _host(p_rand).astype(np.float64)
    for b in range(10):
        sel = (p >= b / 10) & (p < (b + 1) / 10)
        z = (got_rand[sel].sum() - p[sel].sum()) / math.sqrt((p[sel] * (1 - p[sel])).sum())
        assert abs(z) < S.Z_LIMIT, f"bernoulli(p), p in [{b / 10}, {(b + 1) / 10}): z={z:.2f}"


def test_torch_randint_and_random_():
    lo, hi = -5, 7
    a, b, c = _last_replay(lambda: (torch.randint(lo, hi, (N,), device="cuda"),
                                    _cuda(N, dtype=torch.int32).random_(0, 10),
                                    torch.randint_like(torch.zeros(N, device="cuda", dtype=torch.int32), 3, 9)))
    assert a.dtype == np.int64 and b.dtype == np.int32 and c.dtype == np.int32
    assert a.min() == lo and a.max() == hi - 1, (a.min(), a.max())
    S.chi_square(np.bincount(a - lo, minlength=hi - lo), np.ones(hi - lo), what="randint(-5, 7)")
    assert b.min() == 0 and b.max() == 9
    S.chi_square(np.bincount(b, minlength=10), np.ones(10), what="random_(0, 10) int32")
    assert c.min() == 3 and c.max() == 8
    S.chi_square(np.bincount(c - 3, minlength=6), np.ones(6), what="randint_like(3, 9)")


def test_torch_dropout_keep_fraction_and_scale():
    p = 0.1
    ones = torch.ones(N, device="cuda")
    eager = _host(F.dropout(ones, p, training=True))
    x = _last_replay(lambda: F.dropout(ones, p, training=True))
    kept = x != 0
    S.frequency_check(int(kept.sum()), N, 1 - p, what="dropout keep fraction")
    vals = np.unique(x[kept])
    assert vals.tolist() == [np.float32(1 / (1 - p))], vals[:5]
    assert vals.tolist() == np.unique(eager[eager != 0]).tolist()
    y = _last_replay(lambda: torch.nn.Dropout(0.4).train()(ones))
    S.frequency_check(int((y != 0).sum()), N, 0.6, what="nn.Dropout(0.4)")


def test_sdpa_dropout():
    """Zero queries and keys make every attention weight 1/64; with V the identity the output is
    the dropped-out weight matrix itself: 0 where dropped, 1/(64 * 0.8) where kept."""
    p, b, h, L = 0.2, 4, 4, 64
    q = torch.zeros(b, h, L, L, device="cuda")
    v = torch.eye(L, device="cuda").expand(b, h, L, L).contiguous()
    eager = F.scaled_dot_product_attention(q, q, v, dropout_p=p)
    with cgraw.capture() as g:
        out = F.scaled_dot_product_attention(q, q, v, dropout_p=p)
    masks = []
    for _ in range(8):
        g.replay()
        o = _host(out)
        kept = o != 0
        np.testing.assert_allclose(o[kept], 1 / (L * (1 - p)), rtol=1e-3)
        masks.append(kept)
    e = _host(eager)
    np.testing.assert_allclose(e[e != 0], 1 / (L * (1 - p)), rtol=1e-3)
    m = np.stack(masks)
    S.frequency_check(int(m.sum()), m.size, 1 - p, what="sdpa dropout keep fraction")
    for r in range(1, len(masks)):
        S.corr_check(masks[r - 1], masks[r], what=f"sdpa masks of replays {r - 1} and {r}")


def test_multinomial_with_replacement():
    probs = torch.tensor([0.02, 0.08, 0.1, 0.3, 0.05, 0.15, 0.25, 0.05], device="cuda")
    rows = probs.expand(4096, -1).contiguous()
    per_row = torch.rand(1000, 8, device="cuda") + 0.1  # unnormalised weights, different per row
    many, one, each = _last_replay(lambda: (torch.multinomial(probs, N, replacement=True),
                                            torch.multinomial(rows, 1, replacement=True),
                                            torch.multinomial(per_row, 500, replacement=True)))
    pr = _host(probs).astype(np.float64)
    assert many.shape == (N,) and one.shape == (4096, 1) and each.shape == (1000, 500)
    S.chi_square(np.bincount(many, minlength=8), pr, what="multinomial(probs, 2^20, replacement=True)")
    S.chi_square(np.bincount(one.ravel(), minlength=8), pr, what="multinomial(4096 rows, 1)")
    # each row against its own weights (every cell expected >= 5.6 times: no pooling), all rows
    # in one test: a sum of 1000 independent chi-squares of 7 degrees of freedom each
    w = _host(per_row).astype(np.float64)
    counts = np.stack([np.bincount(r, minlength=8) for r in each])
    S.chi_square(counts.ravel(), (w / w.sum(1, keepdims=True)).ravel(), ddof=len(w) - 1,
                 what="multinomial per-row weights")


def test_multinomial_without_replacement():
    # exact law of unordered pairs drawn without replacement: P{i, j} = p_i p_j/(1-p_i) + p_j p_i/(1-p_j)
    p = np.array([0.05, 0.1, 0.15, 0.3, 0.4])
    rows = 200_000
    probs = torch.tensor(p, device="cuda", dtype=torch.float32).expand(rows, -1).contiguous()
    weights = torch.rand(2000, 64, device="cuda")
    weights[:, ::4] = 0  # 48 non-zero categories per row
    pairs, picks = _last_replay(lambda: (torch.multinomial(probs, 2, replacement=False),
                                         torch.multinomial(weights, 16, replacement=False)))
    assert (pairs[:, 0] != pairs[:, 1]).all()
    lo, hi = pairs.min(1), pairs.max(1)
    counts = np.zeros((5, 5))
    np.add.at(counts, (lo, hi), 1)
    iu = np.triu_indices(5, 1)
    exact = np.array([[p[i] * p[j] / (1 - p[i]) + p[j] * p[i] / (1 - p[j]) for j in range(5)] for i in range(5)])
    S.chi_square(counts[iu], exact[iu], what="multinomial(probs, 2, replacement=False) pairs")
    assert picks.shape == (2000, 16) and picks.min() >= 0 and picks.max() < 64
    srt = np.sort(picks, axis=1)
    assert (np.diff(srt, axis=1) != 0).all(), "a category drawn twice in one row"
    assert (picks % 4 != 0).all(), "a category of weight 0 was drawn"
    assert len({tuple(r) for r in srt.tolist()}) > 1990  # rows draw independently


def test_correlations():
    """Between consecutive replays, neighbouring elements (inside and across Philox groups) and
    two draws of one graph."""
    _, got = _replayed(lambda: (torch.rand(N, device="cuda"), torch.randn(N, device="cuda"),
                                torch.randn(N, device="cuda", dtype=_BF16)), 2)
    (u0, n0, b0), (u1, n1, b1) = got
    for name, a, b in (("rand", u0, u1), ("randn", n0, n1), ("randn bf16", b0, b1)):
        S.corr_check(a, b, what=f"{name}: replay 0 vs replay 1")
        for lag in (1, 2, 4, 5):
            S.corr_check(a[:-lag], a[lag:], what=f"{name}: lag {lag}")
    S.corr_check(u0, n0, what="two draws of one replay")
    S.corr_check(n0 ** 2, n1 ** 2, what="randn squares, consecutive replays")
    S.corr_check(n0[:-1] ** 2, n0[1:] ** 2, what="randn squares, neighbours (Box-Muller pairs)")


# ---------------------------------------------------------------- every replay is fresh

_M = 100_003
_FRESH = {
    "rand": lambda: torch.rand(_M, device="cuda"),
    "randn_bf16": lambda: torch.randn(_M, device="cuda", dtype=_BF16),
    "randint": lambda: torch.randint(0, 12, (_M,), device="cuda"),
    "normal_": lambda: _cuda(_M).normal_(2.0, 3.0),
    "exponential_": lambda: _cuda(_M).exponential_(),
    "bernoulli_": lambda: _cuda(_M).bernoulli_(0.5),
    "bernoulli_p": lambda: torch.bernoulli(torch.full((_M,), 0.25, device="cuda")),
    "multinomial": lambda: torch.multinomial(torch.ones(16, device="cuda"), _M, replacement=True),
    "dropout": lambda: F.dropout(torch.ones(_M, device="cuda"), 0.5, training=True),
    "random_": lambda: _cuda(_M, dtype=torch.int32).random_(0, 1000),
}


@pytest.mark.parametrize("name", list(_FRESH))
def test_every_replay_differs(name):
    _, got = _replayed(_FRESH[name], 5)
    for r in range(1, len(got)):
        a, b = got[r - 1].astype(np.float64), got[r].astype(np.float64)
        assert not np.array_equal(a, b), f"{name}: replay {r} repeated replay {r - 1}"
        S.corr_check(a, b, what=f"{name}: replays {r - 1} and {r}")


def test_cupy_every_replay_differs(cupy_mod):
    cp = cupy_mod
    p = cp.asarray([0.1, 0.2, 0.3, 0.4])
    _, got = _replayed(lambda: (cp.random.random(_M), cp.random.standard_normal(_M, dtype=cp.float32),
                                cp.random.randint(0, 12, _M), cp.random.choice(4, _M, p=p)), 4)
    for r in range(1, len(got)):
        for k, (a, b) in enumerate(zip(got[r - 1], got[r], strict=True)):
            assert not np.array_equal(a, b), f"output {k}: replay {r} repeated replay {r - 1}"
            S.corr_check(a, b, what=f"output {k}, replays {r - 1} and {r}")


# ---------------------------------------------------------------- CuPy distributions

CUPY_CONTINUOUS = {
    # name: (make(cp, n), check)
    "random_f64": (lambda cp, n: cp.random.random(n), _continuous(S.uniform_cdf(), 0.5, 1 / 12)),
    "random_sample_f32": (lambda cp, n: cp.random.random_sample(n, dtype=cp.float32),
                          _continuous(S.uniform_cdf(), 0.5, 1 / 12)),
    "rand_f64": (lambda cp, n: cp.random.rand(n), _continuous(S.uniform_cdf(), 0.5, 1 / 12)),
    "rand_f32": (lambda cp, n: cp.random.rand(n, dtype=cp.float32), _continuous(S.uniform_cdf(), 0.5, 1 / 12)),
    "randn_f64": (lambda cp, n: cp.random.randn(n), _continuous(S.normal_cdf(), 0.0, 1.0)),
    "randn_f32": (lambda cp, n: cp.random.randn(n, dtype=cp.float32), _continuous(S.normal_cdf(), 0.0, 1.0)),
    "standard_normal_f32": (lambda cp, n: cp.random.standard_normal(n, dtype=cp.float32),
                            _continuous(S.normal_cdf(), 0.0, 1.0)),
    "normal_f64": (lambda cp, n: cp.random.normal(1.5, 0.5, n), _continuous(S.normal_cdf(1.5, 0.5), 1.5, 0.25)),
    "normal_f32": (lambda cp, n: cp.random.normal(1.5, 0.5, n, dtype=cp.float32),
                   _continuous(S.normal_cdf(1.5, 0.5), 1.5, 0.25)),
    # exp of cgraw's normal: mean exp(mu + s^2/2), variance (exp(s^2) - 1) exp(2 mu + s^2)
    "lognormal_f64": (lambda cp, n: cp.random.lognormal(0.5, 0.8, n),
                      _continuous(S.log_normal_cdf(0.5, 0.8), math.exp(0.82), (math.exp(0.64) - 1) * math.exp(1.64))),
    "lognormal_f32": (lambda cp, n: cp.random.lognormal(0.5, 0.8, n, dtype=cp.float32),
                      _continuous(S.log_normal_cdf(0.5, 0.8), math.exp(0.82), (math.exp(0.64) - 1) * math.exp(1.64))),
    "uniform_f64": (lambda cp, n: cp.random.uniform(-2, 3, n), _continuous(S.uniform_cdf(-2, 3), 0.5, 25 / 12)),
    "uniform_f32": (lambda cp, n: cp.random.uniform(-2, 3, n, dtype=cp.float32),
                    _continuous(S.uniform_cdf(-2, 3), 0.5, 25 / 12)),
}


@pytest.mark.parametrize("name", list(CUPY_CONTINUOUS))
def test_cupy_continuous_distribution(name, cupy_mod):
    make, check = CUPY_CONTINUOUS[name]
    x = _last_replay(lambda: make(cupy_mod, N))
    assert x.shape == (N,)
    want = np.float32 if name.endswith("f32") else np.float64
    assert x.dtype == want, x.dtype
    check(x, name)


def test_cupy_randint_and_choice(cupy_mod):
    cp = cupy_mod
    p = np.array([0.05, 0.1, 0.2, 0.25, 0.4])
    p_dev = cp.asarray(p)  # on the device before the capture: nothing is uploaded inside it
    ri, ch_p, ch_u = _last_replay(lambda: (cp.random.randint(-5, 7, N), cp.random.choice(5, N, p=p_dev),
                                           cp.random.choice(7, N, replace=True)))
    assert ri.min() == -5 and ri.max() == 6
    S.chi_square(np.bincount(ri + 5, minlength=12), np.ones(12), what="cupy randint(-5, 7)")
    S.chi_square(np.bincount(ch_p, minlength=5), p, what="cupy choice(5, p=...)")
    S.chi_square(np.bincount(ch_u, minlength=7), np.ones(7), what="cupy choice(7)")


def test_cupy_choice_without_replacement(cupy_mod):
    cp = cupy_mod
    a, k, replays = 50, 20, 500
    _, got = _replayed(lambda: cp.random.choice(a, k, replace=False), replays)
    picks = np.stack(got)
    assert picks.min() >= 0 and picks.max() < a
    assert (np.diff(np.sort(picks, axis=1), axis=1) != 0).all(), "an element chosen twice in one draw"
    # each element is in a draw with probability k / a, independently across replays
    inclusion = np.bincount(picks.ravel(), minlength=a)
    for e in range(a):
        S.frequency_check(int(inclusion[e]), replays, k / a, what=f"cupy choice(replace=False) element {e}")
    assert len({tuple(sorted(r)) for r in picks.tolist()}) == replays


def test_cupy_permutation_and_shuffle(cupy_mod):
    """Every replay draws a permutation (of arange(n), and of the array's rows in place); over
    replays each position of element 0 is equally likely, and the draws differ."""
    cp = cupy_mod
    n, replays = 8, 480
    rows = cp.asarray(np.arange(n * 3, dtype=np.float32).reshape(n, 3))  # on the device before the capture

    def make():
        cp.random.shuffle(rows)
        return cp.random.permutation(n), cp.random.permutation(rows[:, 0])

    _, got = _replayed(make, replays)
    where0 = []
    for perm, perm_rows in got:
        assert perm.dtype == np.int64 and sorted(perm.tolist()) == list(range(n))
        assert sorted(perm_rows.tolist()) == [3.0 * i for i in range(n)]
        where0.append(int(np.flatnonzero(perm == 0)[0]))
    S.chi_square(np.bincount(where0, minlength=n), np.ones(n), what="cupy permutation(8): position of 0")
    assert len({tuple(p.tolist()) for p, _ in got}) > replays // 2
    shuffled = _host(rows)
    assert sorted(shuffled[:, 0].tolist()) == [3.0 * i for i in range(n)]
    assert np.array_equal(shuffled[:, 1:] - shuffled[:, :1], np.tile([1.0, 2.0], (n, 1)))  # rows moved whole


# ---------------------------------------------------------------- CuPy rejection samplers
# gamma, beta, poisson and binomial draw a variable number of uniforms per element, each element on
# its own counter stream (rng.kernels.SAMPLERS). Two replays of one capture: they differ, and each
# follows the law (KS and moments for gamma and beta; moments and chi-square on the pmf for the
# integer laws). A NaN or -1 (an iteration cap hit) fails the checks.

_S = 1 << 18  # samples per sampler case


def _sampled(make):
    """Both replays of ``make()``'s outputs (a tuple), after checking that the replays differ."""
    _, got = _replayed(make, 2)
    for k, (a, b) in enumerate(zip(got[0], got[1], strict=True)):
        assert not np.array_equal(a, b), f"output {k}: the second replay repeated the first"
        S.corr_check(a.astype(np.float64), b.astype(np.float64), what=f"output {k}, replays 0 and 1")
    return got


def _pmf_check(x, dist, what):
    """Chi-square of the integer samples ``x`` against the scipy.stats law ``dist`` (the cells
    beyond the largest value drawn pooled into its cell)."""
    assert x.min() >= 0, f"{what}: negative draws {np.unique(x[x < 0])[:5]} (an iteration cap hit?)"
    top = int(max(x.max(), dist.isf(1e-12)))
    probs = dist.pmf(np.arange(top + 1))
    probs[-1] += dist.sf(top)
    S.chi_square(np.bincount(x.astype(np.int64), minlength=top + 1), probs, what=what)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [0.5, 1.0, 3.7, 50.0])
def test_cupy_gamma(shape, dtype, cupy_mod):
    stats = pytest.importorskip("scipy.stats")
    cp, scale = cupy_mod, 2.5
    got = _sampled(lambda: (cp.random.gamma(shape, scale, _S, dtype=dtype),
                            cp.random.standard_gamma(shape, size=_S, dtype=dtype)))
    for r, (g, sg) in enumerate(got):
        for x, theta, name in ((g, scale, "gamma"), (sg, 1.0, "standard_gamma")):
            what = f"cupy {name}({shape}) {dtype}, replay {r}"
            assert x.dtype == np.dtype(dtype) and x.shape == (_S,), (what, x.dtype, x.shape)
            assert (x >= 0).all(), what
            S.ks_continuous(x, stats.gamma(shape, scale=theta).cdf, what=what)
            S.mean_var_check(x, shape * theta, shape * theta * theta, what=what)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("a,b", [(0.5, 0.5), (2.0, 5.0)])
def test_cupy_beta(a, b, dtype, cupy_mod):
    stats = pytest.importorskip("scipy.stats")
    cp = cupy_mod
    got = _sampled(lambda: (cp.random.beta(a, b, _S, dtype=dtype),))
    for r, (x,) in enumerate(got):
        what = f"cupy beta({a}, {b}) {dtype}, replay {r}"
        assert x.dtype == np.dtype(dtype) and x.shape == (_S,), (what, x.dtype)
        assert ((x >= 0) & (x <= 1)).all(), what
        S.ks_continuous(x, stats.beta(a, b).cdf, what=what)
        S.mean_var_check(x, a / (a + b), a * b / ((a + b) ** 2 * (a + b + 1)), what=what)


@pytest.mark.parametrize("dtype", ["int32", None])  # None: CuPy's default dtype int (int64)
@pytest.mark.parametrize("lam", [0.5, 4.0, 30.0, 1000.0])
def test_cupy_poisson(lam, dtype, cupy_mod):
    stats = pytest.importorskip("scipy.stats")
    cp = cupy_mod
    kw = {} if dtype is None else {"dtype": dtype}
    got = _sampled(lambda: (cp.random.poisson(lam, _S, **kw),))
    for r, (x,) in enumerate(got):
        what = f"cupy poisson({lam}) {dtype or 'default'}, replay {r}"
        assert x.dtype == (np.int32 if dtype else np.int64) and x.shape == (_S,), (what, x.dtype)
        _pmf_check(x, stats.poisson(lam), what)
        S.mean_var_check(x, lam, lam, what=what)


@pytest.mark.parametrize("dtype", ["int32", None])
@pytest.mark.parametrize("n,p", [(10, 0.3), (1000, 0.7), (20, 0.02)])
def test_cupy_binomial(n, p, dtype, cupy_mod):
    stats = pytest.importorskip("scipy.stats")
    cp = cupy_mod
    kw = {} if dtype is None else {"dtype": dtype}
    got = _sampled(lambda: (cp.random.binomial(n, p, _S, **kw),))
    for r, (x,) in enumerate(got):
        what = f"cupy binomial({n}, {p}) {dtype or 'default'}, replay {r}"
        assert x.dtype == (np.int32 if dtype else np.int64) and x.shape == (_S,), (what, x.dtype)
        assert x.max() <= n, what
        _pmf_check(x, stats.binom(n, p), what)
        S.mean_var_check(x, n * p, n * p * (1 - p), what=what)


def test_cupy_samplers_take_their_offsets_and_size_none(cupy_mod):
    """Beta takes two offsets, the others one; ``size=None`` draws one value of shape ()."""
    cp = cupy_mod
    with cgraw.capture() as g:
        one = cp.random.gamma(2.0)
        cp.random.beta(2.0, 3.0, 10)
        cp.random.poisson(3.0, 10)
        cp.random.binomial(10, 0.5, 10)
    assert one.shape == () and one.dtype == np.float64
    assert g.rng.draws == 5, g.rng
    rs = cp.random.get_random_state()
    before = rs._rk_seed
    g.replay()
    assert rs._rk_seed == (before + 31) % cgraw.rng.plan.UINT64_MAX and float(one) > 0  # 1 + 3 x 10 elements


# ---------------------------------------------------------------- what is not covered


@pytest.mark.parametrize("op", ["randperm", "poisson"])
def test_uncovered_op_raises(op):
    rates = torch.full((10,), 3.0, device="cuda")
    make = {"randperm": lambda: torch.randperm(10, device="cuda"), "poisson": lambda: torch.poisson(rates)}[op]
    with pytest.raises(cgraw.CaptureError, match=op), cgraw.capture():
        make()
    # the device and the next capture work
    with cgraw.capture() as g:
        y = torch.rand(100, device="cuda")
    g.replay()
    assert 0.0 <= float(y.min()) and float(y.max()) < 1.0


# ---------------------------------------------------------------- @cgraw.graphed


def test_graphed_dropout_records_once_and_replays_fresh():
    p = 0.25

    def layer(x):
        return F.dropout(torch.tanh(x) * 2.0, p, training=True)

    f = cgraw.graphed(layer)
    masks, calls, shape = [], 6, (512, 1024)
    for _ in range(calls):
        x = trand(*shape)
        out = f(x).clone()  # the next call overwrites the graph's output
        kept = out != 0
        torch.testing.assert_close(out[kept], (torch.tanh(x) * 2.0 / (1 - p))[kept], rtol=1e-6, atol=1e-6)
        masks.append(_host(kept))
    _assert_recorded_once(f, replays=calls - 2)
    n = masks[0].size
    for i, m in enumerate(masks):
        S.frequency_check(int((~m).sum()), n, p, what=f"call {i}: dropped fraction")
    for i in range(1, calls):
        assert not np.array_equal(masks[i - 1], masks[i]), f"call {i} repeated call {i - 1}'s mask"
        S.corr_check(masks[i - 1], masks[i], what=f"masks of calls {i - 1} and {i}")


# ---------------------------------------------------------------- third party: transformers

GPT2_STEPS, GPT2_BATCHES, GPT2_TOKENS = 300, 64, 64


def _motif_batches():
    """64 batches of (4, 32) tokens below 64: each next token is the previous plus 1, 2 or 3
    (mod 64), so the best possible loss is about ln 3 (the first token: ln 64)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(GPT2_BATCHES):
        start = torch.randint(0, GPT2_TOKENS, (4, 1), generator=g)
        steps = torch.randint(1, 4, (4, 31), generator=g)
        out.append((torch.cat([start, start + steps.cumsum(1)], 1) % GPT2_TOKENS).cuda())
    return out


@pytest.mark.third_party
def test_gpt2_dropout_training_graphed_vs_eager():
    """The whole step (zero_grad, forward with labels, backward, AdamW) is one graphed function,
    with dropout on embeddings, residuals and attention (SDPA's dropout_p). The graph's dropout
    masks come from cgraw's kernels (other values than eager's kernels draw from the same torch
    generator state), so losses are compared as curves:
    both fall from ln 512 to near the floor, and agree within 5% over the last 50 steps (on the
    CPU, two eager runs with different dropout seeds agreed within 0.5%)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=64,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().train()
    model_e = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    opt_e = torch.optim.AdamW(model_e.parameters(), lr=1e-3, capturable=True)

    def step(m, o, ids):
        o.zero_grad(set_to_none=False)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        o.step()  # AdamW's state is created by the first step: the eager warm-up call
        return loss.detach()

    f = cgraw.graphed(lambda ids: step(model, opt, ids))
    batches = _motif_batches()
    graphed, eager = [], []
    for i in range(GPT2_STEPS):
        graphed.append(f(batches[i % GPT2_BATCHES]).clone())
    for i in range(GPT2_STEPS):
        eager.append(step(model_e, opt_e, batches[i % GPT2_BATCHES]))
    lg, le = torch.stack(graphed).cpu().numpy(), torch.stack(eager).cpu().numpy()
    assert np.isfinite(lg).all(), lg
    for name, losses in (("graphed", lg), ("eager", le)):
        assert losses[-50:].mean() < 0.5 * losses[:10].mean(), (name, losses[:10], losses[-50:])
    rel = abs(lg[-50:].mean() - le[-50:].mean()) / le[-50:].mean()
    assert rel < 0.05, (f"last 50 steps: graphed {lg[-50:].mean():.4f}, eager {le[-50:].mean():.4f}; "
                        f"first 10: {lg[:10].mean():.3f} / {le[:10].mean():.3f}")
    _assert_recorded_once(f, replays=GPT2_STEPS - 2)


def _llama(transformers, vocab):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).cuda().eval()


def _temperature(logits) -> float:
    """std(logits): a random model's logits are nearly flat (std ~0.3); at this temperature the
    probabilities spread over about e^-3..e^3 times their mean (a sampler that ignored them fails)."""
    return float(logits.std())


@pytest.mark.third_party
def test_llama_logits_graphed_sampling():
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, 128)
    prompt = torch.tensor([[3, 17, 42, 5, 99, 7, 64, 21]], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=prompt, use_cache=False).logits[0, -1].clone()
    temp = _temperature(logits)
    probs_ref = torch.softmax(logits.double() / temp, -1).cpu().numpy()

    def sample(lg):
        return torch.multinomial(torch.softmax(lg / temp, -1), 1)

    f = cgraw.graphed(sample)
    calls = 2000
    toks = torch.stack([f(logits).clone() for _ in range(calls + 2)])[2:]  # replays only
    counts = np.bincount(_host(toks).ravel(), minlength=probs_ref.size)
    S.chi_square(counts, probs_ref, what=f"{calls} graphed multinomial calls")
    _assert_recorded_once(f, replays=calls)
    # many samples in one replay: a 4096-row batch of the same distribution
    rows = logits.expand(4096, -1).contiguous()
    many = _last_replay(lambda: torch.multinomial(torch.softmax(rows / temp, -1), 1))
    S.chi_square(np.bincount(many.ravel(), minlength=probs_ref.size), probs_ref, what="4096-row multinomial")


@pytest.mark.third_party
def test_llama_static_cache_sampled_decode():
    """The issue's scenario: a Llama decode loop with a StaticCache, one graphed step per token,
    sampling the next token with torch.multinomial inside the step. 2,000 runs from the same
    one-token prompt (the cache reset in place between runs); the first generated token of the
    runs that replayed is chi-squared against the eager softmax at that position."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, 128)
    steps, runs = 2, 2000
    prompt = torch.tensor([[5]], device="cuda")
    positions = [torch.tensor([i], device="cuda") for i in range(steps)]
    cache = transformers.StaticCache(config=model.config, max_cache_len=8)
    with torch.no_grad():
        # eager: allocates the cache (lazily, on first use) and gives the reference distribution
        logits = model(input_ids=prompt, position_ids=positions[0].unsqueeze(0), past_key_values=cache,
                       use_cache=True).logits[0, -1].clone()
    temp = _temperature(logits)
    probs_ref = torch.softmax(logits.double() / temp, -1).cpu().numpy()

    def decode_step(tok, pos, cache):
        out = model(input_ids=tok, position_ids=pos.unsqueeze(0), past_key_values=cache, use_cache=True)
        return torch.multinomial(torch.softmax(out.logits[:, -1, :] / temp, -1), 1)

    f = cgraw.graphed(decode_step)
    firsts, seconds = [], []
    with torch.no_grad():
        for _ in range(runs + 1):
            cache.reset()  # in place: the graph reads the cache where it is
            tok = f(prompt, positions[0], cache)
            firsts.append(tok.clone())
            tok = f(tok, positions[1], cache)
            seconds.append(tok.clone())
    first = _host(torch.cat(firsts[1:])).ravel()  # the first run warmed up and recorded
    second = _host(torch.cat(seconds[1:])).ravel()
    assert second.min() >= 0 and second.max() < probs_ref.size
    assert np.unique(second).size > 10
    S.chi_square(np.bincount(first, minlength=probs_ref.size), probs_ref, what="first sampled token")
    _assert_recorded_once(f, replays=2 * runs)


def test_bernoulli_tensor_p_into_channels_last_and_rand_out_resized():
    # probabilities 0 and 1 make the draws exact: each element must pair with its own p, whatever
    # the target's memory layout; out= of another size is resized as torch does
    p = torch.zeros(2, 3, 8, 8, device="cuda")
    p[:, :, 4:] = 1.0
    p[1, 2] = 1.0 - p[1, 2]
    t = torch.empty(2, 3, 8, 8, device="cuda").to(memory_format=torch.channels_last)
    o = torch.empty(3, device="cuda")
    with cgraw.capture() as g:
        t.bernoulli_(p)
        torch.rand(1000, device="cuda", out=o)
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(t, p)
        assert o.shape == (1000,) and bool(((o >= 0) & (o < 1)).all())
