"""Benchmark harness: timing loops, checks against eager, the run's record, result table and JSON.

Host time is ``perf_counter_ns`` around loops of submissions; device time comes from CUDA events.
Every figure is a median over repetitions, after a warm-up. Every system is checked against eager
with ``Report.check`` before it is timed; a failed check stops that system's timing and is written
to the JSON. Every JSON names its run (``environment()["run_id"]``): one id per process, passed on
to child processes through ``CGRAW_RUN_ID``. The device machine gets no ``.git``: set
``CGRAW_GIT_COMMIT`` (e.g. ``$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo -dirty)``
taken on the checkout that was sent) where git cannot answer.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def no_gpu() -> bool:
    """True, after saying why on stderr, when this machine has no CUDA driver: a benchmark's
    ``main`` then returns 2."""
    from cgraw import _cuda

    ok, reason = _cuda.driver_available()
    if not ok:
        print(f"benchmarks need a CUDA GPU: {reason}", file=sys.stderr)
    return not ok


def host_us(fn, *, loops: int = 1000, repeats: int = 7, warmup: int = 50, sync=None) -> dict:
    """Median and p90 host microseconds per call of ``fn`` (``sync`` runs between repeats, outside
    the timed loop: with ``loops`` small, each repeat is a burst submitted to a drained queue);
    ``host_us_interleaved`` with one system, after at least ``warmup`` calls."""
    r = host_us_interleaved({"fn": fn}, loops=loops, rounds=repeats, warmup=-(-warmup // loops), sync=sync)["fn"]
    return {"median_us": r["median_us"], "p90_us": r["p90_us"], "repeats": repeats, "loops": loops}


def host_us_interleaved(systems: dict, *, loops: int = 100, rounds: int = 41, warmup: int = 3, sync=None,
                        seed: int = 0) -> dict:
    """``{name: {"median_us", "p90_us", "samples"}}`` for no-argument callables ``systems[name]``,
    timed in bursts of ``loops`` calls, the systems in a shuffled order in each of ``rounds``
    rounds, ``sync`` after every burst (outside the timed region). A machine whose speed drifts
    (clocks, another tenant) then moves every system alike, and per-round ratios stay fair."""
    names = list(systems)
    for name in names:
        for _ in range(warmup):
            for _ in range(loops):
                systems[name]()
            if sync:
                sync()
    samples = {name: [] for name in names}
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            fn = systems[name]
            t0 = time.perf_counter_ns()
            for _ in range(loops):
                fn()
            samples[name].append((time.perf_counter_ns() - t0) / loops / 1e3)
            if sync:
                sync()
    out = {}
    for name, v in samples.items():
        v_sorted = sorted(v)
        out[name] = {"median_us": statistics.median(v_sorted), "p90_us": percentile(v_sorted, 0.9), "samples": v}
    return out


def alternating(fn, inputs, *extra):
    """A no-argument call of ``fn(inputs[k], *extra)`` with ``k`` alternating between 0 and 1, so
    every call brings inputs at other addresses than the call before."""
    state = [0]

    def run():
        state[0] ^= 1
        fn(inputs[state[0]], *extra)

    return run


def host_sync_us(fn, sync, *, loops: int = 200, repeats: int = 7, warmup: int = 20) -> dict:
    """Like ``host_us`` but the timed region includes a final ``sync()`` (submit + completion)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        sync()
        samples.append((time.perf_counter_ns() - t0) / loops / 1e3)
    return {"median_us": statistics.median(samples), "repeats": repeats, "loops": loops}


# ---------------------------------------------------------------------- statistics


def percentile(sorted_values, q: float) -> float:
    """Linear-interpolated ``q``-quantile (0..1) of an already sorted list."""
    if not sorted_values:
        return float("nan")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_ci(groups, stat=statistics.median, *, n_boot: int = 4000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` over the values of ``groups`` (a list of lists).

    Two-level when there are several groups (resample the groups, then values within each), so a
    difference between groups (child processes, say) widens the interval as it should.
    """
    rng = random.Random(seed)
    groups = [list(g) for g in groups if g]
    if not groups:
        return float("nan"), float("nan")
    stats = []
    for _ in range(n_boot):
        picked = [groups[rng.randrange(len(groups))] for _ in groups] if len(groups) > 1 else groups
        sample = []
        for g in picked:
            sample.extend(g[rng.randrange(len(g))] for _ in g)
        stats.append(stat(sample))
    stats.sort()
    a = (1.0 - level) / 2
    return percentile(stats, a), percentile(stats, 1.0 - a)


def verdict(ci: tuple[float, float], limit: float) -> str:
    """``met`` when the whole interval is at or under ``limit``, ``missed`` when it is all above,
    else ``unresolved`` (take more samples)."""
    lo, hi = ci
    if hi <= limit:
        return "met"
    if lo > limit:
        return "missed"
    return "unresolved"


# ---------------------------------------------------------------------- the run's record


def _run(cmd, timeout: float = 5.0) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict:
    """``{"git_commit", "git_dirty", "git_source"}``; never raises. ``CGRAW_GIT_COMMIT`` wins (a
    trailing ``-dirty`` sets the flag), else git itself; unknown parts are None."""
    env = os.environ.get("CGRAW_GIT_COMMIT", "").strip()
    if env:
        dirty = env.endswith("-dirty")
        return {"git_commit": env[: -len("-dirty")] if dirty else env, "git_dirty": dirty, "git_source": "env"}
    # only this checkout's own .git: a copy of the tree inside another repository must not report that one
    commit = _run(["git", "rev-parse", "--short", "HEAD"]) if os.path.exists(os.path.join(REPO_ROOT, ".git")) else None
    if not commit:
        return {"git_commit": None, "git_dirty": None, "git_source": None}
    # --no-optional-locks: a read-only look, the index is not refreshed on disk
    status = _run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"])
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status), "git_source": "git"}


def run_id(commit: str | None = None) -> str:
    """One id for every JSON this process (and its children) writes: UTC start time + commit."""
    rid = os.environ.get("CGRAW_RUN_ID")
    if not rid:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        rid = f"{stamp}-{commit or 'nocommit'}"
        os.environ["CGRAW_RUN_ID"] = rid  # inherited by child processes
    return rid


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _nvidia_driver() -> str | None:
    """The kernel driver's version string (e.g. 580.159.04): NVML through ctypes, else nvidia-smi."""
    try:
        import ctypes

        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() == 0:
            buf = ctypes.create_string_buffer(96)
            ok = nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0
            nvml.nvmlShutdown()
            if ok:
                return buf.value.decode()
    except (OSError, AttributeError):  # no NVML library, or an old one without these calls
        pass
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], timeout=20)
    return out.splitlines()[0].strip() if out else None


def _version(module: str, dists: tuple = ()) -> str | None:
    """A package's version without importing it (a CPU-only benchmark stays CPU-only)."""
    mod = sys.modules.get(module)
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    from importlib import metadata

    for dist in dists or (module,):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(*, gpu: bool = True) -> dict:
    """The run's record: run id, date, git commit, host, library versions and, with ``gpu``, the
    GPU, its driver and the CUDA driver API version. Failures are recorded, never raised."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **git_state(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    env["run_id"] = run_id(env["git_commit"] and env["git_commit"] + ("-dirty" if env["git_dirty"] else ""))
    env["cuda_bindings"] = _version("cuda.bindings", ("cuda-bindings", "cuda-python"))
    env["torch"] = _version("torch")
    env["cupy"] = _version("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy"))
    env["numpy"] = _version("numpy")
    if gpu:
        env["driver_version"] = _nvidia_driver()
        try:
            import cgraw
            from cgraw import _cuda

            ok, reason = _cuda.driver_available()
            if ok:
                env["cuda_driver_api"] = _cuda.driver_get_version()
                env["gpu"] = cgraw.Device(0).name
            else:
                env["cuda_error"] = reason
        except Exception as exc:  # noqa: BLE001 -- the environment record never stops a run
            env["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return env


# ---------------------------------------------------------------------- the report


class Report:
    """Collects rows and checks, prints each as it arrives, and writes one JSON file."""

    def __init__(self, name: str, *, gpu: bool = True):
        self.name = name
        self.rows: list[dict] = []
        self.missing: dict[str, str] = {}
        self.checked: list[str] = []
        self.failed_checks: dict[str, str] = {}
        self.env = environment(gpu=gpu)
        print(f"[{self.name}] run {self.env['run_id']}", flush=True)

    def add(self, **row) -> dict:
        self.rows.append(row)
        cols = " ".join(f"{k}={_fmt(v)}" for k, v in row.items())
        print(f"[{self.name}] {cols}", flush=True)
        return row

    def peer_missing(self, peer: str, reason: str) -> None:
        self.missing[peer] = reason
        print(f"[{self.name}] peer missing: {peer}: {reason}", flush=True)

    def check(self, system: str, fn) -> bool:
        """Run ``fn`` (it compares ``system``'s result with eager and raises when they differ).
        False, and the failure recorded, when it raised: then do not time ``system``."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 -- any failure of the check is recorded
            msg = f"{type(exc).__name__}: {exc}"
            self.failed_checks[system] = msg[:1000]
            print(f"[{self.name}] CHECK FAILED, not timed: {system}: {msg[:300]}", flush=True)
            return False
        self.checked.append(system)
        return True

    def save(self, extra: dict | None = None, path: str | None = None) -> str:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        path = path or os.path.join(RESULTS_DIR, f"{self.name}.json")
        doc = {"benchmark": self.name, "run_id": self.env.get("run_id"), "environment": self.env,
               "missing_peers": self.missing, "checked_against_eager": self.checked,
               "failed_checks": self.failed_checks, "rows": self.rows, **(extra or {})}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        if self.failed_checks:
            print(f"[{self.name}] {len(self.failed_checks)} system(s) failed their check and were not timed: "
                  f"{', '.join(self.failed_checks)}", flush=True)
        return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
