"""Which CuPy functions a ``cgraw.capture()`` records and replays correctly (a coverage table).

Each case of ``benchmarks._cupy_cases`` (cupy, cupy.linalg, cupy.fft, cupy.random and
cupyx.scipy's ndimage, signal, special and sparse products) runs in one process:

1. its inputs are made with NumPy and copied to the device (``cupy.asarray``) before the capture;
2. the call runs once eagerly (kernel compilation, plan caches, handles);
3. ``with cgraw.capture() as g: out = call(inputs)``;
4. for each round: new host values are written into the same input arrays in place, ``g.replay()``,
   a synchronise, and ``out`` is compared with the eager call on those values.

Outcomes: ``captured_equal``; ``capture_error`` (a ``cgraw.CaptureError``: a clear refusal);
``other_error`` (any other exception in the capture or a replay: not clear); ``silently_wrong``
(recorded and replayed, but not what eager gives: a cgraw bug); ``not_applicable`` (the function
is missing in this CuPy, or its eager call fails here). ``cupy.random`` cases are compared by
distribution, since cgraw draws its own numbers inside captures. ``python3 -m benchmarks.cupy_coverage``
writes ``benchmarks/results/cupy_coverage.json``; exit status 1 when a case is silently wrong, 2
without a GPU or CuPy.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import math
import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import _cupy_cases
from benchmarks._cupy_cases import EXPECT_TEXT, Case, Law
from benchmarks._harness import RESULTS_DIR, Report, no_gpu

CAPTURED_EQUAL, CAPTURE_ERROR, OTHER_ERROR = "captured_equal", "capture_error", "other_error"
SILENTLY_WRONG, NOT_APPLICABLE = "silently_wrong", "not_applicable"
OUTCOMES = (CAPTURED_EQUAL, CAPTURE_ERROR, OTHER_ERROR, SILENTLY_WRONG, NOT_APPLICABLE)
GOAL_PCT = 90.0  # the goal: captured and equal, of the applicable cases
ROUNDS = 2
MESSAGE_CHARS = 200
# (rtol, atol): atol is scaled by max(1, max |eager|); integer and bool outputs compare exactly
TOLERANCES = {"float16": (1e-3, 1e-3), "float32": (1e-5, 1e-6), "complex64": (1e-5, 1e-6),
              "float64": (1e-12, 1e-12), "complex128": (1e-12, 1e-12)}
# compare "svd"/"eigh": (relative) tolerance of the factorisation checks, by the factors' dtype
FACTOR_TOL = {"float32": 1e-4, "complex64": 1e-4, "float64": 1e-10, "complex128": 1e-10}
RANDOM_MEAN_SE = 6.0  # sample mean within this many standard errors
RANDOM_STD_REL = 0.15  # sample standard deviation within this fraction

METHOD = {
    "procedure": "per case, in one process: NumPy inputs copied to the device before the capture; one eager call "
                 "(warm-up); `with cgraw.capture() as g: out = call(inputs)`; then, per round, new host values "
                 "written into the same input arrays in place (`a[...] = cupy.asarray(new)`), g.replay(), a "
                 "synchronise, and out compared with the eager call on the new values",
    "compare": "allclose per output with rtol/atol by dtype (atol scaled by max(1, max|eager|)), NaN equal to NaN; "
               "integer and bool outputs exactly; shapes and dtypes must match; sparse outputs via toarray()",
    "svd/eigh": "cases whose singular vectors or eigenvectors are unique only up to sign/phase (captured: the "
                "batched Jacobi routine; eager: gesvd/syevd): values allclose to eager's; the vectors orthonormal "
                "and the factorisation reproducing the round's input (U diag(S) VT = A, A V = V diag(w)) within "
                f"{FACTOR_TOL['float32']:g} (float32) / {FACTOR_TOL['float64']:g} (float64) times max(1, max|A|) n",
    "algorithm": "cases whose capture runs another algorithm than eager (the single-matrix svd/eigh family: "
                 "the batched Jacobi routine for gesvd/syevd) and whose outputs are unique: allclose with rtol "
                 f"and atol {FACTOR_TOL['float32']:g} (float32) / {FACTOR_TOL['float64']:g} (float64), atol "
                 "scaled by max(1, max|eager|); max_abs_diff records what was seen",
    "random": "cupy.random: cgraw draws its own numbers, so not bitwise: shape and dtype as eager's, two replays "
              "draw different values, values finite and in the law's range (integers whole, choice from its "
              f"population), sample mean within {RANDOM_MEAN_SE:g} standard errors and std within "
              f"{RANDOM_STD_REL:.0%} of the law's",
    "outcomes": "captured_equal; capture_error (cgraw.CaptureError, a clear refusal); other_error (any other "
                "exception during capture or replay: not clear); silently_wrong (replayed, differs from eager: a "
                "cgraw bug, exit status 1); not_applicable (function missing, or its eager call fails here)",
    "values_changed": "false when the eager output did not change with the new input values (the replay "
                      "check is then weak: constants, shapes only)",
    "goal": f"at least {GOAL_PCT:g}% of the applicable cases captured_equal, the rest capture_error, "
            "none silently_wrong",
}


# ---------------------------------------------------------------- outputs on the host


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One output value on the host: ``kind`` is ``device`` (a CuPy array), ``sparse`` (a sparse
    matrix, densified), ``host`` (a Python or NumPy value: it was not made by the graph) or
    ``none``."""

    kind: str
    value: Any


def leaves(out) -> list[Leaf]:
    """The output's arrays on the host, in order (tuples and lists are flattened, dicts by key)."""
    if out is None:
        return [Leaf("none", None)]
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in leaves(item)]
    if isinstance(out, dict):
        return [leaf for key in sorted(out, key=str) for leaf in leaves(out[key])]
    if hasattr(out, "__cuda_array_interface__") and hasattr(out, "get"):
        return [Leaf("device", np.asarray(out.get()))]
    if hasattr(out, "toarray") and hasattr(out, "nnz"):
        dense = out.toarray()
        return [Leaf("sparse", np.asarray(dense.get() if hasattr(dense, "get") else dense))]
    return [Leaf("host", np.array(out, copy=True))]  # a copy: a host array may view an input


def _max_abs_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want| where they differ; NaN against NaN and inf against the same inf are
    equal; a NaN against a number counts as inf."""
    if got.size == 0:
        return 0.0
    if got.dtype.kind in "biu" and want.dtype.kind in "biu":
        return float(np.max(np.abs(got.astype(np.int64) - want.astype(np.int64))))
    if got.dtype.kind not in "fc" or want.dtype.kind not in "fc":
        return 0.0 if np.array_equal(got, want) else math.inf
    wide = np.complex128 if "c" in (got.dtype.kind, want.dtype.kind) else np.float64
    g, w = got.astype(wide), want.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(g - w)
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    d = np.where(same, 0.0, d)
    d = np.where(np.isnan(d), math.inf, d)
    return float(np.max(d))


def _close(got: np.ndarray, want: np.ndarray, exact: bool, algorithm: bool = False) -> bool:
    if exact or want.dtype.kind not in "fc":
        return bool(np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"))
    rtol, atol = TOLERANCES.get(want.dtype.name, TOLERANCES["float32"])
    if algorithm:  # another algorithm than eager's: equal to rounding, at the factorisation checks' tolerance
        rtol = atol = FACTOR_TOL.get(want.dtype.name, FACTOR_TOL["float32"])
    finite = np.abs(want[np.isfinite(want)])
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    return bool(np.allclose(got, want, rtol=rtol, atol=atol * scale, equal_nan=True))


def compare_outputs(got: list[Leaf], want: list[Leaf], *, exact: bool = False, algorithm: bool = False) -> dict:
    """``{"equal", "max_abs_diff", "reason"}`` for a replayed output against eager's."""
    if len(got) != len(want):
        return {"equal": False, "max_abs_diff": None,
                "reason": f"{len(got)} output value(s), eager gives {len(want)}"}
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.kind != w.kind:
            return {"equal": False, "max_abs_diff": None, "reason": f"output {i} is {g.kind}, eager's is {w.kind}"}
        if g.kind == "none":
            continue
        if g.value.shape != w.value.shape or g.value.dtype != w.value.dtype:
            return {"equal": False, "max_abs_diff": None,
                    "reason": f"output {i} is {g.value.dtype}{list(g.value.shape)}, eager's is "
                              f"{w.value.dtype}{list(w.value.shape)}"}
        diff = _max_abs_diff(g.value, w.value)
        worst = max(worst, diff)
        if not _close(g.value, w.value, exact, algorithm):
            return {"equal": False, "max_abs_diff": worst,
                    "reason": f"output {i} ({w.value.dtype}{list(w.value.shape)}) differs from eager's: "
                              f"max abs diff {diff:.3g}"}
    return {"equal": True, "max_abs_diff": worst, "reason": ""}




def compare_factors(kind: str, got: list[Leaf], want: list[Leaf], inputs: list[np.ndarray]) -> dict:
    """``compare_outputs``' verdict for a factorisation whose vectors are unique only up to sign/phase:
    ``svd`` (outputs u, s, vt of ``inputs[0]``) or ``eigh`` (w, v of the Hermitian ``inputs[0]``).

    Shapes and dtypes as eager's; the singular values / eigenvalues allclose to eager's (tolerance by dtype,
    as ``allclose``); the vectors orthonormal (|Q^H Q - I| <= tol) and the factorisation reproducing the input
    (|U[:, :k] diag(S) VT[:k] - A| or |A V - V diag(w)| <= tol * max(1, max|A|) * n); tol from
    ``FACTOR_TOL``. Any other ``kind`` or output structure is not equal."""
    names = {"svd": ("u", "s", "vt"), "eigh": ("w", "v")}.get(kind)
    if names is None or len(want) != len(names):
        return {"equal": False, "max_abs_diff": None, "reason": f"compare {kind!r} does not fit {len(want)} outputs"}
    if len(got) != len(want):
        return {"equal": False, "max_abs_diff": None, "reason": f"{len(got)} output value(s), eager gives {len(want)}"}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.kind != w.kind or w.kind == "none" or g.value.shape != w.value.shape or g.value.dtype != w.value.dtype:
            return {"equal": False, "max_abs_diff": None,
                    "reason": f"output {i} is {g.kind} {getattr(g.value, 'dtype', '')}"
                              f"{list(getattr(g.value, 'shape', ()))}, eager's is {w.kind} "
                              f"{getattr(w.value, 'dtype', '')}{list(getattr(w.value, 'shape', ()))}"}
    out = dict(zip(names, (leaf.value for leaf in got), strict=True))
    ref = dict(zip(names, (leaf.value for leaf in want), strict=True))
    a = np.asarray(inputs[0])
    values = "s" if kind == "svd" else "w"
    if not _close(out[values], ref[values], False):
        return {"equal": False, "max_abs_diff": _max_abs_diff(out[values], ref[values]),
                "reason": f"the {'singular values' if kind == 'svd' else 'eigenvalues'} differ from eager's: max abs "
                          f"diff {_max_abs_diff(out[values], ref[values]):.3g}"}
    vec_dtype = (out["u"] if kind == "svd" else out["v"]).dtype.name
    tol = FACTOR_TOL.get(vec_dtype, FACTOR_TOL["float32"])
    wide = np.complex128
    scale = max(1.0, float(np.abs(a).max()) if a.size else 1.0) * max(a.shape[-2:], default=1)
    if kind == "svd":
        u, s, vt = (out[k].astype(wide) for k in ("u", "s", "vt"))
        k = s.shape[-1]
        checks = (("U^H U - I", u.conj().swapaxes(-1, -2) @ u - np.eye(u.shape[-1]), tol),
                  ("VT VT^H - I", vt @ vt.conj().swapaxes(-1, -2) - np.eye(vt.shape[-2]), tol),
                  ("U diag(S) VT - A", (u[..., :, :k] * s[..., None, :]) @ vt[..., :k, :] - a, tol * scale))
    else:
        w, v = out["w"].astype(wide), out["v"].astype(wide)
        checks = (("V^H V - I", v.conj().swapaxes(-1, -2) @ v - np.eye(v.shape[-1]), tol),
                  ("A V - V diag(w)", a.astype(wide) @ v - v * w[..., None, :], tol * scale))
    worst = _max_abs_diff(out[values], ref[values])
    for label, residual, bound in checks:
        err = float(np.max(np.abs(residual))) if residual.size else 0.0
        if not err <= bound:  # NaN fails too
            return {"equal": False, "max_abs_diff": err, "reason": f"|{label}| = {err:.3g} > {bound:.3g}"}
        worst = max(worst, err)
    return {"equal": True, "max_abs_diff": worst, "reason": ""}


def same_values(a: list[Leaf], b: list[Leaf]) -> bool:
    """Whether two outputs are bitwise the same (NaN equal to NaN)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.kind != y.kind or (x.value is None) != (y.value is None):
            return False
        if x.value is not None and (x.value.shape != y.value.shape or not np.array_equal(
                x.value, y.value, equal_nan=x.value.dtype.kind in "fc" and y.value.dtype.kind in "fc")):
            return False
    return True


def check_random(rounds: list[list[Leaf]], ref: list[Leaf], law: Law, inputs: list[list[np.ndarray]]) -> list[str]:
    """What is wrong with replayed random draws (one output per round, after that round's
    inputs) against ``law``, and eager's draw ``ref`` for shape and dtype; [] when nothing is."""
    arrays = [[leaf for leaf in r if leaf.value is not None and leaf.value.ndim > 0] for r in rounds]
    ref_arrays = [leaf for leaf in ref if leaf.value is not None and leaf.value.ndim > 0]
    if not ref_arrays or any(not a for a in arrays):
        return ["no array output"]
    want = ref_arrays[0].value
    outs = [a[0].value for a in arrays]
    problems = []
    for k, out in enumerate(outs):
        if out.shape != want.shape or out.dtype != want.dtype:
            problems.append(f"replay {k + 1}: {out.dtype}{list(out.shape)}, eager draws {want.dtype}{list(want.shape)}")
    if problems:
        return problems
    if len(outs) > 1 and all(np.array_equal(outs[0], o) for o in outs[1:]):
        problems.append("every replay drew the same numbers")
    for k, out in enumerate(outs):
        problems += [f"replay {k + 1}: {p}" for p in _law_problems(out, law, inputs[k] if k < len(inputs) else [])]
    return problems


def _law_problems(out: np.ndarray, law: Law, inputs: list[np.ndarray]) -> list[str]:
    x = out.astype(np.float64)
    if law.minus is not None:
        x = x - inputs[law.minus].astype(np.float64)
    problems = []
    if not np.all(np.isfinite(x)):
        return ["non-finite values"]
    lo, hi = float(x.min()), float(x.max())
    if law.lo is not None and lo < law.lo:
        problems.append(f"minimum {lo:.6g} below {law.lo:g}")
    if law.hi is not None and (hi > law.hi or (hi == law.hi and not law.closed)):
        problems.append(f"maximum {hi:.6g} not below {law.hi:g}" + (" (closed)" if law.closed else ""))
    if law.integer and not np.all(x == np.round(x)):
        problems.append("values are not whole numbers")
    if law.support is not None and not np.all(np.isin(out, inputs[law.support])):
        problems.append("values outside the population drawn from")
    if law.distinct and np.unique(out).size != out.size:
        problems.append("a value appears twice (not a permutation)")
    n = x.size
    sd = float(x.std())
    if law.mean is not None:
        se = (law.std if law.std is not None else sd) / math.sqrt(n)
        if abs(float(x.mean()) - law.mean) > RANDOM_MEAN_SE * se:
            problems.append(f"mean {float(x.mean()):.4g}, expected {law.mean:g} "
                            f"(tolerance {RANDOM_MEAN_SE * se:.3g})")
    if law.std is not None and abs(sd - law.std) > RANDOM_STD_REL * law.std:
        problems.append(f"std {sd:.4g}, expected {law.std:g} (within {RANDOM_STD_REL:.0%})")
    return problems


# ---------------------------------------------------------------- errors


def error_kind(text: str) -> str:
    """Which kind of refusal a CaptureError's text names (the keys of ``_cupy_cases.EXPECT_TEXT``),
    ``invalidated`` or ``other``."""
    low = text.lower()
    for key, words in (("cuBLAS", ("cublas",)), ("cuSOLVER", ("cusolver",)), ("cuSPARSE", ("cusparse",)),
                       ("upload", ("host-to-device", "upload")), ("host sync", ("host synchronisation",)),
                       ("rng", ("cupy.random", "rng_not_covered"))):
        if any(w in low for w in words):
            return key
    return "invalidated" if "invalidated" in low else "other"


def _text(exc: BaseException, limit: int = MESSAGE_CHARS) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- one case


@dataclasses.dataclass
class Runtime:
    """What a case runs against: the real one is CuPy and cgraw (``gpu_runtime``); the CPU tests
    pass NumPy and a fake recorder.

    ``resolve(path)`` finds a function; ``to_device(host)`` copies a NumPy array to the device;
    ``record(fn)`` captures ``fn()`` and returns ``(graph, out)`` (``graph.replay()``,
    ``graph.close()``); ``capture_error`` is ``cgraw.CaptureError``; ``sync()`` waits for the device.
    """

    ns: Any
    resolve: Callable[[str], Any]
    to_device: Callable[[np.ndarray], Any]
    record: Callable[[Callable[[], Any]], tuple]
    capture_error: type
    sync: Callable[[], None]


def run_case(case: Case, rt: Runtime, *, rounds: int = ROUNDS) -> dict:
    """The case's row: its outcome and what was seen (never raises for the case's own failures)."""
    row = {"name": case.name, "function": case.function, "module": case.module, "section": case.section,
           "compare": case.compare, "inputs": [_describe(spec) for spec in case.inputs], "expect": case.expect}
    if case.note:
        row["note"] = case.note
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _run(case, rt, rounds, row)
        finally:
            try:
                rt.sync()
            except Exception as exc:  # noqa: BLE001 -- a sticky device error: recorded, the run goes on
                row["sync_error"] = _text(exc)
    seen = list(dict.fromkeys(_one_line(w.message, 160) for w in caught))
    if seen:
        row["warnings"] = seen[:3]
    row["wall_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    if case.expect is not None:
        row["expect_text"] = EXPECT_TEXT.get(case.expect, case.expect)
    row["as_expected"] = _as_expected(row)
    return row


def _as_expected(row: dict) -> bool | None:
    if row["outcome"] == NOT_APPLICABLE:
        return None
    if row["expect"] is None:
        return row["outcome"] == CAPTURED_EQUAL
    return row["outcome"] == CAPTURE_ERROR and row.get("error_kind") == row["expect"]


def _run(case: Case, rt: Runtime, rounds: int, row: dict) -> None:
    try:
        f = rt.resolve(case.function)
    except (ImportError, AttributeError) as exc:
        row.update(outcome=NOT_APPLICABLE, reason=f"not in this CuPy: {_text(exc)}")
        return
    seed = zlib.crc32(case.name.encode())
    rng = np.random.default_rng(seed)
    phase = "inputs"
    try:
        host = case.host_inputs(rng)
        arrays = [rt.to_device(h) for h in host]
        phase = "setup"
        args = tuple(case.setup(rt.ns, *arrays)) if case.setup is not None else tuple(arrays)
        phase = "eager call"
        first = leaves(case.invoke(f, args))
        rt.sync()
    except Exception as exc:  # noqa: BLE001 -- the case cannot be measured here: recorded
        row.update(outcome=NOT_APPLICABLE, reason=f"eager {phase} failed: {_text(exc)}", eager_failed=True)
        return
    row["host_output"] = any(leaf.kind == "host" for leaf in first)

    graph = out = None
    try:
        phase = "capture"
        graph, out = rt.record(lambda: case.invoke(f, args))
        got_rounds, inputs_rounds, diffs, changed = [], [], [], False
        for r in range(rounds):
            phase = f"replay {r + 1}"
            new = case.host_inputs(rng)
            for dev, h in zip(arrays, new, strict=True):
                dev[...] = rt.to_device(h)
            graph.replay()
            rt.sync()
            got = leaves(out)
            if case.compare == "random":
                got_rounds.append(got)
                inputs_rounds.append(new)
                continue
            phase = f"eager reference {r + 1}"
            want = leaves(case.invoke(f, args))
            changed = changed or not same_values(want, first)
            if case.compare in ("svd", "eigh"):  # vectors unique up to sign/phase: the factorisation is checked
                verdict = compare_factors(case.compare, got, want, new)
            else:
                verdict = compare_outputs(got, want, exact=case.compare == "exact",
                                          algorithm=case.compare == "algorithm")
            diffs.append(verdict["max_abs_diff"])
            if not verdict["equal"]:
                row.update(outcome=SILENTLY_WRONG, reason=f"round {r + 1}: {verdict['reason']}",
                           max_abs_diff=verdict["max_abs_diff"])
                return
    except rt.capture_error as exc:
        kind = error_kind(str(exc))
        if kind == "other" and exc.__cause__ is not None:
            kind = error_kind(repr(exc.__cause__))
        row.update(outcome=CAPTURE_ERROR, phase=phase, message=_one_line(exc, MESSAGE_CHARS),
                   reason=_one_line(getattr(exc, "description", "") or exc, 400), error_kind=kind,
                   cause=type(exc.__cause__).__name__ if exc.__cause__ is not None else None)
        return
    except Exception as exc:  # noqa: BLE001 -- any other failure is recorded as not clear
        row.update(outcome=OTHER_ERROR, phase=phase, message=_text(exc), reason=_text(exc))
        return
    finally:
        out = None
        if graph is not None:
            try:
                graph.close()
            except Exception as exc:  # noqa: BLE001 -- recorded; the next case still runs
                row["close_error"] = _text(exc)

    if case.compare == "random":
        problems = check_random(got_rounds, first, case.law or Law(), inputs_rounds)
        if problems:
            row.update(outcome=SILENTLY_WRONG, reason="; ".join(problems)[:400])
            return
        row.update(outcome=CAPTURED_EQUAL, reason="distribution checked (cgraw draws its own numbers)")
        return
    row.update(outcome=CAPTURED_EQUAL, reason="", values_changed=changed,
               max_abs_diff=max((d for d in diffs if d is not None), default=0.0))


def _describe(spec) -> str:
    if isinstance(spec, _cupy_cases.Arr):
        rng = "" if spec.lo is None else f" [{spec.lo:g}, {spec.hi:g})"
        return f"{spec.dtype}{list(spec.shape)}{rng}" + (f" nan {spec.nan:g}" if spec.nan else "")
    return getattr(spec, "label", repr(spec))


# ---------------------------------------------------------------- the table


def summarize(rows: list[dict]) -> dict:
    """Counts per outcome, per module and section, the percentage captured and equal, and the
    lists a reader acts on (silently wrong, other errors, cases not as the registry expected)."""
    counts = collections.Counter(r["outcome"] for r in rows)
    applicable = len(rows) - counts[NOT_APPLICABLE]
    pct = 100.0 * counts[CAPTURED_EQUAL] / applicable if applicable else None
    clear = counts[CAPTURED_EQUAL] + counts[CAPTURE_ERROR]

    def per(key):
        table: dict = {}
        for r in rows:
            t = table.setdefault(r[key], {o: 0 for o in OUTCOMES} | {"cases": 0, "seconds": 0.0})
            t[r["outcome"]] += 1
            t["cases"] += 1
            t["seconds"] = round(t["seconds"] + r.get("wall_ms", 0.0) / 1e3, 3)
        return table

    def names(outcome, field="reason"):
        return [{"name": r["name"], field: r.get(field)} for r in rows if r["outcome"] == outcome]

    return {
        "cases": len(rows),
        "functions": len({r["function"] for r in rows}),
        "counts": {o: counts[o] for o in OUTCOMES},
        "applicable": applicable,
        "captured_equal_pct": pct,
        "clear_pct": 100.0 * clear / applicable if applicable else None,
        "goal_pct": GOAL_PCT,
        "goal_met": bool(pct is not None and pct >= GOAL_PCT and not counts[SILENTLY_WRONG]
                         and not counts[OTHER_ERROR]),
        "passed": not counts[SILENTLY_WRONG],
        "silently_wrong": names(SILENTLY_WRONG),
        "other_error": names(OTHER_ERROR, "message"),
        "capture_error_kinds": dict(collections.Counter(r.get("error_kind") for r in rows
                                                        if r["outcome"] == CAPTURE_ERROR)),
        "not_applicable": names(NOT_APPLICABLE),
        "weak_checks": [r["name"] for r in rows if r.get("values_changed") is False],
        "host_outputs": [r["name"] for r in rows if r.get("host_output")],
        "not_as_expected": [{"name": r["name"], "expect": r["expect"], "outcome": r["outcome"],
                             "error_kind": r.get("error_kind")} for r in rows if r.get("as_expected") is False],
        "by_module": per("module"),
        "by_section": per("section"),
    }


def print_table(summary: dict, rows: list[dict], tag: str = "[cupy_coverage]") -> None:
    c = summary["counts"]
    pct = summary["captured_equal_pct"]
    print(f"{tag} {summary['cases']} cases, {summary['functions']} functions; "
          f"captured and equal {c[CAPTURED_EQUAL]}/{summary['applicable']} applicable"
          + (f" ({pct:.1f}%, goal {GOAL_PCT:g}%)" if pct is not None else ""))
    head = "".join(f"{o.replace('_', ' '):>16}" for o in OUTCOMES)
    print(f"{tag} {'module':<22}{'cases':>6}{head}{'s':>8}")
    for mod, t in summary["by_module"].items():
        cells = "".join(f"{t[o]:>16}" for o in OUTCOMES)
        print(f"{tag} {mod:<22}{t['cases']:>6}{cells}{t['seconds']:>8.1f}")
    cells = "".join(f"{c[o]:>16}" for o in OUTCOMES)
    print(f"{tag} {'all':<22}{summary['cases']:>6}{cells}")
    if summary["capture_error_kinds"]:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["capture_error_kinds"].items(), key=lambda kv: -kv[1]))
        print(f"{tag} capture errors by kind: {kinds}")
    rest = [r for r in rows if r["outcome"] != CAPTURED_EQUAL]
    if rest:
        print(f"{tag} not captured and equal:")
    for r in sorted(rest, key=lambda r: OUTCOMES.index(r["outcome"])):
        why = r.get("reason") or r.get("message") or ""
        kind = f"[{r['error_kind']}] " if r.get("error_kind") else ""
        print(f"{tag}   {r['outcome']:<15} {r['name']:<46} {kind}{_one_line(why, 110)}")
    if summary["not_as_expected"]:
        print(f"{tag} not as the registry expected: "
              + ", ".join(f"{d['name']} ({d['outcome']})" for d in summary["not_as_expected"]))


# ---------------------------------------------------------------- the GPU run


def resolve(path: str, import_module=importlib.import_module):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = import_module(".".join(parts[:k]))
        except ImportError:
            if k == 1:
                raise
            continue
        for name in parts[k:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def gpu_runtime(cupy, sparse, cgraw) -> Runtime:
    def record(fn):
        with cgraw.capture() as g:
            out = fn()
        return g, out

    return Runtime(ns=argparse.Namespace(cp=cupy, sparse=sparse), resolve=resolve, to_device=cupy.asarray,
                   record=record, capture_error=cgraw.CaptureError,
                   sync=lambda: cupy.cuda.Device().synchronize())


def select(cases: list[Case], only: str | None) -> list[Case]:
    """The cases whose section equals, or whose name starts with, one of ``only``'s comma-separated
    words (all cases when ``only`` is None)."""
    if not only:
        return list(cases)
    words = [w.strip() for w in only.split(",") if w.strip()]
    return [c for c in cases if any(c.section == w or c.name.startswith(w) for w in words)]


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n=} must be at least 1")
    return n


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.cupy_coverage", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated sections or name prefixes (cupy.linalg, fft, ...)")
    ap.add_argument("--rounds", type=_positive, default=ROUNDS, help="replays with new input values per case")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cupy_coverage.json)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    chosen = select(_cupy_cases.cases(), args.only)
    if args.list:
        for c in chosen:
            print(f"{c.section:<15} {c.name:<50} {c.compare:<9} {c.expect or ''}")
        print(f"{len(chosen)} cases, {len({c.function for c in chosen})} functions")
        return 0
    t_start = time.perf_counter()
    if no_gpu():
        return 2
    try:
        import cupy
        from cupyx.scipy import sparse
    except Exception as exc:  # noqa: BLE001 -- CuPy is what this measures
        print(f"benchmarks.cupy_coverage needs CuPy: {_text(exc)}", file=sys.stderr)
        return 2
    import cgraw

    cupy.random.seed(0)  # graphed draws follow CuPy's generator, as eager ones do
    rep = Report("cupy_coverage")
    rt = gpu_runtime(cupy, sparse, cgraw)
    for i, case in enumerate(chosen):
        row = run_case(case, rt, rounds=args.rounds)
        rep.rows.append(row)  # printed compactly here, not by Report.add
        kind = f" [{row['error_kind']}]" if row.get("error_kind") else ""
        print(f"[cupy_coverage] {i + 1:>3}/{len(chosen)} {case.name:<46} {row['outcome']:<15}{kind} "
              f"{row['wall_ms']:>8.1f} ms", flush=True)
    summary = summarize(rep.rows)
    print_table(summary, rep.rows)
    total_s = time.perf_counter() - t_start
    path = rep.save({"method": METHOD, "summary": summary, "total_s": total_s, "expect_kinds": EXPECT_TEXT,
                     "options": {"only": args.only, "rounds": args.rounds, "tolerances": TOLERANCES}},
                    path=args.out or os.path.join(RESULTS_DIR, "cupy_coverage.json"))
    print(f"results: {path}")
    print(f"[cupy_coverage] total {total_s:.1f} s", flush=True)
    return 1 if summary["silently_wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
