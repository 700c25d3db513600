"""GPU-tier fixtures: every GPU test must leave no graph or executable graph behind."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def no_leaked_graphs():
    from cgraw import _cuda

    gc.collect()
    before = {k: _cuda.live_handles[k] for k in ("graph", "graph_exec")}
    yield
    gc.collect()
    after = {k: _cuda.live_handles[k] for k in ("graph", "graph_exec")}
    assert after == before, f"graph handles leaked: before {before}, after {after}"


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
