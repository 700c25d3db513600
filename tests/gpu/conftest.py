"""GPU-tier fixtures: every GPU test must leave no graph or executable graph behind."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session):
    """torch's, CuPy's and the test modules' import-time objects never become garbage: freeze them
    out of the collector's reach once collected, so that the full collections around every test
    (the leak checks below, the pool fixture) walk only what the tests made. One full collection
    of torch's objects alone took 88 ms on a 2-core development machine; the tier
    runs about four per test."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_leaked_graphs():
    from stress import settle

    from cgraw import _cuda

    gc.collect()
    settle()  # under CGRAW_GC_STRESS: stress collections skip what was alive before this test
    before = {k: _cuda.live_handles[k] for k in ("graph", "graph_exec")}
    yield
    gc.collect()
    after = {k: _cuda.live_handles[k] for k in ("graph", "graph_exec")}
    assert after == before, f"graph handles leaked: before {before}, after {after}\n{_holders()}"


def _holders(depth: int = 4) -> str:
    """Who keeps unclosed ``cgraw.Graph`` objects alive (for the leak message)."""
    import types

    from cgraw.runtime.graph import Graph

    lines = []
    graphs = [o for o in gc.get_objects() if type(o) is Graph and not o.closed]
    for g in graphs[:3]:
        frontier, seen = [(g, 0)], {id(graphs)}
        while frontier:
            obj, level = frontier.pop()
            for r in gc.get_referrers(obj):
                if id(r) in seen or r is frontier or isinstance(r, types.FrameType) and r.f_code.co_name == "_holders":
                    continue
                seen.add(id(r))
                if isinstance(r, types.FrameType):
                    what = f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})"
                elif isinstance(r, types.TracebackType):
                    what = f"traceback at {r.tb_frame.f_code.co_name}:{r.tb_lineno}"
                else:
                    what = f"{type(r).__module__}.{type(r).__qualname__}"
                lines.append("  " * (level + 1) + what)
                if level + 1 < depth and len(lines) < 60:
                    frontier.append((r, level + 1))
    return "holders of leaked graphs:\n" + "\n".join(lines)


@pytest.fixture
def fresh_trees():
    """No graph tree before the test, none after it (modules opt in with ``usefixtures``)."""
    import cgraw

    cgraw.mark_step_begin()
    cgraw.reset()
    yield
    cgraw.mark_step_begin()
    cgraw.reset()
    gc.collect()


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and cgraw's list of code run without graphs emptied before and after the
    test, which runs with TF32 off (``gpu_data.full_fp32``); a failure's captured log says why a
    frame recompiled (modules that compile opt in with ``usefixtures``)."""
    import importlib

    import torch
    from gpu_data import full_fp32

    graphed_mod = importlib.import_module("cgraw.trees.graphed")
    torch._dynamo.reset()
    graphed_mod.forget_without_graphs()
    torch._logging.set_logs(recompiles=True)
    try:
        with full_fp32():
            yield
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
        graphed_mod.forget_without_graphs()
