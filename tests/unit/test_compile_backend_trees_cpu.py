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


def test_every_scenario_runs_here():
    names = {f.__name__ for f in sc.SCENARIOS}
    assert names == {n[len("test_"):] for n in globals() if n.startswith("test_") and n != "test_every_scenario_runs_here"}
