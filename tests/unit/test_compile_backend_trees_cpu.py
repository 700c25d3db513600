"""CPU tier: the scenarios of torch's graph-tree tests for ``torch.compile(backend="cgraw")``
(tests/helpers/compile_scenarios.py) on the CPU harness (tests/helpers/compile_cpu.py): Inductor's
partitions as graphed functions of CPU trees. What the harness cannot show stays on the GPU
(tests/gpu/test_compile_backend_trees.py): an ended step's outputs are not poisoned here, only
handed to the backend to poison, and nothing is captured."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import compile_scenarios as sc  # noqa: E402
from compile_cpu import cpu_partitions  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def env(monkeypatch):
    with cpu_partitions(monkeypatch) as h:
        def compile_fn(fn, dynamic, options):
            return h.compile(fn, dynamic=dynamic, **options)

        def overwritten(t):
            return any(p is t for be in h.backends for p in be.poisoned)

        torch.manual_seed(0)
        yield sc.Env("cpu", compile_fn, overwritten)


@pytest.mark.parametrize("scenario", sc.SCENARIOS, ids=lambda f: f.__name__)
def test_a_scenario_of_torchs_graph_tree_tests(env, scenario):
    """One scenario of ``tests/helpers/compile_scenarios.py`` (each named by the behaviour it checks)."""
    scenario(env)


def test_every_scenario_written_is_run():
    """Each scenario function of ``compile_scenarios`` (taking an ``Env``) is in ``SCENARIOS``,
    which both tiers run."""
    import inspect

    written = {name for name, f in vars(sc).items() if inspect.isfunction(f) and f.__module__ == sc.__name__
               and list(inspect.signature(f).parameters) == ["env"]}
    assert written == {f.__name__ for f in sc.SCENARIOS}
