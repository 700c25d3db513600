"""GPU tier: the scenarios of torch's graph-tree tests (test/inductor/test_cudagraph_trees.py) that
exercise ``mode="reduce-overhead"``, run against ``torch.compile(backend="cgraw")``
(tests/helpers/compile_scenarios.py; the CPU harness runs them too, in
tests/unit/test_compile_backend_trees_cpu.py). Here an ended step's output raises cgraw's error
when read, and the pieces are captured and replayed as CUDA graphs."""

from __future__ import annotations

import importlib

import pytest
from gpu_data import full_fp32

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_trees")]
torch = pytest.importorskip("torch")

import compile_scenarios as sc  # noqa: E402

graphed_mod = importlib.import_module("cgraw.trees.graphed")


@pytest.fixture
def env():
    torch._dynamo.reset()
    graphed_mod.forget_without_graphs()

    def compile_fn(fn, dynamic, options):
        return torch.compile(fn, backend="cgraw", dynamic=dynamic, options=options)

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


def test_each_input_shape_records_its_own_graph(env):
    sc.each_input_shape_records_its_own_graph(env)


def test_results_follow_warm_up_recording_and_replay(env):
    sc.results_follow_warm_up_recording_and_replay(env)


def test_pieces_called_twice_in_one_step_form_a_path(env):
    sc.pieces_called_twice_in_one_step_form_a_path(env)


def test_an_output_overwritten_by_a_later_replay_is_invalid(env):
    sc.an_output_overwritten_by_a_later_replay_is_invalid(env)


def test_cloned_outputs_stay_valid(env):
    sc.cloned_outputs_stay_valid(env)


def test_mark_step_begin_lets_a_later_piece_write_an_earlier_output(env):
    sc.mark_step_begin_lets_a_later_piece_write_an_earlier_output(env)


def test_an_input_written_in_place_is_graphed_and_written_back(env):
    sc.an_input_written_in_place_is_graphed_and_written_back(env)


def test_a_module_buffer_written_in_place_is_graphed(env):
    sc.a_module_buffer_written_in_place_is_graphed(env)


def test_outputs_viewing_one_another_share_storage(env):
    sc.outputs_viewing_one_another_share_storage(env)


def test_outputs_aliasing_a_parameter_are_the_parameter(env):
    sc.outputs_aliasing_a_parameter_are_the_parameter(env)


def test_a_forward_and_its_backward_are_recorded(env):
    sc.a_forward_and_its_backward_are_recorded(env)


def test_a_backward_of_one_output_only_keeps_the_next_steps_right(env):
    sc.a_backward_of_one_output_only_keeps_the_next_steps_right(env)


def test_a_retained_graph_backward_twice_accumulates(env):
    sc.a_retained_graph_backward_twice_accumulates(env)


def test_dynamic_sizes_record_one_graph_per_size(env):
    sc.dynamic_sizes_record_one_graph_per_size(env)


def test_unaligned_inputs_give_eager_results(env):
    sc.unaligned_inputs_give_eager_results(env)


def test_expanded_inputs_give_eager_results(env):
    sc.expanded_inputs_give_eager_results(env)


def test_empty_outputs_keep_their_shapes(env):
    sc.empty_outputs_keep_their_shapes(env)


def test_random_numbers_follow_the_generator(env):
    sc.random_numbers_follow_the_generator(env)


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


def test_every_scenario_runs_here():
    names = {f.__name__ for f in sc.SCENARIOS}
    assert names <= {n[len("test_"):] for n in globals() if n.startswith("test_")}
