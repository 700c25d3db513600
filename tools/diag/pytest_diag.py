"""A pytest plugin for diagnosing a process abort of a GPU tier: ``-p tools.diag.pytest_diag`` (from
the repository root, as ``bash tools/gpu_session.sh segv`` runs it).

Every feature is off unless its environment variable is set:

- ``CGRAW_DIAG_LOG=path``: ``START``/``END`` per test with its seconds, flushed and synced before the
  test runs, so the log of a process that died names the test it died in.
- ``CGRAW_DIAG_SEGV=path`` of ``segv_handler.so`` (built from ``segv_handler.c``): a native backtrace
  on SIGSEGV, SIGBUS and SIGABRT, written to ``CGRAW_DIAG_NATIVE_OUT``. The handler is installed again
  at every test start (another library replaces it otherwise), before Python's faulthandler runs.
- ``CGRAW_DIAG_WALK=1``: after each test, torch's segments by private pool, and how many belong to a
  MemPool no cgraw pool holds any more (walks torch's allocator state: a corrupted one crashes here).
- ``CGRAW_DIAG_REFCOUNTS=path``: objects (gc-tracked, module attributes, enum members of torch,
  CuPy, cuda-bindings and cgraw) whose reference count falls test after test, which is what an
  extension that releases a reference it does not own leaves behind.
- ``CGRAW_DIAG_NOREBIND=1``: ``cgraw.config.rebind_inputs = False``; ``CGRAW_DIAG_KEEPSTREAMS=1``:
  cgraw never destroys a stream (a library handle left bound to a destroyed stream is then harmless).
- ``CGRAW_DIAG_AUTOGRAD=1``: ``cgraw.config.autograd = True`` before every test (a test's own
  fixture may still turn it off): the whole tier with autograd through graphed functions on.
"""

from __future__ import annotations

import enum
import gc
import os
import sys
import time
from collections import Counter

_env = os.environ.get
_log = None
_handler = None
_kept_streams: list = []
_t0 = [0.0]
_series: dict = {}  # id -> (type, description, [reference counts after each test])
_tests = [0]
_PREFIXES = ("cuda", "torch", "cupy", "cupy_backends", "cgraw", "numpy", "enum")


def _write(line: str) -> None:
    if _log is not None:
        _log.write(line + "\n")
        _log.flush()
        os.fsync(_log.fileno())


def pytest_sessionstart(session):
    global _log, _handler
    if _env("CGRAW_DIAG_LOG"):
        _log = open(_env("CGRAW_DIAG_LOG"), "a", buffering=1)
    if _env("CGRAW_DIAG_SEGV"):
        import ctypes

        _handler = ctypes.CDLL(_env("CGRAW_DIAG_SEGV"))
    if _env("CGRAW_DIAG_NOREBIND") == "1":
        import cgraw

        cgraw.config.rebind_inputs = False
        _write("config: rebind_inputs=False")
    if _env("CGRAW_DIAG_KEEPSTREAMS") == "1":
        from cgraw import _cuda

        destroy = _cuda.destroy_quietly

        def keep_streams(kind, handle, *args, **kwargs):
            if kind == "stream":
                _kept_streams.append(handle)
                return None
            return destroy(kind, handle, *args, **kwargs)

        _cuda.destroy_quietly = keep_streams  # stream finalizers look it up when a stream is made
        _write("config: streams are never destroyed")


def pytest_runtest_setup(item):
    if _env("CGRAW_DIAG_AUTOGRAD") == "1":
        import cgraw

        cgraw.config.autograd = True


def pytest_runtest_logstart(nodeid, location):
    if _handler is not None:
        _handler.segv_install()
    _t0[0] = time.perf_counter()
    _write(f"START {nodeid}")


def pytest_runtest_logfinish(nodeid, location):
    line = f"END {nodeid} {time.perf_counter() - _t0[0]:.2f}s"
    if _env("CGRAW_DIAG_WALK") == "1":
        line += " " + torch_pools()
    if _env("CGRAW_DIAG_KEEPSTREAMS") == "1":
        line += f" kept_streams={len(_kept_streams)}"
    _write(line)
    if _env("CGRAW_DIAG_REFCOUNTS"):
        _watch_refcounts()


def torch_pools() -> str:
    """torch's segments by private pool, after a collection; orphans: pools of a dead MemPool."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return ""
    gc.collect()
    from cgraw.interop.torch import private_api

    segs = private_api.memory_segments()  # never torch.cuda.memory_snapshot(pool id): torch frees the id
    pools, alloc = Counter(), Counter()
    for s in segs:
        pid = tuple(s.get("segment_pool_id", (0, 0)))
        pools[pid] += 1
        alloc[pid] += sum(1 for b in s["blocks"] if b["state"] == "active_allocated")
    private = {p for p in pools if p != (0, 0)}
    from cgraw.interop.torch.pools import TorchPool

    alive = {tuple(o.id) for o in gc.get_objects() if type(o) is TorchPool}
    orphans = private - alive
    return (f"segments={len(segs)} private_pools={len(private)} orphan_pools={len(orphans)} "
            f"orphan_blocks={sum(alloc[p] for p in orphans)}")


def _candidates() -> dict:
    objs = {id(o): o for o in gc.get_objects()}
    for name in list(sys.modules):
        if not name.startswith(_PREFIXES):
            continue
        try:
            values = list(vars(sys.modules[name]).values())
        except (TypeError, KeyError):
            continue
        for v in values:
            objs[id(v)] = v
            if isinstance(v, type) and issubclass(v, enum.Enum):
                for m in v.__members__.values():
                    objs[id(m)] = m
    return objs


def _watch_refcounts() -> None:
    _tests[0] += 1
    if _tests[0] < 3:  # imports and first-use caches settle first
        return
    objs = _candidates()
    if _tests[0] == 3:
        for i, o in objs.items():
            try:
                desc = repr(o)[:90]
            except Exception:  # noqa: BLE001 - any repr may fail
                desc = "?"
            _series[i] = (type(o), desc, [sys.getrefcount(o) - 2])
        return
    for i, (t, _desc, counts) in _series.items():
        o = objs.get(i)
        counts.append(sys.getrefcount(o) - 2 if o is not None and type(o) is t else None)
    if _tests[0] % 5 == 0:
        refcount_report(_env("CGRAW_DIAG_REFCOUNTS"))


def falling(series: dict) -> list[tuple]:
    """``(net change, falls, rises, type, description)`` of the series that fall steadily."""
    rows = []
    for t, desc, counts in series.values():
        vals = []
        for v in counts:
            if v is None:
                break
            vals.append(v)
        if len(vals) < 5:
            continue
        falls = sum(1 for a, b in zip(vals, vals[1:]) if b < a)
        rises = sum(1 for a, b in zip(vals, vals[1:]) if b > a)
        net = vals[-1] - vals[0]
        if net < 0 and falls >= 3 * max(rises, 1):
            rows.append((net, falls, rises, f"{t.__module__}.{t.__qualname__}", desc))
    return sorted(rows)


def refcount_report(path: str) -> None:
    rows = falling(_series)
    with open(path, "w") as f:
        f.write(f"tests={_tests[0]} watched={len(_series)} falling={len(rows)}\n")
        for net, falls, rises, tname, desc in rows[:40]:
            f.write(f"net={net} falls={falls} rises={rises} {tname} {desc}\n")


def pytest_sessionfinish(session, exitstatus):
    if _env("CGRAW_DIAG_REFCOUNTS") and _series:
        refcount_report(_env("CGRAW_DIAG_REFCOUNTS"))
    _write(f"SESSION END exit={int(exitstatus)}")
