"""GPU tier: the scenarios of torch's graph-tree tests (test/inductor/test_cudagraph_trees.py) that
exercise ``mode="reduce-overhead"``, run against ``torch.compile(backend="cgraw")``
(tests/helpers/compile_scenarios.py; the CPU harness runs them too, in
tests/unit/test_compile_backend_trees_cpu.py). Here an ended step's output raises cgraw's error
when read, and the pieces are captured and replayed as CUDA graphs. Each scenario runs twice:
with ``options={"whole_graph": False}`` (by partitions), and with inference graphs graphed whole
(the default), where a replay runs none of AOT autograd's or Inductor's Python."""

from __future__ import annotations

import importlib

import pytest
from gpu_data import full_fp32

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")

import compile_scenarios as sc  # noqa: E402

graphed_mod = importlib.import_module("cgraw.trees.graphed")


@pytest.fixture(params=["partitions", "whole_graph"])
def env(request):
    torch._dynamo.reset()
    graphed_mod.forget_without_graphs()
    whole = {"whole_graph": request.param == "whole_graph"}

    def compile_fn(fn, dynamic, options):
        return torch.compile(fn, backend="cgraw", dynamic=dynamic, options={**whole, **options})

    def overwritten(t):
        try:
            t + 0
        except RuntimeError as exc:
            assert "overwritten by a subsequent run" in str(exc), exc
            assert "cgraw.mark_step_begin()" in str(exc), exc  # the error names the fix
            return True
        return False

    with full_fp32():
        yield sc.Env("cuda", compile_fn, overwritten)
    torch._dynamo.reset()
    graphed_mod.forget_without_graphs()


@pytest.mark.parametrize("scenario", sc.SCENARIOS, ids=lambda f: f.__name__)
def test_a_scenario_of_torchs_graph_tree_tests(env, scenario):
    """One scenario of ``tests/helpers/compile_scenarios.py`` (each named by the behaviour it checks)."""
    scenario(env)


def test_a_device_copy_cuts_the_graph_into_graphed_pieces(env):
    """The graph-partition tests of torch's trees (a CPU op between GPU ops): Inductor cuts the
    graph around the device copies; the GPU pieces on either side are graphed and replay, and the
    result equals eager's. (The CPU harness has no second device.)"""

    def f(x):
        y = torch.relu(x) * 2.0
        z = y.cpu() + 1.0  # a device copy and a CPU op
        return torch.tanh(z.cuda()) + y

    c = env.compile(f, "device_copy")
    for _ in range(5):
        x = env.rand(64)
        sc.close(c(x), f(x))
    parts = sc.replayed(env, "device_copy")
    assert len(parts) >= 2, parts
