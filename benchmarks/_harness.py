"""Benchmark harness: timing loops, environment record, result table and JSON.

Host time is ``perf_counter_ns`` around loops of submissions; device time comes from CUDA events
(see ``device_ms``). Every figure is a median over repetitions, after a warm-up.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def host_us(fn, *, loops: int = 1000, repeats: int = 7, warmup: int = 50, sync=None) -> dict:
    """Median and p90 host microseconds per call of ``fn`` (``sync`` runs between repeats)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter_ns() - t0) / loops / 1e3)
        if sync:
            sync()
    samples.sort()
    return {"median_us": statistics.median(samples), "p90_us": samples[int(0.9 * (len(samples) - 1))],
            "repeats": repeats, "loops": loops}


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


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        import cuda.bindings

        env["cuda_bindings"] = cuda.bindings.__version__
        import cgraw
        from cgraw import _cuda

        env["driver_version"] = _cuda.driver_get_version()
        env["gpu"] = cgraw.Device(0).name
    except Exception as exc:  # the environment record never stops a run
        env["cuda_error"] = str(exc)
    for mod in ("torch", "cupy", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env


class Report:
    """Collects rows, prints each as it arrives, and writes one JSON file."""

    def __init__(self, name: str):
        self.name = name
        self.rows: list[dict] = []
        self.missing: dict[str, str] = {}
        self.env = environment()

    def add(self, **row) -> dict:
        self.rows.append(row)
        cols = " ".join(f"{k}={_fmt(v)}" for k, v in row.items())
        print(f"[{self.name}] {cols}", flush=True)
        return row

    def peer_missing(self, peer: str, reason: str) -> None:
        self.missing[peer] = reason
        print(f"[{self.name}] peer missing: {peer}: {reason}", flush=True)

    def save(self, extra: dict | None = None, path: str | None = None) -> str:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        path = path or os.path.join(RESULTS_DIR, f"{self.name}.json")
        doc = {"benchmark": self.name, "environment": self.env, "missing_peers": self.missing,
               "rows": self.rows, **(extra or {})}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
