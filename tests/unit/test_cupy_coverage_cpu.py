"""CPU tier: benchmarks.cupy_coverage without CuPy or a GPU: the case registry (size, spread,
names, inputs that can be refreshed in place), the output comparison, the random-number checks,
the error kinds, and whole cases run against NumPy with a fake recorder, so that every outcome
(captured and equal, capture error, other error, silently wrong, not applicable) is reached."""

from __future__ import annotations

import argparse
import collections

import numpy as np
import pytest

from benchmarks import _cupy_cases as C
from benchmarks import cupy_coverage as cc

CASES = C.cases()


# ---------------------------------------------------------------- the registry


def test_registry_has_at_least_150_distinct_functions_and_unique_names():
    names = [c.name for c in CASES]
    dupes = [n for n, k in collections.Counter(names).items() if k > 1]
    assert not dupes, dupes
    assert len({c.function for c in CASES}) >= 150


def test_registry_spreads_over_the_modules_of_issue_17():
    per_module = collections.Counter(c.module for c in CASES)
    for module, least in {"cupy": 100, "cupy.linalg": 10, "cupy.fft": 10, "cupy.random": 15,
                          "cupyx.scipy.ndimage": 15, "cupyx.scipy.signal": 15, "cupyx.scipy.special": 20,
                          "cupyx.scipy.sparse": 5}.items():
        assert per_module[module] >= least, (module, per_module[module])
    sections = {c.section for c in CASES}
    assert {"elementwise", "reduction", "manipulation", "linear algebra"} <= sections


def test_every_case_is_well_formed():
    for c in CASES:
        assert c.compare in C.COMPARES, c.name
        assert c.module in C.MODULES, c.name
        assert c.expect is None or c.expect in C.EXPECT_TEXT, c.name
        assert (c.compare == "random") == (c.law is not None), c.name
        assert c.function.startswith(("cupy.", "cupyx.scipy.")), c.name
        assert " " not in c.function, c.name


def test_inputs_are_fresh_each_round_with_the_same_shapes_and_dtypes():
    """The run writes round k's values into round 0's device arrays in place."""
    dtypes = set()
    for c in CASES:
        rng = np.random.default_rng(0)
        a, b = c.host_inputs(rng), c.host_inputs(rng)
        assert len(a) == len(b) == len(c.inputs), c.name
        for x, y in zip(a, b, strict=True):
            assert isinstance(x, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype, c.name
            dtypes.add(x.dtype.name)
        varying = [x for x in a if x.dtype.kind in "fc" and x.size > 1]
        if varying:
            assert any(not np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b, strict=True)
                       if x.dtype.kind in "fc" and x.size > 1), c.name
    assert {"float32", "float64", "complex64", "int32", "bool"} <= dtypes


def test_structured_inputs_keep_their_structure():
    rng = np.random.default_rng(1)
    spd = C._spd(8).make(rng)
    assert np.all(np.linalg.eigvalsh(spd.astype(np.float64)) > 0)
    assert np.all(np.diff(C._sorted(64).make(rng)) >= 0)
    p = C._probabilities(5).make(rng)
    assert abs(p.sum() - 1.0) < 1e-12 and np.all(p > 0)
    data, indices, indptr = (spec.make(rng) for spec in C.SP_INPUTS)
    assert indptr[0] == 0 and indptr[-1] == data.size == indices.size == C.SP_NNZ
    assert indices.max() < C.SPARSE_SHAPE[1] and indptr.size == C.SPARSE_SHAPE[0] + 1
    assert np.array_equal(indices, C.SP_INDICES.make(np.random.default_rng(2)))  # same structure every round


def test_expected_failures_cover_the_known_refusals():
    expect = collections.Counter(c.expect for c in CASES)
    for kind in (C.CUBLAS, C.CUSOLVER, C.CUSPARSE, C.SYNC, C.RNG):
        assert expect[kind] >= 1, kind
    assert expect[C.UPLOAD] == 0  # every upload of the table goes through cupy.asarray: staged
    by_name = {c.name: c for c in CASES}
    assert by_name["cupy.matmul"].expect is None  # routed to cgraw's cuBLAS handle (interop.cupy.blas)
    assert by_name["cupy.cublas.iamax"].expect == C.CUBLAS
    assert by_name["cupy.linalg.solve"].expect is None  # routed to cgraw's cuSOLVER handle (interop.cupy.solver)
    assert by_name["cupy.linalg.svd [batch of one]"].expect is None  # gesvdjBatched: routed
    for name in ("svd", "svd [24x16, reduced]", "eigh", "eigvalsh", "pinv", "matrix_rank", "norm [ord=2]"):
        # single matrices up to 32x32: gesvd/Xsyevd run as the batched Jacobi routines
        assert by_name["cupy.linalg." + name].expect is None, name
    for name in ("lstsq", "cond"):  # past the svd, CuPy reads a value on the host
        assert by_name["cupy.linalg." + name].expect == C.SYNC, name
    for name in ("logsumexp", "log_softmax"):  # a scalar through a mask: interop.cupy.mask
        assert by_name["cupyx.scipy.special." + name].expect is None, name
    assert by_name["cupyx.scipy.signal.savgol_filter"].expect == C.SYNC  # mode="interp": polyfit's tall lstsq
    assert {by_name["cupy.linalg." + n].compare for n in ("svd", "svd [24x16, reduced]")} == {"svd"}
    assert by_name["cupy.linalg.eigh"].compare == "eigh"
    assert by_name["cupy.linalg.svd [48x48]"].expect == C.CUSOLVER  # over 32x32: refused by name
    assert by_name["cupy.linalg.eig"].expect == C.CUSOLVER  # Xgeev's host workspace: refused
    assert by_name["cupyx.scipy.ndimage.gaussian_filter"].expect is None  # its weights' upload is staged
    assert by_name["cupy.random.vonmises"].expect == C.RNG
    for name in ("gamma", "standard_gamma", "beta", "poisson", "binomial"):  # rng.kernels.SAMPLERS
        case = by_name["cupy.random." + name]
        assert case.expect is None and case.law.mean is not None and case.law.std is not None, name
    sp = "cupyx.scipy.sparse."  # cuSPARSE (interop.cupy.sparse)
    for name in ("csr_matrix.dot", "csr_matrix.__matmul__", "csr_matrix.sum", "csc_matrix.dot"):
        assert by_name[sp + name].expect is None, name
    assert by_name[sp + "csr_matrix.__add__"].expect == C.CUSPARSE  # csrgeam2: refused by name
    assert by_name[sp + "csr_matrix.toarray"].expect == C.SYNC  # past xcsr2coo, COO's sum_duplicates reads .all()
    assert by_name["cupy.random.normal"].expect is None and by_name["cupy.random.normal"].compare == "random"


# ---------------------------------------------------------------- comparison


def _host(*values):
    return [cc.Leaf("host", np.asarray(v)) for v in values]


def test_compare_accepts_equal_and_close_float_outputs():
    w = np.linspace(-3, 3, 50, dtype=np.float32)
    assert cc.compare_outputs(_host(w), _host(w.copy()))["equal"]
    v = cc.compare_outputs(_host(w * (1 + 1e-7)), _host(w))
    assert v["equal"] and 0 < v["max_abs_diff"] < 1e-5


def test_compare_reports_a_wrong_value_with_its_difference():
    w = np.ones(8, np.float32)
    g = w.copy()
    g[3] = 1.5
    v = cc.compare_outputs(_host(g), _host(w))
    assert not v["equal"] and v["max_abs_diff"] == pytest.approx(0.5) and "max abs diff" in v["reason"]


def test_compare_is_exact_for_integer_and_bool_outputs():
    w = np.arange(10, dtype=np.int32)
    g = w.copy()
    g[0] += 1
    assert not cc.compare_outputs(_host(g), _host(w))["equal"]
    assert not cc.compare_outputs(_host(np.array([True, False])), _host(np.array([True, True])))["equal"]
    f = np.float32(1.0) + np.float32(1e-7)
    assert not cc.compare_outputs(_host(np.array([f])), _host(np.array([1.0], np.float32)), exact=True)["equal"]


def test_compare_treats_nan_as_equal_to_nan_but_not_to_a_number():
    w = np.array([1.0, np.nan, np.inf], np.float32)
    assert cc.compare_outputs(_host(w.copy()), _host(w))["equal"]
    v = cc.compare_outputs(_host(np.array([1.0, 2.0, np.inf], np.float32)), _host(w))
    assert not v["equal"] and v["max_abs_diff"] == np.inf


def test_compare_refuses_other_shapes_dtypes_kinds_and_structures():
    w = np.zeros((2, 3), np.float32)
    assert "eager's is" in cc.compare_outputs(_host(w.T), _host(w))["reason"]
    assert not cc.compare_outputs(_host(w.astype(np.float64)), _host(w))["equal"]
    assert not cc.compare_outputs(_host(w, w), _host(w))["equal"]
    dev = [cc.Leaf("device", w)]
    assert "host" in cc.compare_outputs(_host(w), dev)["reason"]
    assert cc.compare_outputs([cc.Leaf("none", None)], [cc.Leaf("none", None)])["equal"]


def test_tolerance_scales_with_the_output_magnitude():
    w = np.array([1e4, 0.0], np.float32)
    assert cc.compare_outputs(_host(w + np.array([0.0, 5e-3], np.float32)), _host(w))["equal"]
    assert not cc.compare_outputs(_host(w + np.array([0.0, 5e-1], np.float32)), _host(w))["equal"]


class _FakeDevice:
    """A device array as leaves() sees one: ``__cuda_array_interface__`` and ``get()``."""

    def __init__(self, a):
        self.a = a
        self.__cuda_array_interface__ = {}

    def get(self):
        return self.a.copy()


class _FakeSparse:
    nnz = 2

    def toarray(self):
        return _FakeDevice(np.eye(2))


def test_leaves_flatten_outputs_and_copy_host_values():
    x = np.arange(4.0)
    got = cc.leaves((_FakeDevice(x), [None, _FakeSparse()], 3.5, x, {"b": 2, "a": _FakeDevice(x)}))
    assert [leaf.kind for leaf in got] == ["device", "none", "sparse", "host", "host", "device", "host"]
    assert np.array_equal(got[2].value, np.eye(2)) and got[3].value == 3.5
    x[0] = 99.0
    assert got[4].value[0] == 0.0  # a copy: a view of an input must not follow the input


def test_same_values_is_bitwise():
    a = _host(np.array([1.0, np.nan]))
    assert cc.same_values(a, _host(np.array([1.0, np.nan])))
    assert not cc.same_values(a, _host(np.array([1.0, 2.0])))
    assert not cc.same_values(a, a + a)


# ---------------------------------------------------------------- random numbers


def _draws(x):
    return [cc.Leaf("device", np.asarray(x))]


def test_random_check_passes_fresh_draws_of_the_law():
    g = np.random.default_rng(0)
    law = C.Law(lo=0.0, hi=1.0, mean=0.5, std=(1 / 12) ** 0.5)
    rounds = [_draws(g.random(4096)), _draws(g.random(4096))]
    assert cc.check_random(rounds, _draws(g.random(4096)), law, [[], []]) == []


def test_random_check_finds_repeats_range_mean_shape_and_whole_numbers():
    g = np.random.default_rng(1)
    law = C.Law(lo=0.0, hi=1.0, mean=0.5, std=(1 / 12) ** 0.5)
    ref = _draws(g.random(4096))
    same = g.random(4096)
    assert any("same numbers" in p for p in cc.check_random([_draws(same), _draws(same)], ref, law, [[], []]))
    shifted = [_draws(g.random(4096) + 0.2), _draws(g.random(4096) + 0.2)]
    problems = " ".join(cc.check_random(shifted, ref, law, [[], []]))
    assert "maximum" in problems and "mean" in problems
    assert "eager draws" in " ".join(cc.check_random([_draws(g.random(10))], ref, law, [[]]))
    assert "float32" in " ".join(cc.check_random([_draws(g.random(4096).astype(np.float32))], ref, law, [[]]))
    ints = C.Law(lo=0, hi=10, integer=True)
    halves = [_draws(g.integers(0, 10, 64) + 0.5)]
    assert "whole" in " ".join(cc.check_random(halves, _draws(np.zeros(64)), ints, [[]]))
    assert cc.check_random([[cc.Leaf("none", None)]], ref, law, [[]]) == ["no array output"]


def test_random_check_of_a_permutation_finds_a_repeated_value():
    g = np.random.default_rng(2)
    law = C.Law(lo=0, hi=64, integer=True, distinct=True, mean=31.5, std=((64 * 64 - 1) / 12) ** 0.5)
    perms = [_draws(g.permutation(64)), _draws(g.permutation(64))]
    assert cc.check_random(perms, _draws(np.arange(64)), law, [[], []]) == []
    twice = g.permutation(64)
    twice[0] = twice[1]
    assert "twice" in " ".join(cc.check_random([_draws(twice), perms[0]], _draws(np.arange(64)), law, [[], []]))
    by_name = {c.name: c for c in CASES}
    assert by_name["cupy.random.permutation"].law.distinct and by_name["cupy.random.shuffle"].law.distinct
    assert by_name["cupy.random.lognormal"].expect is None and by_name["cupy.random.vonmises"].expect == C.RNG


def test_random_check_uses_the_rounds_inputs():
    g = np.random.default_rng(2)
    loc = g.standard_normal(4096) * 10
    law = C.Law(mean=0.0, std=1.0, minus=0)
    good = [_draws(loc + g.standard_normal(4096))]
    assert cc.check_random(good, _draws(np.zeros(4096)), law, [[loc]]) == []
    stale = [_draws(g.standard_normal(4096))]  # drawn around an old loc
    assert cc.check_random(stale, _draws(np.zeros(4096)), law, [[loc]])
    pop = np.array([3, 5, 7])
    assert cc.check_random([_draws(g.choice(pop, 100))], _draws(np.zeros(100, int)), C.Law(support=0), [[pop]]) == []
    assert cc.check_random([_draws(np.full(100, 4))], _draws(np.zeros(100, int)), C.Law(support=0), [[pop]])


# ---------------------------------------------------------------- error kinds


def test_error_kinds_follow_cgraws_messages():
    from cgraw.interop.cupy import pools as icupy, blas as cupy_blas, rng as cupy_rng, sparse as cupy_sparse

    assert cc.error_kind(icupy.CUBLAS) == C.CUBLAS
    assert cc.error_kind(str(cupy_blas._not_covered("sdot", "host result"))) == C.CUBLAS
    assert cc.error_kind(icupy.CUSOLVER) == C.CUSOLVER
    assert cc.error_kind(icupy.CUSPARSE) == C.CUSPARSE
    assert cc.error_kind(str(cupy_sparse._not_covered("xcsrgeam2Nnz", cupy_sparse._GEAM))) == C.CUSPARSE
    assert cc.error_kind(icupy.UPLOAD) == C.UPLOAD
    assert cc.error_kind(icupy.HOST_SYNC) == C.SYNC
    assert cc.error_kind(icupy.RNG) == C.RNG
    assert cc.error_kind(str(cupy_rng._not_covered("gamma"))) == C.RNG
    assert cc.error_kind("cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: x") == "invalidated"
    assert cc.error_kind("something else") == "other"


# ---------------------------------------------------------------- whole cases on NumPy


class _FakeCaptureError(Exception):
    def __init__(self, description):
        super().__init__(f"cuStreamEndCapture: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: {description}")
        self.description = description


class _Graph:
    """Replays by calling the body again (``stale``: replays do nothing, a silently wrong graph)."""

    def __init__(self, fn, box, stale):
        self.fn, self.box, self.stale, self.closed = fn, box, stale, False

    def replay(self):
        if not self.stale:
            self.box[0] = self.fn()

    def close(self):
        self.closed = True


def _runtime(*, stale=False, fail=None, graphs=None):
    def resolve(path):
        mod, _, name = path.rpartition(".")
        if mod == "cupy.random":
            return getattr(np.random, name)
        if mod != "cupy":
            raise ImportError(f"no module {mod}")
        return getattr(np, name)

    def record(fn):
        if fail is not None:
            raise fail
        box = [fn()]  # leaves() flattens the list: the box's content is the output
        g = _Graph(fn, box, stale)
        if graphs is not None:
            graphs.append(g)
        return g, box

    syncs = []
    rt = cc.Runtime(ns=argparse.Namespace(cp=np), resolve=resolve, to_device=lambda h: np.array(h, copy=True),
                    record=record, capture_error=_FakeCaptureError, sync=lambda: syncs.append(1))
    return rt, syncs


def test_a_correct_replay_is_captured_equal_and_the_graph_is_closed():
    graphs = []
    rt, syncs = _runtime(graphs=graphs)
    row = cc.run_case(C.Case("cupy.sin", "elementwise", (C.V,)), rt)
    assert row["outcome"] == cc.CAPTURED_EQUAL and row["values_changed"] is True and row["max_abs_diff"] == 0.0
    assert row["as_expected"] is True and graphs[0].closed and syncs and row["wall_ms"] >= 0
    row = cc.run_case(C.Case("cupy.add [tuple]", "elementwise", (C.V, C.W), lambda f, a, b: (f(a, b), a)), rt)
    assert row["outcome"] == cc.CAPTURED_EQUAL


def test_a_stale_replay_is_silently_wrong():
    rt, _ = _runtime(stale=True)
    row = cc.run_case(C.Case("cupy.exp", "elementwise", (C.V,)), rt)
    assert row["outcome"] == cc.SILENTLY_WRONG and row["max_abs_diff"] > 0 and "round 1" in row["reason"]
    assert row["as_expected"] is False


def test_capture_errors_are_clear_and_classified():
    rt, _ = _runtime(fail=_FakeCaptureError("CuPy refuses every cuBLAS call during stream capture"))
    row = cc.run_case(C.Case("cupy.dot", "linear algebra", (C.SQ, C.SQ), expect=C.CUBLAS), rt)
    assert row["outcome"] == cc.CAPTURE_ERROR and row["error_kind"] == C.CUBLAS and row["phase"] == "capture"
    assert row["message"].startswith("cuStreamEndCapture") and len(row["message"]) <= cc.MESSAGE_CHARS
    assert row["as_expected"] is True and row["expect_text"] == C.EXPECT_TEXT[C.CUBLAS]


def test_other_exceptions_are_not_clear():
    rt, _ = _runtime(fail=ValueError("boom"))
    row = cc.run_case(C.Case("cupy.tanh", "elementwise", (C.V,)), rt)
    assert row["outcome"] == cc.OTHER_ERROR and row["message"] == "ValueError: boom"


def test_missing_functions_and_failing_eager_calls_are_not_applicable():
    rt, _ = _runtime()
    row = cc.run_case(C.Case("cupy.no_such_function", "elementwise", (C.V,)), rt)
    assert row["outcome"] == cc.NOT_APPLICABLE and "not in this CuPy" in row["reason"] and row["as_expected"] is None
    row = cc.run_case(C.Case("cupyx.scipy.special.erf", "special", (C.V,)), rt)
    assert row["outcome"] == cc.NOT_APPLICABLE
    row = cc.run_case(C.Case("cupy.sin [bad]", "elementwise", (C.V,), lambda f, x: f(x, x, x, x)), rt)
    assert row["outcome"] == cc.NOT_APPLICABLE and row["eager_failed"] and "eager call failed" in row["reason"]


def test_an_output_that_ignores_its_inputs_is_flagged_as_a_weak_check():
    rt, _ = _runtime()
    row = cc.run_case(C.Case("cupy.zeros_like", "manipulation", (C.V,)), rt)
    assert row["outcome"] == cc.CAPTURED_EQUAL and row["values_changed"] is False


def test_random_cases_are_checked_by_distribution():
    rt, _ = _runtime()
    law = C.Law(lo=0.0, hi=1.0, mean=0.5, std=(1 / 12) ** 0.5)
    case = C.Case("cupy.random.random", "random", (), lambda f: f(4096), compare="random", law=law)
    assert cc.run_case(case, rt)["outcome"] == cc.CAPTURED_EQUAL
    rt_stale, _ = _runtime(stale=True)
    row = cc.run_case(case, rt_stale)
    assert row["outcome"] == cc.SILENTLY_WRONG and "same numbers" in row["reason"]


def test_summary_counts_percentages_and_lists():
    rows = [{"name": f"cupy.f{i}", "function": f"cupy.f{i}", "module": "cupy", "section": "elementwise",
             "outcome": o, "reason": "r", "message": "m", "expect": None, "wall_ms": 1.0,
             "as_expected": None if o == cc.NOT_APPLICABLE else o == cc.CAPTURED_EQUAL}
            for i, o in enumerate([cc.CAPTURED_EQUAL] * 9 + [cc.CAPTURE_ERROR, cc.NOT_APPLICABLE])]
    s = cc.summarize(rows)
    assert s["counts"][cc.CAPTURED_EQUAL] == 9 and s["applicable"] == 10 and s["captured_equal_pct"] == 90.0
    assert s["goal_met"] and s["passed"] and s["clear_pct"] == 100.0
    assert s["by_module"]["cupy"]["cases"] == 11 and len(s["not_as_expected"]) == 1
    rows[0]["outcome"] = cc.SILENTLY_WRONG
    s = cc.summarize(rows)
    assert not s["passed"] and not s["goal_met"] and s["silently_wrong"] == [{"name": "cupy.f0", "reason": "r"}]
    cc.print_table(s, rows)


# ---------------------------------------------------------------- the command


def test_select_by_section_or_name_prefix():
    assert {c.section for c in cc.select(CASES, "fft")} == {"fft"}
    linalg = cc.select(CASES, "cupy.linalg")
    assert linalg and all(c.function.startswith("cupy.linalg.") for c in linalg)
    assert len(cc.select(CASES, None)) == len(CASES)


def test_resolve_walks_modules_then_attributes():
    mods = {"pkg": argparse.Namespace(sub=argparse.Namespace(fn=len))}

    def import_module(name):
        if name not in mods:
            raise ImportError(name)
        return mods[name]

    assert cc.resolve("pkg.sub.fn", import_module) is len
    with pytest.raises(AttributeError):
        cc.resolve("pkg.sub.nope", import_module)
    with pytest.raises(ImportError):
        cc.resolve("nopkg.x", import_module)


def test_list_needs_no_gpu_and_a_run_without_one_exits_2(capsys, monkeypatch):
    assert cc.main(["--list", "--only", "fft"]) == 0
    assert "cupy.fft.rfft" in capsys.readouterr().out
    from cgraw import _cuda

    monkeypatch.setattr(_cuda, "driver_available", lambda: (False, "no driver here"))
    assert cc.main([]) == 2
    assert "no driver here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cc.main(["--rounds", "0"])


@pytest.mark.cupy
def test_every_function_resolves_in_the_installed_cupy():
    pytest.importorskip("cupy")
    missing = []
    for c in CASES:
        try:
            cc.resolve(c.function)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{c.function}: {exc}")
    assert not missing, missing


# ---------------------------------------------------------------- compare "svd" / "eigh" (factorisations)


def _dev(*values):
    return [cc.Leaf("device", np.asarray(v)) for v in values]


def _svd_case(dtype, shape=(16, 12), full=False, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal(shape)
    a = a.astype(dtype)
    u, s, vt = (x.astype(dtype) if x.ndim == 2 else x.astype(np.dtype(dtype).char.lower())
                for x in np.linalg.svd(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
                                       full_matrices=full))
    return a, u, s, vt


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("full", [True, False])
def test_compare_svd_accepts_sign_or_phase_flipped_vectors(dtype, full):
    a, u, s, vt = _svd_case(dtype, full=full)
    k = s.size
    rng = np.random.default_rng(1)
    ph = np.ones(u.shape[1], u.dtype)
    ph[:k] = (np.exp(1j * rng.uniform(0, 6.3, k)) if u.dtype.kind == "c" else rng.choice([-1, 1], k)).astype(u.dtype)
    u2 = u * ph  # column i of U and row i of VT share one phase: the same factorisation
    vt2 = vt.copy()
    vt2[:k] *= ph[:k, None].conj()
    assert not np.allclose(u2, u)  # elementwise, it would be "silently wrong"
    assert not cc.compare_outputs(_dev(u2, s, vt2), _dev(u, s, vt))["equal"]
    v = cc.compare_factors("svd", _dev(u2, s, vt2), _dev(u, s, vt), [a])
    assert v["equal"], v


def test_compare_svd_refuses_wrong_factors():
    a, u, s, vt = _svd_case("float32")
    want = _dev(u, s, vt)
    bad_u = u.copy()
    bad_u[:, 0] = -bad_u[:, 0]  # U's column flipped without VT's row: orthonormal, but U S VT != A
    v = cc.compare_factors("svd", _dev(bad_u, s, vt), want, [a])
    assert not v["equal"] and "U diag(S) VT - A" in v["reason"]
    swapped = u.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # two columns swapped
    assert not cc.compare_factors("svd", _dev(swapped, s, vt), want, [a])["equal"]
    v = cc.compare_factors("svd", _dev(u * 1.01, s, vt), want, [a])  # not orthonormal
    assert not v["equal"] and "U^H U - I" in v["reason"]
    v = cc.compare_factors("svd", _dev(u, s * 1.01, vt), want, [a])
    assert not v["equal"] and "singular values" in v["reason"]
    other = np.random.default_rng(9).standard_normal(a.shape).astype(np.float32)  # another round's input
    assert not cc.compare_factors("svd", want, want, [other])["equal"]
    nan_u = u.copy()
    nan_u[0, 0] = np.nan
    assert not cc.compare_factors("svd", _dev(nan_u, s, vt), want, [a])["equal"]
    assert not cc.compare_factors("svd", _dev(u.T, s, vt), want, [a])["equal"]  # shape
    assert not cc.compare_factors("svd", _dev(u.astype(np.float64), s, vt), want, [a])["equal"]  # dtype
    assert not cc.compare_factors("svd", _dev(u, s), want, [a])["equal"]
    assert not cc.compare_factors("qr", want, want, [a])["equal"]


def _eigh_case(dtype, n=16, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n)) + (1j * rng.standard_normal((n, n)) if np.dtype(dtype).kind == "c" else 0)
    a = ((x + x.conj().T) / 2).astype(dtype)
    w, v = np.linalg.eigh(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64))
    return a, w.astype(np.dtype(dtype).char.lower()), v.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
def test_compare_eigh_accepts_sign_or_phase_flipped_vectors_and_refuses_wrong_ones(dtype):
    a, w, v = _eigh_case(dtype)
    rng = np.random.default_rng(3)
    n = w.size
    ph = (np.exp(1j * rng.uniform(0, 6.3, n)) if v.dtype.kind == "c" else rng.choice([-1, 1], n)).astype(v.dtype)
    assert cc.compare_factors("eigh", _dev(w, v * ph), _dev(w, v), [a])["equal"]
    swapped = v.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # vectors not with their eigenvalues
    r = cc.compare_factors("eigh", _dev(w, swapped), _dev(w, v), [a])
    assert not r["equal"] and "A V - V diag(w)" in r["reason"]
    assert not cc.compare_factors("eigh", _dev(w, v * 1.01), _dev(w, v), [a])["equal"]
    r = cc.compare_factors("eigh", _dev(w[::-1].copy(), v), _dev(w, v), [a])  # descending order: not eager's
    assert not r["equal"] and "eigenvalues" in r["reason"]


def test_algorithm_compare_allows_rounding_of_another_algorithm_but_not_a_wrong_value():
    from benchmarks import cupy_coverage as cc

    want = np.linspace(0.1, 4.0, 64).astype(np.float32)
    near = want * np.float32(1 + 3e-5)  # a rounding-level difference: over allclose's 1e-5, under 1e-4
    far = want.copy()
    far[7] *= 1.01
    leaf = lambda a: [cc.Leaf("device", a)]  # noqa: E731
    assert not cc.compare_outputs(leaf(near), leaf(want))["equal"]
    assert cc.compare_outputs(leaf(near), leaf(want), algorithm=True)["equal"]
    assert not cc.compare_outputs(leaf(far), leaf(want), algorithm=True)["equal"]
    assert not cc.compare_outputs(leaf(want.astype(np.float64)), leaf(want), algorithm=True)["equal"]
